"""The worker processes of ``chunkzero train``, whatever their framework: how a failure reads, and a
launcher of plain local processes.

Shared: :data:`EXIT_PEER_LOST` (a worker that only saw another one vanish), :class:`WorkerFailure`
(the error naming the worker that failed first) and :func:`describe_exit`. The torch engine launches
through torch's elastic agent (:mod:`torch_backend.train.launch`); the JAX engine through
:func:`launch_processes` here: ``nproc`` copies of one command, in one process group of their own,
each told its place in the environment (:data:`COORDINATOR_ENV`, :data:`NUM_PROCESSES_ENV`,
:data:`PROCESS_ID_ENV`, the names an external launcher sets too) and writing its outcome as JSON to
``<result_dir>/process<i>.json`` (never pickled). The launcher polls them; when one fails, the others
are stopped (SIGTERM, then SIGKILL after ``grace_s``) and :class:`WorkerFailure` names the first that
failed — one that exited with :data:`EXIT_PEER_LOST` is a consequence, named only when nothing else
failed.

A run's processes die with it, on both engines: in the launcher, SIGTERM, SIGINT and SIGHUP raise
:class:`Stopped` (after the workers are stopped, :func:`stopped_message` is the one line the CLI prints,
the exit status ``128 + signal``); in a worker, :func:`exit_on_stop_signals` makes them end the process
at once (no traceback, no interpreter finalization; a checkpoint being written is left as an
uncommitted temporary, never as a step), and :func:`watch_launcher` ends it when its launcher is gone,
even by SIGKILL (EOF on a pipe only the launcher holds open; unlike ``PR_SET_PDEATHSIG`` this does not
depend on which of the launcher's threads started it).

Imports the standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from .errors import ChunkZeroError, ConfigError

EXIT_PEER_LOST = 3
"""A worker exits with this when a collective failed because another worker vanished (a consequence,
never the cause)."""


class WorkerFailure(ChunkZeroError, RuntimeError):
    """A worker process failed; ``rank`` is the one that failed first (the cause), ``exitcode`` its code."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None):
        self.rank = rank
        self.exitcode = exitcode
        super().__init__(message)


def describe_exit(exitcode: int, timeout_s: float | None = None) -> str:
    """How a worker's exit code reads: ``"exited with code 1"``, ``"was killed by SIGKILL (...)"``, or what
    :data:`EXIT_PEER_LOST` means (``timeout_s``: the run's ``--timeout``, which it then names)."""
    if exitcode == EXIT_PEER_LOST:
        if timeout_s is None:
            return "lost contact with another worker, which stopped without a report (on another node?)"
        return (f"lost contact with another worker: a collective did not finish within --timeout {timeout_s:g} s "
                "(another worker stopped without a report, e.g. on another node, or --timeout is shorter than "
                "the run's collectives take)")
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = (
            " (killed by the operating system, e.g. out of memory, or by a user)" if -exitcode == signal.SIGKILL else ""
        )
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode}"


def last_line(text: str | None) -> str:
    """The last non-empty line of ``text`` (a traceback's error line), stripped; ``""`` if none."""
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
"""``host:port`` of process 0's coordination service (the name ``jax.distributed.initialize`` reads)."""
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
"""The number of processes of the run."""
PROCESS_ID_ENV = "JAX_PROCESS_ID"
"""This process's index, ``0 .. JAX_NUM_PROCESSES - 1``."""
RESULT_DIR_ENV = "CHUNKZERO_RESULT_DIR"
"""Where a launched process writes ``process<i>.json`` (set by :func:`launch_processes` only)."""
LAUNCHER_FD_ENV = "CHUNKZERO_LAUNCHER_FD"
"""The read end of a pipe whose write end only the launcher holds (:func:`watch_launcher`)."""
LAUNCHER_PID_ENV = "CHUNKZERO_LAUNCHER_PID"
"""The launcher's pid: a worker whose parent is another process outlived its launcher."""
LAUNCH_DIR_ENV = "CHUNKZERO_LAUNCH_DIR"
"""The launcher's temp directory, which the workers remove when they outlive the launcher (``kill -9``)."""


def launch_env(launch_dir: str | os.PathLike) -> dict[str, str]:
    """What a launcher adds to its workers' environment so that the workers remove ``launch_dir`` (the
    launcher's temp directory) should the launcher die without doing it (:func:`exit_on_stop_signals`,
    :func:`watch_launcher`)."""
    return {LAUNCHER_PID_ENV: str(os.getpid()), LAUNCH_DIR_ENV: str(launch_dir)}


