"""The job's guards on both engines, as a new user meets them: a run whose loss turns non-finite stops
at the ``--max-skipped-steps``-th skipped step in a row with exit 1 and one line, saves no non-finite
weights, and its ``metrics.jsonl`` stays strict JSON (``null`` and ``"non_finite": true``, never a bare
``NaN``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from .helpers import SMALL, describe, make_corpus, run_train_pooled

pytestmark = pytest.mark.slow


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"bare {name} in metrics.jsonl")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_non_finite_loss_stops_at_the_skip_limit_and_saves_nothing_non_finite(tmp_path, backend):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    p = run_train_pooled("--data", str(corpus), *SMALL, "--backend", backend, "--nproc", "2", "--lr", "1e6",
                         "--warmup", "0", "--max-norm", "0", "--steps", "40", "--save-interval", "10",
                         "--eval-interval", "100", "--sample-tokens", "0", "--out", str(out), cwd=tmp_path)
    assert p.returncode == 1, describe(p)
    records = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    applied = next(i for i, r in enumerate(train) if r["skipped"])  # the steps before the loss blew up
    assert applied >= 1 and all(r["skipped"] for r in train[applied:])
    stop = applied + 10  # the 10th skip in a row (the default --max-skipped-steps) stops the run, unrecorded
    assert [r["step"] for r in train] == list(range(1, stop))
    if backend == "torch":
        assert stop == 11  # the new user's trial of torch (issue 32)
    # On JAX step 2 is finite (stop 12): the residual stream's variance overflows fp32 in the first block's
    # ln_2, where Flax's LayerNorm gives zeros (rsqrt(inf) = 0) and torch's gives NaN (docs/training.md).
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"chunkzero train: error: step {stop}: 10 steps in a row were skipped for non-finite "
                           "gradients"), p.stderr[-3000:]
    assert last.endswith("the run stops here (--max-skipped-steps 10; 0 never stops)"), last
    flagged = [r for r in train if r.get("non_finite")]
    assert flagged and all(r["non_finite"] is True and None in (r["loss"], r["grad_norm"]) for r in flagged)
    assert sorted(d.name for d in (out / "checkpoints").iterdir() if d.name.isdigit()) == ["10"]
    from chunkzero.checkpoint import read_meta

    # step 10 was skipped: not a healthy step for --keep to protect, whatever its loss (JAX's is finite, 1e18)
    assert read_meta(out / "checkpoints" / "10").extra["finite"] is False
    import jax_backend as jb

    chunks, _ = jb.restore_chunks(out / "checkpoints", jb.make_mesh(1))
    assert all(np.isfinite(np.asarray(c)).all() for c in chunks.values())  # the skipped steps left the weights
