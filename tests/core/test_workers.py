"""The worker processes of ``chunkzero train`` (:mod:`chunkzero.workers`), in real processes.

* ``launch_processes(drop_stdout=...)``: the launched processes' stdout reaches the launcher's, line by line,
  without the lines the pattern matches (a library's own prints, jaxlib's gloo in the JAX engine), the last
  line too when it has no newline; without a pattern the processes' stdout is the launcher's, untouched.
* A stop signal: ``exit_on_stop_signals(at_once=True)`` ends a process whose main thread is blocked in C (a
  Python handler would wait for it); ``outlive_on_stop`` keeps the process that hosts JAX's coordination
  service until the others are gone (at most its bound), then exits ``128 + signal``.
* torch's ``PR_SET_PDEATHSIG`` comes when the launcher's thread that started a worker ends, which under
  ``kill -9`` can be before the rest of the launcher: the worker still removes the launcher's temp directory.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from chunkzero.workers import LAUNCHER_EXIT_WAIT_S, launch_processes, process_running

CHILD = r"""
import os, sys
from chunkzero.workers import write_result
i = os.environ["JAX_PROCESS_ID"]
sys.stdout.write(f"kept {i}\n[Gloo] Rank {i} is connected to 1 peer ranks. Expected number of connected peer ranks "
                 f"is : 1\nalso kept {i}: [Gloo] Rank in the middle\nlast {i}, no newline")
sys.stdout.flush()
write_result({"status": "ok"})
"""
GLOO = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ")


def _stdout_lines(tmp_path, capfd, drop) -> list[str]:
    capfd.readouterr()
    results = launch_processes([sys.executable, "-c", CHILD], 2, tmp_path, drop_stdout=drop)
    assert results == [{"status": "ok"}] * 2
    out = capfd.readouterr().out
    return sorted(out.replace("newline", "newline\n").splitlines())


def test_dropped_lines_are_left_out_and_the_rest_forwarded(tmp_path, capfd):
    kept = [f"{what} {i}" for i in (0, 1) for what in ("kept", "also kept")]
    want = sorted([*kept, "last 0, no newline", "last 1, no newline"])
    want = sorted(w + (": [Gloo] Rank in the middle" if w.startswith("also") else "") for w in want)
    assert _stdout_lines(tmp_path, capfd, GLOO) == want
    everything = _stdout_lines(tmp_path, capfd, None)  # the pattern is what leaves the lines out
    assert sorted(set(everything) - set(want)) == [
        f"[Gloo] Rank {i} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1" for i in (0, 1)]


BLOCKED = "sum(range(10 ** 13))"
"""A call that stays in C for hours: the main thread never gets back to the eval loop, where Python runs a handler."""


def _start(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    return p


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def _ended(p: subprocess.Popen, timeout_s: float = 60.0) -> int:
    try:
        return p.wait(timeout=timeout_s)
    finally:
        _kill(p)


@pytest.mark.parametrize("at_once", [True, False])
def test_a_stop_signal_at_once_ends_a_blocked_main_thread(at_once):
    p = _start("from chunkzero.workers import exit_on_stop_signals\n"
               f"exit_on_stop_signals(at_once={at_once})\nprint('ready', flush=True)\n{BLOCKED}")
    time.sleep(1.0)  # into the C call (a signal before it would run the handler at once)
    p.send_signal(signal.SIGTERM)
    if at_once:
        assert _ended(p) == -signal.SIGTERM
    else:  # the Python handler waits for the C call: why the workers but one stop at once
        with pytest.raises(subprocess.TimeoutExpired):
            _ended(p, timeout_s=2.0)


def _outliving(peer_pid: int, wait_s: float) -> subprocess.Popen:
    return _start("import time\nfrom chunkzero.workers import exit_on_stop_signals, outlive_on_stop\n"
                  f"exit_on_stop_signals()\noutlive_on_stop([{peer_pid}], wait_s={wait_s})\n"
                  "print('ready', flush=True)\ntime.sleep(600)")


def test_the_service_host_is_last_out():
    peer = _start("import time\nprint('ready', flush=True)\ntime.sleep(600)")
    try:
        host = _outliving(peer.pid, wait_s=600)
        host.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert host.poll() is None, "the process that hosts the service left before the others"
        peer.kill()
        peer.wait()  # (a zombie counts as gone too)
        assert _ended(host) == 128 + signal.SIGTERM
    finally:
        _kill(peer)


def test_the_service_host_waits_for_the_others_only_so_long():
    peer = _start("import time\nprint('ready', flush=True)\ntime.sleep(600)")
    try:
        host = _outliving(peer.pid, wait_s=0.5)
        host.send_signal(signal.SIGINT)
        assert _ended(host) == 128 + signal.SIGINT
        assert peer.poll() is None
    finally:
        _kill(peer)


WORKER = "import time\nfrom chunkzero.workers import LAUNCHER_EXIT_WAIT_S, exit_on_stop_signals\n" \
         "exit_on_stop_signals(launcher_exit_wait_s=LAUNCHER_EXIT_WAIT_S)\nprint('ready', flush=True)\ntime.sleep(600)"
LAUNCHER = f"""
import ctypes, os, subprocess, sys, threading, time
from chunkzero.workers import launch_env
env = {{**os.environ, **launch_env(sys.argv[1])}}
def start():  # as torch's spawn: PR_SET_PDEATHSIG (1) with SIGINT (2), from a thread of the launcher
    worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], env=env, stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: ctypes.CDLL(None).prctl(1, 2))
    assert worker.stdout.readline() == "ready\\n"
    print(worker.pid, flush=True)
