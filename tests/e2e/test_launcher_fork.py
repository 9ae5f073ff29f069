"""The forked launchers of ``run_train`` (:mod:`.launcher_fork`) against ``python -m chunkzero.cli train``: the
same output and exit status, and a timeout that leaves no process of the run."""

from __future__ import annotations

import subprocess
import time

import pytest

from chunkzero.workers import process_running

from .helpers import SMALL, chunkzero_cmd, clean_env, make_corpus
from .launcher_fork import run_forked


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_a_forked_launcher_says_and_exits_what_the_command_does(engine, tmp_path):
    """Refused runs (bad input, before any worker), one after the other in two directories: the same stdout,
    stderr and exit status as the command's, the relative ``--data`` read from each run's own directory."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "corpus").write_bytes(b"\0binary")  # in a: a binary file; in b: nothing
    args = ["train", "--backend", engine, "--model", "gpt-tiny", "--data", "corpus", "--out", "o"]
    said = []
    for cwd in (tmp_path / "a", tmp_path / "b"):
        forked = run_forked(args, engine, cwd, clean_env(), 120)
        spawned = subprocess.run(chunkzero_cmd(*args), cwd=cwd, env=clean_env(), capture_output=True, text=True,
                                 timeout=120)
        assert (forked.returncode, forked.stdout, forked.stderr) == (spawned.returncode, spawned.stdout,
                                                                     spawned.stderr)
        assert forked.returncode == 2, forked.stderr
        said.append(forked.stderr)
    assert "binary" in said[0] and "does not exist" in said[1], said


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_a_forked_launcher_that_times_out_leaves_no_process_of_its_run(engine, tmp_path):
    """Killed at its timeout, the run leaves no worker running, on either engine (the JAX engine's workers are in
    a process group of their own)."""
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_forked(["train", "--backend", engine, "--data", str(corpus), *SMALL, "--nproc", "2", "--steps", "100000",
                    "--eval-interval", "100000", "--sample-tokens", "0", "--out", str(out)], engine, tmp_path,
                   clean_env(), 25)
    assert time.monotonic() - started < 25 + 60
    pids = [int(p.read_text()) for p in (out / "pids").glob("*.pid")]
    assert len(pids) == 2, "the run had not started its workers: give it a longer timeout"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(process_running, pids)):
        time.sleep(0.2)
    left = [pid for pid in pids if process_running(pid)]
    assert not left, f"workers {left} outlived their timed-out run"
