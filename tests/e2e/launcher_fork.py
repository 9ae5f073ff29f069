"""``chunkzero train`` launchers forked from a process that has imported them once: :func:`run_forked`.

Each ``python -m chunkzero.cli train`` run starts a launcher that imports torch and ``torch._dynamo`` (the memory
plan's ``FakeTensorMode``), or JAX for the JAX engine, before the workers start: forking it instead saves about 2.4
s of CPU and 3 s of wall time a gpt-tiny run (``benchmarks/bench_launcher_fork.py``). One server process per engine
and test process imports the launcher's modules once and forks a launcher for each run. The fork is a process of its
own as the command's would be: its own session, working directory, environment, standard streams (files, read back
as ``subprocess.run`` returns them) and exit status; it runs ``chunkzero.cli.main`` and ends as the project's
workers do (its threads, exit hooks, a flush, then exit without finalization:
:func:`chunkzero.process_exit.exit_without_finalization`). Its workers are started by the launcher's own code
(spawned: fresh interpreters), so nothing of the server reaches them. A run that outlives its timeout is killed with
its session (the launcher and its workers, whatever their process groups) and raises ``subprocess.TimeoutExpired``.

What the imports themselves print (a warning at import) reaches the test's stderr once, from the server, not
each run's stderr: a test of exactly what a run prints at start-up starts the command itself.

The server only imports modules and waits on its request pipe: it starts no thread and no JAX backend of its
own, so a fork takes no lock held by another thread (as torch's own forked data loader workers rely on). It ends
at the EOF of that pipe, when its test process ends.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

_PRELOAD = {
    "torch": ("torch", "torch._dynamo", "torch_backend.train.launch", "torch_backend.train.resolve",
              "torch_backend.train.worker", "torch_backend.train.process_exit", "torch_backend.plan",
              "torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing", "chunkzero.cli"),
    "jax": ("jax_backend.train.run", "chunkzero.cli"),
}
"""What each engine's launcher imports before its first fork: what ``chunkzero train`` imports before it starts
workers (``torch._dynamo`` comes with the plan's ``FakeTensorMode``)."""


def _child(request: dict) -> None:
    """In the fork: become the command's process and run it; never returns."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR as the environment says
        os.chdir(request["cwd"])
        import chunkzero.cli

        sys.argv = [chunkzero.cli.__file__, *request["argv"]]
        code = chunkzero.cli.main(request["argv"])
        code = 0 if code is None else code
    except SystemExit as e:  # argparse's own checks
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (an interpreter prints what ends it, then exits 1)
        traceback.print_exc()
    finally:
        from chunkzero.process_exit import exit_without_finalization

        exit_without_finalization(code if isinstance(code, int) else 1)  # its threads, exit hooks, flush, exit


def serve(engine: str) -> None:
    """The server: import ``engine``'s launcher, then for each request line on stdin (``{"argv", "cwd", "env",
    "stdout", "stderr"}``) fork a launcher and answer ``{"pid"}`` at once and ``{"returncode"}`` when it ends."""
    import importlib

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    requests = os.fdopen(os.dup(0), "r")
    null = os.open(os.devnull, os.O_RDWR)  # nothing of the server's own reaches the replies
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    for name in _PRELOAD[engine]:
        importlib.import_module(name)
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        if threading.active_count() != 1:
            raise RuntimeError(f"the launchers' server would fork beside threads: {threading.enumerate()}")
        pid = os.fork()
        if pid == 0:
            try:
                replies.close()
                requests.close()
                _child(request)
            finally:
                os._exit(1)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


def _import_env(env: dict[str, str]) -> dict[str, str]:
    """What of an environment the server may have read as it imported: all but pytest's per-test variables."""
    return {k: v for k, v in env.items() if not k.startswith("PYTEST_")}


class _Server:
    def __init__(self, engine: str, env: dict[str, str]):
        repo = str(Path(__file__).resolve().parents[2])
        boot = f"import sys; sys.path.insert(0, {repo!r}); from tests.e2e.launcher_fork import serve; serve({engine!r})"
        self.env = _import_env(env)
        self.proc = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, bufsize=0)
        self.pending = b""
        self.busy = False  # a request sent whose last reply has not been read: the next reply is not ours

    def _reply(self, deadline: float) -> dict | None:
        """The server's next reply line, or ``None`` at ``deadline`` (read from the pipe itself: a buffered
        reader could hold a second line that ``select`` no longer sees)."""
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the forked launchers' server ended (exit {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        cmd = ["chunkzero", *argv]
        with tempfile.TemporaryDirectory(prefix="launcher-fork-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            request = (json.dumps({"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out),
                                   "stderr": str(err)}) + "\n").encode()
            deadline = time.monotonic() + timeout
            reply = None
            self.busy = True
            try:
                while request:
                    request = request[os.write(self.proc.stdin.fileno(), request):]
                if self._reply(deadline) is not None:  # {"pid"}; the first one waits for the server's imports too
                    reply = self._reply(deadline)
            except BaseException:  # pytest's own timeout, Ctrl-C: the run and its server go, with no reply owed
                self.kill()
                raise
            if reply is None:
                self.kill()
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
            self.busy = False
            return subprocess.CompletedProcess(cmd, reply["returncode"], out.read_text(), err.read_text())

    def kill(self) -> None:
        """Kill this server and the session of any launcher it forked (the launcher and its workers)."""
        processes = _processes()
        for launcher in [pid for pid, (ppid, _) in processes.items() if ppid == self.proc.pid]:
            for pid, (_, sid) in processes.items():
                if launcher in (pid, sid):  # its session, whatever the groups in it (the JAX workers have one)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self.proc.kill()
        self.close()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def _processes() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, session id)}`` of every process (``/proc``)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                after_name = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found[int(entry)] = (int(after_name[1]), int(after_name[3]))  # state, ppid, pgrp, session
    return found


_servers: dict[str, _Server] = {}


def run_forked(argv: list[str], engine: str, cwd: Path, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """``chunkzero ARGV`` (a ``train`` command of ``engine``, ``"torch"`` or ``"jax"``, or a torch ``plan``) in a
    process forked from this test process's server for ``engine`` (started at the first call, with ``env``); as
    ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` returns it. A run whose environment
    is not the one the server started with (pytest's per-test variables aside) gets a new server: the imports may
    have read it."""
    server = _servers.get(engine)
    if server is not None and (server.busy or server.proc.poll() is not None or server.env != _import_env(env)):
        server.kill()  # owes a reply to a run that was given up, ended, or imported in another environment
        server = None
    if server is None:
        server = _servers[engine] = _Server(engine, env)
    return server.run(argv, cwd, env, timeout)


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()