def remove_orphaned_launch_dir(launcher_gone: bool = False, *, wait_s: float = 0.0) -> None:
    """In a worker of a launch whose launcher is gone (``launcher_gone``, or this process has another
    parent now, or its launcher no longer runs, within ``wait_s`` seconds): remove the launcher's temp
    directory. Every worker does, as it exits: the last one out removes what the others' exits left in it.

    ``wait_s``: for torch's ``PR_SET_PDEATHSIG``, which comes when the launcher's thread that started this
    process ends: under ``kill -9`` that thread can die before the rest of the launcher, so the signal can
    come while the launcher still is this process's parent."""
    launcher, where = os.environ.get(LAUNCHER_PID_ENV), os.environ.get(LAUNCH_DIR_ENV)
    if not (launcher and where):
        return
    deadline = time.monotonic() + wait_s
    while not (launcher_gone or str(os.getppid()) != launcher or not process_running(int(launcher))):
        if time.monotonic() >= deadline:
            return
        time.sleep(0.02)
    shutil.rmtree(where, ignore_errors=True)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop a run: ``kill``, Ctrl-C, a closed terminal."""


def signal_name(signum: int) -> str:
    """``"SIGTERM"``; ``"SIGINT (Ctrl-C)"``."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    return name + (" (Ctrl-C)" if signum == signal.SIGINT else "")


def stopped_message(signum: int, checkpoints: str | None = None) -> str:
    """The one line a launcher stopped by ``signum`` prints after its workers are stopped (both engines);
    ``checkpoints`` says what the run has saved (:func:`chunkzero.run_dir.stopped_run_checkpoints`)."""
    return f"stopped by {signal_name(signum)}; every worker was stopped" + (f" ({checkpoints})" if checkpoints else "")


class Stopped(BaseException):
    """The launcher was told to stop by signal ``signum``. A ``BaseException`` (as ``KeyboardInterrupt``),
    so no ``except Exception`` on the way out swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(stopped_message(signum))


@contextmanager
def signals_raise_stopped() -> Iterator[None]:
    """In a launcher's main thread: :data:`STOP_SIGNALS` raise :class:`Stopped` while the block runs (the
    previous handlers are restored after). Elsewhere (another thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_stopped(signum, frame):
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, raise_stopped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, RuntimeError, ValueError):  # (RuntimeError: a reentrant write)
            pass
    os._exit(code)


def exit_on_stop_signals(*, at_once: bool = False, launcher_exit_wait_s: float = 0.0) -> None:
    """In a worker's main thread: :data:`STOP_SIGNALS` end the process at once with status
    ``128 + signal``, without a traceback or interpreter finalization (where a framework's threads and
    destructors print errors or abort). A checkpoint being written stays an uncommitted temporary, which
    the next save or resume of the run removes; committed steps are untouched.

    ``at_once``: leave the signals to their default action instead (``SIG_DFL``): the kernel ends the process
    on the signal itself, even while its main thread is blocked in C++ (a collective waiting for a peer),
    where a Python handler runs only once that call returns, and this process's JAX client could meanwhile
    see its coordination service vanish and abort with absl's fatal lines. The exit is then "killed by the
    signal", with nothing flushed or removed. For every worker but the one that is last out
    (:func:`outlive_on_stop`).

    ``launcher_exit_wait_s``: on SIGINT, how long to wait for the launcher to be gone before leaving its temp
    directory to it (:data:`LAUNCHER_EXIT_WAIT_S` for torch's spawned workers, whose ``PR_SET_PDEATHSIG``
    SIGINT can come while the launcher still dies; 0 for the JAX engine's, which see their launcher end on a
    pipe, and whose processes must leave together).

    Call it again after a library installs its own handler: ``jax.distributed.initialize`` installs a
    SIGTERM handler for its preemption notifier, under which ``kill`` would not stop the process
    (:func:`reclaim_stop_signals`). Does nothing outside the main thread (Python allows handlers only there)."""
    global _stop_signals_owned
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame):
        if _outlived:
            _wait_until_gone(*_outlived)
        # the launcher died (torch's spawn: PR_SET_PDEATHSIG sends SIGINT, maybe while the launcher still dies)
        remove_orphaned_launch_dir(wait_s=launcher_exit_wait_s if signum == signal.SIGINT else 0.0)
        _exit_now(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL if at_once else stop)
    _stop_signals_owned = {"at_once": at_once, "launcher_exit_wait_s": launcher_exit_wait_s}


