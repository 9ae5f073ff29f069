"""Stopping ``chunkzero train`` from outside, on both engines: every worker dies with its launcher.

The launcher is stopped as a user does — ``kill`` (SIGTERM, also what ``timeout`` sends), Ctrl-C
(SIGINT to the terminal's process group) or ``kill -9`` — once the run is training. Afterwards no worker
may be running, nothing may write into ``--out``, and no temp directory of the run is left in
``$TMPDIR``. A launcher that could handle the signal exits ``128 + signal`` with one last line naming it,
the same on both engines, and no traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from chunkzero.workers import process_running

from .helpers import SMALL, chunkzero_cmd, clean_env, make_corpus, read_metrics

RUN_TEMP_PREFIXES = ("chunkzero-", "torchelastic_")
"""A run's temp directories: the launchers' (``chunkzero-jax-*``, ``chunkzero-torch-*``), and torch elastic's
default log directory, which chunkzero no longer uses (torch's caches, ``torchinductor_*``, are kept on purpose)."""
STOP_BOUND_S = 60.0
"""The longest the workers may outlive their launcher (the launcher's grace before SIGKILL is 5 s)."""
TRAINED_ON_BOUND_S = 2.0
"""The most training time (``metrics.jsonl``'s ``time_s``) the workers may log after their launcher was stopped:
well under the launcher's 5 s grace, so a worker that ignored the stop until it was killed fails. A count of
steps failed on a loaded machine (3 past a bound of 2), where a tiny step takes tens of milliseconds."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _train_until_running(engine: str, corpus: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, list[int]]:
    """A long run started in its own session; returns once it has logged steps: (launcher, --out, worker pids)."""
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    cmd = chunkzero_cmd("train", "--backend", engine, "--nproc", "2", "--data", str(corpus), *SMALL,
                        "--steps", "100000", "--eval-interval", "100000", "--save-interval", "3",
                        "--sample-tokens", "0", "--out", str(out))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pid_files = [out / "pids" / (f"process{i}.pid" if engine == "jax" else f"rank{i}.pid") for i in range(2)]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        saved = out / "checkpoints" / "3"  # JAX's distributed runtime, which a torch worker starts at its first save,
        if all(p.exists() for p in pid_files) and (out / "metrics.jsonl").exists() \
                and len(read_metrics(out)[0]) >= 2 and saved.is_dir():  # installs a SIGTERM handler of its own
            break
        time.sleep(0.2)
    if proc.poll() is not None:
        pytest.fail("the run ended before it could be stopped:\n" + proc.stderr.read()[-3000:])
    return proc, out, [int(p.read_text()) for p in pid_files]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "ctrl-c", "kill -9"])
@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_stopping_the_launcher_stops_every_worker(engine, how, corpus, tmp_path):
    proc, out, workers = _train_until_running(engine, corpus, tmp_path)
    time_at_stop_s = read_metrics(out)[0][-1]["time_s"]
    try:
        if how == "kill":
            os.kill(proc.pid, signal.SIGTERM)
        elif how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # a terminal sends it to its foreground process group
        else:
            os.kill(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=STOP_BOUND_S)
        deadline = time.monotonic() + STOP_BOUND_S
        while time.monotonic() < deadline and any(map(process_running, workers)):
            time.sleep(0.2)
        left = [pid for pid in workers if process_running(pid)]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert not left, f"workers {left} outlived their launcher ({how})"
    # a step in flight may finish, and a loaded machine delays the workers' notice; no training goes on
    trained_on_s = read_metrics(out)[0][-1]["time_s"] - time_at_stop_s
    assert trained_on_s <= TRAINED_ON_BOUND_S, \
        f"the workers trained {trained_on_s:.1f} s more after the launcher was stopped ({how})"
    lines = (out / "metrics.jsonl").read_text()
    time.sleep(2)
    assert (out / "metrics.jsonl").read_text() == lines, "something still writes into --out"
    deadline = time.monotonic() + 10  # the last worker out removes it as it exits
    while True:
        left_tmp = [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith(RUN_TEMP_PREFIXES)]
        if not left_tmp or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left_tmp == [], f"temp directories of the run were left: {left_tmp}: " + ", ".join(
        str(f.relative_to(tmp_path)) for d in left_tmp for f in (tmp_path / "tmp" / d).rglob("*"))
    if how != "kill -9":
        sig = signal.SIGTERM if how == "kill" else signal.SIGINT
        assert proc.returncode == 128 + sig, stderr[-3000:]
        last = stderr.strip().splitlines()[-1]
        name = re.escape(signal.Signals(sig).name + (" (Ctrl-C)" if how == "ctrl-c" else ""))
        said = re.fullmatch(
            rf"chunkzero train: stopped by {name}; every worker was stopped "
            r"\(the latest checkpoint, step (\d+), is in (.+); the same command with --resume continues from it\)",
            last)
        assert said, stderr[-3000:]
        saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
        assert int(said[1]) == saved[-1] and Path(said[2]) == (out / "checkpoints").resolve(), last
        assert "Traceback" not in stderr and "SavedView" not in stderr, stderr[-3000:]
        assert "death signal" not in stderr, stderr[-3000:]  # torch's agent's own line ("Received 2 death signal")
        # absl's fatal and error lines: a torch worker runs JAX's distributed client after its first save, which
        # aborts with them should rank 0, the coordination service's host, leave first (about one stop in two,
        # before rank 0 outlived the others)
        if engine == "jax" and re.search(r"^[FE]\d{4} \d\d:", stderr, re.M):  # about 1 stop in 15 here
            pytest.xfail("open (issue 32): a JAX engine process blocked in a collective when process 0, the "
                         "coordination service's host, stops prints absl's fatal lines before the launcher's line "
                         "(workers stopped, nothing lost)")
        assert not re.search(r"^[FE]\d{4} \d\d:", stderr, re.M), stderr[-3000:]
