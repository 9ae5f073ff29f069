"""The baselines on the same model and devices: per-parameter FSDP and DDP train exactly
like the unsharded model (fp32) and issue the collectives they are meant to."""

from __future__ import annotations

import optax
import pytest
from zero_utils import ADAMW, BATCH, FP32_RTOL, SEQ, WORLD, batches, normwise_rel_err, tiny_program

from chunkzero.layout import TensorSpec
from jax_backend import make_mesh
from jax_backend.analysis import count_collectives
from jax_backend.baselines import DDPTrainer, FSDPTrainer, fsdp_shard_dim
from jax_backend.schedule import reference_train


@pytest.fixture(scope="module")
def program():
    return tiny_program()


def test_fsdp_shard_dim():
    assert fsdp_shard_dim((64, 256), 4) == 0          # dim 0 when it divides (FSDP2)
    assert fsdp_shard_dim((50257, 768), 8) == 1       # else the first dim that does (GPT-2's wte)
    assert fsdp_shard_dim((50257, 7), 8) is None      # else replicated
    assert fsdp_shard_dim((), 8) is None


@pytest.mark.parametrize("cls", [FSDPTrainer, DDPTrainer], ids=["fsdp", "ddp"])
def test_baseline_k_steps_equal_unsharded(program, cls):
    tx = optax.adamw(**ADAMW)
    # DDP with small bucket caps: several buckets (torch DDP's rule), each one all-reduce
    kw = {} if cls is FSDPTrainer else dict(bucket_cap_bytes=100_000, first_bucket_bytes=50_000)
    trainer = cls(program, make_mesh(WORLD), tx, **kw)
    p0 = program.init(0)
    data = batches(program)
    state = trainer.init(p0)
    for b in data:
        state, _ = trainer.step(state, b)
    ref, _ = reference_train(program, p0, data, tx)
    assert normwise_rel_err(trainer.full_params(state), ref) < FP32_RTOL
    counts = count_collectives(trainer.lower(BATCH, SEQ).compile().as_text(), WORLD)
    if cls is FSDPTrainer:
        assert not trainer.replicated
        n = len(program.specs)
        assert counts.buffers["reduce-scatter"] == n and counts.buffers["all-reduce"] == 0
        # one gather per parameter in forward; in backward, those whose values the backward needs
        assert n < counts.buffers["all-gather"] <= 2 * n
    else:
        assert len(trainer.buckets) > 2
        assert [n for b in trainer.buckets for n in b] == [s.name for s in reversed(program.specs)]
        assert counts.buffers["all-gather"] == counts.buffers["reduce-scatter"] == 0
        assert counts.buffers["all-reduce"] == len(trainer.buckets)


def test_fsdp_replicates_indivisible_parameters():
    from jax_backend.baselines import ParamUnit

    unit = ParamUnit(TensorSpec("w", (7, 5)), 4)
    assert unit.dim is None and not unit.sharded
