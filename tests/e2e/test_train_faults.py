"""Faults read as one line, and what a killed save leaves is cleaned up (issue 32, items 11–13).

A full disk during a save, a collective timeout, a ``--plot`` path that cannot be written and a missing
Lightning ``ckpt_path`` each end with one line naming the cause; the temporaries of a save killed before
its commit are removed by the run's next start.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from chunkzero.checkpoint import list_steps
from chunkzero.checkpoint.steps import remove_uncommitted

from .helpers import SMALL, chunkzero_cmd, clean_env, describe, make_corpus, run_train, run_train_pooled

RUN = [*SMALL, "--nproc", "2", "--eval-interval", "100", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_remove_uncommitted_removes_only_orbax_temporaries(tmp_path):
    for name in ("3", "5.orbax-checkpoint-tmp", "7.orbax-checkpoint-tmp-1718", "notes", "x.orbax-checkpoint-tmp"):
        (tmp_path / name / "state").mkdir(parents=True)
    (tmp_path / "3" / "meta").mkdir()
    assert remove_uncommitted(tmp_path) == ["5.orbax-checkpoint-tmp", "7.orbax-checkpoint-tmp-1718"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "notes", "x.orbax-checkpoint-tmp"]
    assert remove_uncommitted(tmp_path / "missing") == []


@pytest.mark.slow
def test_a_resume_removes_the_temporaries_of_a_killed_save(corpus, tmp_path):
    """``kill -9`` during a save leaves ``N.orbax-checkpoint-tmp``; the next start of the run removes it."""
    out = tmp_path / "run"
    p = run_train_pooled("--data", str(corpus), *RUN, "--steps", "2", "--save-interval", "2", "--out", str(out),
                         cwd=tmp_path)
    assert p.returncode == 0, describe(p)
    stale = out / "checkpoints" / "3.orbax-checkpoint-tmp"
    (stale / "state").mkdir(parents=True)  # what a save killed before its commit leaves
    p = run_train_pooled("--data", str(corpus), *RUN, "--steps", "4", "--save-interval", "2", "--resume", "--out",
                         str(out), cwd=tmp_path)
    assert p.returncode == 0, describe(p)
    assert not stale.exists()
    assert list_steps(out / "checkpoints") == [2, 4]
    assert "removed 1 checkpoint save(s) that never committed: 3.orbax-checkpoint-tmp" in p.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (room for one gpt-tiny checkpoint, not two); skipped where it cannot be mounted."""
    where = tmp_path / "disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_a_full_disk_during_a_save_is_one_line(engine, corpus, small_disk, tmp_path):
    p = run_train("--backend", engine, "--data", str(corpus), *RUN, "--steps", "6", "--save-interval", "2",
                  "--timeout", "10", "--out", str(small_disk / "run"), cwd=tmp_path)
    assert p.returncode == 1, describe(p)  # a failure of the run, as a dead worker's (2 is bad input)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("chunkzero train: error: step 4 was not saved under "), describe(p)
    assert "is full" in last and "step 2, the previous checkpoint, is intact" in last, describe(p)
    assert [line for line in p.stderr.splitlines() if "error" in line.lower()] == [last], describe(p)
    assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) < 30, describe(p)
    assert list_steps(small_disk / "run" / "checkpoints") == [2]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_a_full_disk_at_the_last_save_fails_the_run(engine, corpus, small_disk, tmp_path):
    """The last step's save is still being written when training ends; its failure ends the run as any other
    save's (it surfaced at exit before, where the run still said "done" with exit 0 and no step 4)."""
    p = run_train("--backend", engine, "--data", str(corpus), *RUN, "--steps", "4", "--save-interval", "2",
                  "--timeout", "10", "--out", str(small_disk / "run"), cwd=tmp_path)
    assert p.returncode == 1, describe(p)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("chunkzero train: error: step 4 was not saved under "), describe(p)
    assert "is full" in last and "step 2, the previous checkpoint, is intact" in last, describe(p)
    assert "done" not in p.stderr.lower(), describe(p)
    assert list_steps(small_disk / "run" / "checkpoints") == [2]


@pytest.mark.slow
def test_a_collective_timeout_names_the_timeout(corpus, tmp_path):
    """On torch a 1 ms --timeout fails the first collective; the message says so. (JAX rounds every wait
    up to whole seconds, and its run ends together: a slow process 0 no longer trips the shutdown barrier.)"""
    p = run_train("--data", str(corpus), *RUN, "--steps", "4", "--timeout", "0.001",
                  "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert p.returncode not in (0, None), describe(p)
    last = p.stderr.strip().splitlines()[-1]
    assert "--timeout 0.001" in last, describe(p)


def test_layout_plot_under_a_file_fails_before_the_table(tmp_path):
    (tmp_path / "afile").write_text("x")
    p = subprocess.run(chunkzero_cmd("layout", "--model", "gpt-tiny", "--world-size", "2", "--plot",
                                     str(tmp_path / "afile" / "map.png")), cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", describe(p)
    assert p.stderr.strip() == (f"chunkzero layout: error: --plot {tmp_path / 'afile' / 'map.png'}: cannot be created: "
                                f"{tmp_path / 'afile'} is not a directory")


def test_lightning_missing_ckpt_path_says_it_does_not_exist(tmp_path):
    from chunkzero.errors import CheckpointError
    from torch_backend.lightning import ZeroStrategy

    with pytest.raises(CheckpointError, match=r"^ckpt_path '.*/nope' does not exist$"):
        ZeroStrategy().load_checkpoint(tmp_path / "nope")


def test_a_lost_peer_alone_names_the_timeout():
    """When every failure is a lost peer, both launchers' messages name --timeout (and only then)."""
    import signal
    from types import SimpleNamespace

    from chunkzero.workers import EXIT_PEER_LOST, _failure
    from torch_backend.train.launch import describe_failure

    f = lambda rank, code: SimpleNamespace(local_rank=rank, pid=100 + rank, exitcode=code, timestamp=rank,  # noqa: E731
                                           message="")
    lost = "lost contact with another worker: a collective did not finish within --timeout 0.5 s"
    assert lost in str(describe_failure({0: f(0, EXIT_PEER_LOST), 1: f(1, EXIT_PEER_LOST)}, timeout_s=0.5))
    assert lost in str(_failure([(0.0, 0, EXIT_PEER_LOST)], {}, {0: 100}, 0.5))
    assert "--timeout" not in str(describe_failure({0: f(0, EXIT_PEER_LOST), 1: f(1, -signal.SIGKILL)}, timeout_s=0.5))