_stop_signals_owned: dict | None = None
"""How :func:`exit_on_stop_signals` set this process's stop signals (its arguments), ``None`` outside a worker
of ``chunkzero train``."""
_outlived: tuple[tuple[int, ...], float] | None = None
"""The processes a stop waits for, and for how long at most (:func:`outlive_on_stop`)."""
LAUNCHER_EXIT_WAIT_S = 1.0
"""How long a worker stopped by SIGINT waits for its launcher to be gone before it leaves the launcher's temp
directory to it (:func:`remove_orphaned_launch_dir`): a Ctrl-C, which the launcher gets too, ends one second
later; torch's ``PR_SET_PDEATHSIG`` after a ``kill -9`` of the launcher finds it gone within that."""
OUTLIVE_WAIT_S = 5.0
"""The longest a stop waits for the other workers to be gone (:func:`outlive_on_stop`): the launchers stop
every worker at once, and kill what still runs after 5 s (the JAX engine) or 10 s (torch elastic)."""


def reclaim_stop_signals() -> None:
    """After a library that installs its own SIGTERM handler started (``jax.distributed.initialize`` in a
    torch worker's first checkpoint save): :func:`exit_on_stop_signals` again, as this process had it, where
    it is a worker that had it; nothing elsewhere (a user's own process keeps its handlers)."""
    if _stop_signals_owned:
        exit_on_stop_signals(**_stop_signals_owned)


def outlive_on_stop(pids: Iterable[int], wait_s: float = OUTLIVE_WAIT_S) -> None:
    """Make a stop signal end this process only once the processes ``pids`` are gone (this one's own pid is
    ignored), or after ``wait_s`` seconds; a signal handled by :func:`exit_on_stop_signals` (not ``at_once``).

    For the worker that hosts JAX's coordination service, process 0 of ``jax.distributed`` in a torch run
    (rank 0 once it saved; not the JAX engine, whose processes all stop in their handlers, being in JAX
    collectives with each other): when it exits first, every other process's JAX client
    loses the service and ends its process with absl's fatal lines (``F… Terminating process because the JAX
    distributed service detected fatal errors``). The others stop ``at_once``, so this one is last out, and
    also the one to remove an orphaned launcher's temp directory after them."""
    global _outlived
    _outlived = (tuple(int(p) for p in pids if int(p) != os.getpid()), float(wait_s))


