"""The global gradient norm the JAX step reports (``grad_norm=True``, what ``chunkzero train --backend jax``
logs as ``grad_norm``): the L2 norm of the unsharded ``jax.grad`` of the mean loss, before clipping, with
sharded and keep-gathered chunks alike."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from zero_utils import CHUNK_SIZE, WORLD, batches, tiny_program

from chunkzero import ChunkLayout
from jax_backend import make_mesh
from jax_backend.blocks import gpt_reference_loss
from jax_backend.zero import ZeroTrainer

NORM_RTOL = 1e-5
"""fp32: only the summation order differs."""


@pytest.mark.parametrize("max_norm", [None, 0.1])
def test_reported_grad_norm_is_the_unclipped_global_norm(max_norm):
    program = tiny_program()
    specs = [dataclasses.replace(s, keep_gathered=".ln_" in s.name) for s in program.specs]
    layout = ChunkLayout.build(specs, CHUNK_SIZE, WORLD)
    assert any(c.keep_gathered for c in layout.chunks) and any(not c.keep_gathered for c in layout.chunks)
    trainer = ZeroTrainer(program, layout, make_mesh(WORLD), optax.sgd(0.5), max_norm=max_norm, grad_norm=True)
    p0 = program.init(0)
    b0, b1 = batches(program, 2, seed=3)
    state, losses, norm = trainer.step_fn(trainer.init(p0), trainer.shard_batch(b0))
    loss_fn = gpt_reference_loss(program.config)
    want = float(optax.global_norm(jax.grad(loss_fn)({k: jax.numpy.asarray(v) for k, v in p0.items()}, b0)))
    assert want > 0.1  # clipping acts in the max_norm case: the norm reported is the one before it
    np.testing.assert_allclose(float(norm), want, rtol=NORM_RTOL)
    # the next step reports the norm at the updated parameters (not a stale or accumulated value)
    p1 = trainer.full_params(state)
    _, _, norm1 = trainer.step_fn(state, trainer.shard_batch(b1))
    want1 = float(optax.global_norm(jax.grad(loss_fn)({k: jax.numpy.asarray(v) for k, v in p1.items()}, b1)))
    np.testing.assert_allclose(float(norm1), want1, rtol=NORM_RTOL)


def test_without_grad_norm_the_step_has_two_outputs():
    program = tiny_program()
    trainer = ZeroTrainer(
        program, ChunkLayout.build(program.specs, CHUNK_SIZE, WORLD), make_mesh(WORLD), optax.sgd(0.1)
    )
    out = trainer.step_fn(trainer.init(program.init(0)), trainer.shard_batch(batches(program, 1)[0]))
    assert len(out) == 2
