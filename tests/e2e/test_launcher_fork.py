"""The forked launchers of ``run_train`` (:mod:`.launcher_fork`) against ``python -m chunkzero.cli train``: the
same output and exit status, and a timeout that leaves no process of the run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from .helpers import SMALL, chunkzero_cmd, clean_env, make_corpus
from .launcher_fork import run_forked


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_a_forked_launcher_says_and_exits_what_the_command_does(engine, tmp_path):
    """A refused run (bad input, before any worker): the same stdout, stderr and exit status as the command's."""
    args = ["train", "--backend", engine, "--model", "gpt-tiny", "--data", str(tmp_path / "none"), "--out", "o"]
    forked = run_forked(args, engine, tmp_path, clean_env(), 120)
    spawned = subprocess.run(chunkzero_cmd(*args), cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                             timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (spawned.returncode, spawned.stdout, spawned.stderr)
    assert forked.returncode == 2 and "--data" in forked.stderr, forked.stderr


@pytest.mark.slow
def test_a_forked_launcher_that_times_out_leaves_no_process_of_its_run(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_forked(["train", "--data", str(corpus), *SMALL, "--nproc", "2", "--steps", "100000", "--eval-interval",
                    "100000", "--sample-tokens", "0", "--out", str(out)], "torch", tmp_path, clean_env(), 25)
    assert time.monotonic() - started < 25 + 60
    pids = [int(p.read_text()) for p in (out / "pids").glob("*.pid")]
    assert len(pids) == 2, "the run had not started its workers: give it a longer timeout"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)
    left = [pid for pid in pids if Path(f"/proc/{pid}").exists()
            and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not left, f"workers {left} outlived their timed-out run"