def process_running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has ended: only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _wait_until_gone(pids: Sequence[int], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(process_running(p) for p in pids):
        time.sleep(0.02)


def watch_launcher() -> bool:
    """End this process when its launcher is gone: a daemon thread waits for EOF on the pipe
    :func:`launch_processes` passes (:data:`LAUNCHER_FD_ENV`), which comes when the launcher exits in any
    way, ``kill -9`` included. The process then removes the launcher's temp directory (:func:`launch_env`),
    which nobody else would remove; every process exits with status ``128 + SIGHUP``.

    Returns whether a launcher is watched (``False`` when not started by :func:`launch_processes`)."""
    fd = os.environ.get(LAUNCHER_FD_ENV)
    if not fd:
        return False
    fd_num = int(fd)

    def wait_for_eof() -> None:
        try:
            while os.read(fd_num, 1):
                pass
        except OSError:
            pass
        remove_orphaned_launch_dir(launcher_gone=True)  # (EOF can come before this process is reparented)
        _exit_now(128 + signal.SIGHUP)

    threading.Thread(target=wait_for_eof, name="chunkzero-launcher-watch", daemon=True).start()
    return True


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_result(result: Mapping, process_id: int | None = None) -> None:
    """Write this launched process's outcome (JSON) where :func:`launch_processes` reads it; nothing
    outside a launch (no :data:`RESULT_DIR_ENV`)."""
    where = os.environ.get(RESULT_DIR_ENV)
    if not where:
        return
    i = int(os.environ.get(PROCESS_ID_ENV, 0)) if process_id is None else process_id
    path = Path(where) / f"process{i}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(result)), encoding="utf-8")
    os.replace(tmp, path)


def _read_result(result_dir: Path, i: int) -> dict | None:
    try:
        r = json.loads((result_dir / f"process{i}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return r if isinstance(r, dict) else None


def _stop_group(procs: list[subprocess.Popen], pgid: int, grace_s: float) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace_s`` to whatever still runs; reap them all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if all(p.poll() is not None for p in procs):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered
            pass


def _failure(failures: list[tuple[float, int, int]], results: dict[int, dict | None],
             pids: dict[int, int], timeout_s: float | None = None) -> WorkerFailure:
    """The :class:`WorkerFailure` of ``failures`` (``(time seen, process, exit code)``)."""
    cause = min(failures, key=lambda f: (f[2] == EXIT_PEER_LOST, f[0], f[1]))
    _, i, code = cause
    msg = f"process {i} (pid {pids[i]}) {describe_exit(code, timeout_s)}"
    r = results.get(i) or {}
    if code > 0 and code != EXIT_PEER_LOST and r.get("message"):
        msg += f": {last_line(r['message'])}"
    others = sorted(j for _, j, _ in failures if j != i)
    if others:
        msg += f"; then process(es) {', '.join(map(str, others))} stopped"
    return WorkerFailure(msg + "; the run was stopped", rank=i, exitcode=code)


def _forward_lines(stream, drop: re.Pattern[bytes]) -> None:
    """Copy ``stream`` (a launched process's stdout pipe) to this process's file descriptor 1 line by line,
    leaving out the lines ``drop`` matches, until EOF (the pipe is always drained, even when fd 1 fails)."""
    with stream:
        for line in iter(stream.readline, b""):
            if drop.match(line):
                continue
            view = memoryview(line)
            try:
                while view:
                    view = view[os.write(1, view):]
            except OSError:  # this process's stdout is closed: drop the rest, keep draining the pipe
                pass


def launch_processes(command: Sequence[str], nproc: int, result_dir: str | os.PathLike, *,
                     env: Mapping[str, str] | None = None, finish_timeout_s: float = 60.0,
                     poll_s: float = 0.1, grace_s: float = 5.0, peer_lost_wait_s: float = 3.0,
                     peer_timeout_s: float | None = None, drop_stdout: re.Pattern[bytes] | None = None) -> list[dict]:
    """Run ``nproc`` copies of ``command`` on this machine, in one new process group, and wait for all.

    Process ``i`` finds :data:`COORDINATOR_ENV` (a free port on 127.0.0.1), :data:`NUM_PROCESSES_ENV`,
    :data:`PROCESS_ID_ENV` and :data:`RESULT_DIR_ENV` in its environment (``env``, default this
    process's, plus those), and reports with :func:`write_result`. Its stderr is this process's; so is its
    stdout, unless ``drop_stdout``.

    Args:
        result_dir: an existing directory for the processes' results.
        finish_timeout_s: once one process has exited successfully, the longest the others may take to
            follow; past it they are stopped as failed (a process that hangs at the end).
        poll_s: how often the processes are polled, in seconds.
        grace_s: seconds between SIGTERM and SIGKILL when stopping them.
        peer_lost_wait_s: after a process exits with :data:`EXIT_PEER_LOST`, how long to wait for the
            cause to show before stopping the rest.
        peer_timeout_s: the processes' collective timeout (``--timeout``), named when the only failure is a
            lost peer.
        drop_stdout: the lines of the processes' stdout to leave out (``re.Pattern.match`` on each line, as
            bytes), e.g. what a library prints there on its own; the others are forwarded to this process's
            stdout line by line (through a pipe each, read by a thread). ``None``: the processes write to
            this process's stdout directly.

    Returns:
        Each process's result (``{"status": ...}``), by process index.

    Raises:
        WorkerFailure: a process exited non-zero, or exited 0 without a result; the others were stopped.
        ConfigError: ``nproc`` is not a positive int.
        Stopped: this (main) thread got SIGTERM, SIGINT or SIGHUP; raised after the processes were stopped.
        KeyboardInterrupt: after stopping the processes.

    Each process is also told to watch this one (:func:`watch_launcher`): killed, even by SIGKILL, it
    leaves none of them running.
    """
    from .errors import ConfigError

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be a positive int, got {nproc!r}")
    result_dir = Path(result_dir)
    base = dict(os.environ if env is None else env)
    base.update({COORDINATOR_ENV: f"127.0.0.1:{free_local_port()}", NUM_PROCESSES_ENV: str(nproc),
                 RESULT_DIR_ENV: str(result_dir)})
    procs: list[subprocess.Popen] = []
    watch_r, watch_w = os.pipe()  # the write end stays here (not inheritable): EOF there = this process gone
    base[LAUNCHER_FD_ENV] = str(watch_r)
    base.update(launch_env(result_dir))
    forwarders: list[threading.Thread] = []
    with signals_raise_stopped():
        try:
            return _run_processes(command, nproc, result_dir, base, procs, watch_r, finish_timeout_s, poll_s,
                                  grace_s, peer_lost_wait_s, peer_timeout_s, drop_stdout, forwarders)
        except BaseException:
            if procs:
                _stop_group(procs, procs[0].pid, grace_s)
            raise
        finally:
            for fd in (watch_r, watch_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            for t in forwarders:  # the processes' last lines, before the caller prints its own
                t.join(timeout=grace_s)


def _run_processes(command, nproc, result_dir, base, procs, watch_r, finish_timeout_s, poll_s, grace_s,
                   peer_lost_wait_s, peer_timeout_s, drop_stdout, forwarders) -> list[dict]:
    """:func:`launch_processes`' start and wait (``procs`` and ``forwarders`` filled as they start)."""
    pgid = 0
    for i in range(nproc):
        p = subprocess.Popen(list(command), env={**base, PROCESS_ID_ENV: str(i)}, process_group=pgid,
                             pass_fds=(watch_r,), stdout=None if drop_stdout is None else subprocess.PIPE)
        pgid = pgid or p.pid
        procs.append(p)
        if drop_stdout is not None:
            forwarders.append(threading.Thread(target=_forward_lines, args=(p.stdout, drop_stdout),
                                               name=f"chunkzero-stdout-{i}", daemon=True))
            forwarders[-1].start()
    pids = {i: p.pid for i, p in enumerate(procs)}
    failures: list[tuple[float, int, int]] = []
    first_done = None
    while True:
        now = time.monotonic()
        for i, p in enumerate(procs):
            code = p.poll()
            if code is None or any(j == i for _, j, _ in failures):
                continue
            if code == 0 and _read_result(result_dir, i) is None:
                code = 1  # exited without saying how: a failure, not a success
            if code != 0:
                failures.append((now, i, code))
            elif first_done is None:
                first_done = now
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        if failures:
            if all(code == EXIT_PEER_LOST for _, _, code in failures) and running \
                    and now - failures[0][0] < peer_lost_wait_s:
                time.sleep(poll_s)
                continue
            _stop_group(procs, pgid, grace_s)
            for i, p in enumerate(procs):  # those that died of the stop: named as stopped after the cause
                if not any(j == i for _, j, _ in failures) and p.returncode not in (0, None):
                    failures.append((time.monotonic(), i, p.returncode))
            raise _failure(failures, {i: _read_result(result_dir, i) for i in range(nproc)}, pids, peer_timeout_s)
        if not running:
            return [_read_result(result_dir, i) or {} for i in range(nproc)]
        if first_done is not None and now - first_done > finish_timeout_s:
            i = running[0]
            _stop_group(procs, pgid, grace_s)
            raise WorkerFailure(f"process {i} (pid {pids[i]}) did not finish within {finish_timeout_s:g} s of "
                                "the first one; the run was stopped", rank=i, exitcode=None)
        time.sleep(poll_s)


# ================================================================================ CPU workers per core

MAX_WORKERS_PER_CORE = 8
"""CPU workers (torch ranks, JAX CPU devices) beyond the cores run oversubscribed, up to this many per core."""


def available_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_worker(local_workers: int) -> int:
    """Intra-op threads of each of ``local_workers`` workers (torch ranks, JAX processes) on this machine:
    ``max(1, cores // workers)``, so the workers together do not oversubscribe the cores."""
    return max(1, available_cpu_cores() // max(1, local_workers))


CPU_THREADS_ENV = "CHUNKZERO_CPU_THREADS"
"""A JAX process's XLA:CPU threads (:func:`jax_backend.processes.bound_cpu_threads`); ``chunkzero train --backend
jax`` sets it to :func:`threads_per_worker` of its processes unless it is set; ``0``: XLA's default (every core)."""


def check_cpu_workers(workers: int, what: str, *, cores: int, threads_each: int | None = None) -> None:
    """Refuse more than :data:`MAX_WORKERS_PER_CORE` CPU workers per core; warn (logger ``chunkzero.train``,
    one line) when there are more workers than ``cores``. Both engines' launchers call it: ``what`` names
    the options that asked for them (``"--nproc 3"``); ``threads_each``: each worker's intra-op threads,
    when the engine sets them.

    Raises:
        ConfigError: naming ``what`` and the limit.
    """
    limit = MAX_WORKERS_PER_CORE * cores
    if workers > limit:
        raise ConfigError(f"{what} is more than this machine allows: at most {limit} CPU workers allowed "
                          f"({MAX_WORKERS_PER_CORE} per available core)")
    if workers > cores:
        threads = f", {threads_each} thread each," if threads_each is not None else ""
        logging.getLogger("chunkzero.train").warning(
            "warning: %s on %d CPU core(s): the workers run oversubscribed%s and share the cores (slower per step, "
            "same results)", what, cores, threads)