thread = threading.Thread(target=start)
thread.start()
thread.join()  # the thread that started the worker ends first: its PR_SET_PDEATHSIG comes now
time.sleep(float(sys.argv[2]))
os._exit(0)
"""


@pytest.mark.parametrize("launcher_lives_s", [0.2, 4.0])
def test_pdeathsig_before_the_launcher_is_gone(tmp_path, launcher_lives_s):
    """The worker's SIGINT comes while its launcher still ends (``kill -9``: its threads die one by one): it
    waits for the launcher to be gone and removes its temp directory; a launcher that lives on keeps it."""
    launch_dir = tmp_path / "chunkzero-torch-x"
    (launch_dir / "run" / "attempt_0" / "0").mkdir(parents=True)
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER, str(launch_dir), str(launcher_lives_s)],
                              capture_output=True, text=True, timeout=120)
    assert launcher.returncode == 0, launcher.stderr
    worker = int(launcher.stdout)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process_running(worker):
        time.sleep(0.05)
    assert not process_running(worker)
    assert launch_dir.exists() is (launcher_lives_s > LAUNCHER_EXIT_WAIT_S)


def test_the_stop_line_says_what_the_run_has_saved(tmp_path):
    """A stopped run's last line names its latest committed step and how to resume, or says that nothing
    was saved yet (it never claims checkpoints that are not there); a step still being written, without
    its items, is not counted."""
    from chunkzero.checkpoint import META_ITEM, STATE_ITEM
    from chunkzero.run_dir import stopped_run_checkpoints
    from chunkzero.workers import stopped_message

    out = tmp_path / "run"
    assert stopped_message(2, stopped_run_checkpoints(out)) == (
        "stopped by SIGINT (Ctrl-C); every worker was stopped (no checkpoint was saved yet)")
    for step in (3, 6):
        for item in (META_ITEM, STATE_ITEM):
            (out / "checkpoints" / str(step) / item).mkdir(parents=True)
    (out / "checkpoints" / "9" / META_ITEM).mkdir(parents=True)  # no state item: not committed
    assert stopped_message(15, stopped_run_checkpoints(out)) == (
        f"stopped by SIGTERM; every worker was stopped (the latest checkpoint, step 6, is in {out / 'checkpoints'}; "
        "the same command with --resume continues from it)")
    assert stopped_message(15) == "stopped by SIGTERM; every worker was stopped"
