"""A corrupted checkpoint of a 2-process JAX run is refused by every reader (the issue's reproduction).

One byte of the latest step's optimizer state is flipped on disk. A JAX resume (2 processes), a torch
resume and ``chunkzero export`` must each refuse it: one line naming the array and the step, and (the
resumes) how to resume from the older step instead; nothing trains on it. ``export`` reads only the
parameters, so it is shown a flipped parameter byte.
"""

from __future__ import annotations

import subprocess

import pytest

from .helpers import (
    SMALL,
    chunkzero_cmd,
    clean_env,
    describe,
    flip_saved_bit,
    make_corpus,
    read_metrics,
    run_train,
    run_train_pooled,
)


@pytest.mark.slow
def test_corrupted_jax_checkpoint_is_refused_everywhere(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    common = ["--data", str(corpus), *SMALL, "--nproc", "2", "--eval-interval", "100", "--sample-tokens", "0",
              "--save-interval", "5", "--out", str(out)]
    p = run_train(*common, "--backend", "jax", "--steps", "10", cwd=tmp_path)
    assert p.returncode == 0, describe(p)
    from chunkzero.checkpoint import read_meta

    assert read_meta(out / "checkpoints" / "10").checksums is not None  # written at 2 processes too
    flip_saved_bit(out / "checkpoints" / "10", ("optim", "exp_avg_sq", "chunk_0000"))
    trained = read_metrics(out)[0]
    for engine in ("jax", "torch"):
        p = run_train_pooled(*common, "--backend", engine, "--steps", "15", "--resume", cwd=tmp_path)
        assert p.returncode not in (0, None), describe(p)
        last = p.stderr.strip().splitlines()[-1]
        assert "array 'optim.exp_avg_sq.chunk_0000'" in last and "/checkpoints/10/state" in last, describe(p)
        assert "step 10 cannot be loaded" in last and "--resume-step 5" in last, describe(p)
        assert read_metrics(out)[0] == trained, f"{engine} trained on the corrupted checkpoint"
    flip_saved_bit(out / "checkpoints" / "10", ("params", "chunk_0000"))
    p = subprocess.run(chunkzero_cmd("export", str(out / "checkpoints"), str(tmp_path / "exported"), "--format",
                                     "safetensors"), cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0, describe(p)
    last = p.stderr.strip().splitlines()[-1]
    assert "array 'params.chunk_0000'" in last and "/checkpoints/10/state" in last and "is corrupted" in last, describe(
        p
    )
    assert "step 10 cannot be exported" in last and last.endswith("pass --step 5"), describe(p)
    assert not (tmp_path / "exported" / "model.safetensors").exists()
