"""ZeRO-3 training step on the chunk layout: K steps on 4 simulated devices equal K
unsharded steps of the Flax GPT (fp32), keep-gathered chunks and clipping, bf16 compute, bad input."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from zero_utils import (
    ADAMW,
    BATCH,
    CHUNK_SIZE,
    FP32_RTOL,
    SEQ,
    STEPS,
    WORLD,
    batches,
    max_rel_err,
    normwise_rel_err,
    tiny_program,
)

from chunkzero import ChunkLayout
from chunkzero.errors import ConfigError, LayoutError
from jax_backend import make_mesh, unflatten
from jax_backend.analysis import count_collectives
from jax_backend.blocks import gpt_reference_loss
from jax_backend.schedule import reference_train
from jax_backend.zero import ZeroTrainer


@pytest.fixture(scope="module")
def program():
    return tiny_program()


def test_zero_k_steps_equal_unsharded_adamw(program):
    """fp32, AdamW, 3 steps: the sharded master chunks equal the unsharded GPT trained with jax.grad."""
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, WORLD)
    assert len(layout.chunks) > 1 and any(len(c.tensor_names) > 1 for c in layout.chunks)
    tx = optax.adamw(**ADAMW)
    trainer = ZeroTrainer(program, layout, make_mesh(WORLD), tx)
    p0 = program.init(0)
    state = trainer.init(p0)
    data = batches(program)
    losses = []
    for b in data:
        state, loss = trainer.step(state, b)
        losses.append(float(loss))
    ref, ref_losses = reference_train(program, p0, data, tx, loss_fn=gpt_reference_loss(program.config))
    np.testing.assert_allclose(losses, ref_losses, rtol=FP32_RTOL)
    got = unflatten(trainer.chunks(state), layout, nested=False)  # through the public chunk API
    err = normwise_rel_err(got, ref)
    print(
        f"zero vs unsharded after {STEPS} AdamW steps: normwise {err:.2e}, per-tensor max {max_rel_err(got, ref):.2e}"
    )
    assert err < FP32_RTOL
    # the state stays sharded: one shard per device of every chunk
    for k, v in state.master.items():
        assert v.sharding.shard_shape(v.shape) == (v.shape[0] // WORLD,), k


def test_zero_without_remat_equals_unsharded_and_skips_a_forward(program):
    """remat=False (stage activations kept, gathered chunks not): the same 3 AdamW steps as the unsharded
    GPT, with clipping and the gradient norm, and the compiled step has fewer matrix products than the
    rematerialized one (no second forward) but the same all-gathers (each chunk again in backward)."""
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, WORLD)
    tx = optax.adamw(**ADAMW)
    p0 = program.init(0)
    data = batches(program)
    trainers = {r: ZeroTrainer(program, layout, make_mesh(WORLD), tx, remat=r, max_norm=0.5, grad_norm=True)
                for r in (True, False)}
    states = {r: t.init(p0) for r, t in trainers.items()}
    losses = {r: [] for r in trainers}
    for b in data:
        for r, t in trainers.items():
            states[r], loss = t.step(states[r], b)
            losses[r].append(float(loss))
    ref, ref_losses = reference_train(program, p0, data, tx, loss_fn=gpt_reference_loss(program.config), max_norm=0.5)
    np.testing.assert_allclose(losses[False], ref_losses, rtol=FP32_RTOL)
    assert normwise_rel_err(trainers[False].full_params(states[False]), ref) < FP32_RTOL
    assert normwise_rel_err(trainers[False].full_params(states[False]),
                            trainers[True].full_params(states[True])) < FP32_RTOL
    texts = {r: t.lower(BATCH, SEQ).compile().as_text() for r, t in trainers.items()}
    dots = {r: txt.count(" dot(") + txt.count("__ynn_fusion") for r, txt in texts.items()}
    assert dots[False] < dots[True], dots
    for txt in texts.values():
        assert count_collectives(txt, WORLD).buffers["all-gather"] == 2 * len(layout.chunks)


def test_zero_keep_gathered_chunks_and_clipping(program):
    """Keep-gathered chunks (all-reduced, never sharded) and global-norm clipping; SGD, so the
    parameters are linear in the gradients and compare element by element."""
    specs = [dataclasses.replace(s, keep_gathered=".ln_" in s.name) for s in program.specs]
    layout = ChunkLayout.build(specs, CHUNK_SIZE, WORLD)
    assert any(c.keep_gathered for c in layout.chunks) and any(not c.keep_gathered for c in layout.chunks)
    tx = optax.sgd(0.5)
    trainer = ZeroTrainer(program, layout, make_mesh(WORLD), tx, max_norm=0.1)
    p0 = program.init(1)
    data = batches(program, 2, seed=10)
    state = trainer.init(p0)
    for b in data:
        state, _ = trainer.step(state, b)
    ref, _ = reference_train(program, p0, data, tx, max_norm=0.1)
    got = trainer.full_params(state)
    assert max_rel_err(got, ref) < FP32_RTOL
    counts = count_collectives(trainer.lower(BATCH, SEQ).compile().as_text(), WORLD)
    n_kg = sum(c.keep_gathered for c in layout.chunks)
    assert counts.buffers["all-reduce"] == n_kg + 1  # one per keep-gathered chunk + the scalar norm


def test_zero_bf16_compute(program):
    """bf16 parameters, activations, gathers and gradients; fp32 master chunks and AdamW state."""
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, WORLD)
    tx = optax.adamw(**ADAMW)
    p0 = program.init(0)
    data = batches(program, 2)
    bf16 = ZeroTrainer(program, layout, make_mesh(WORLD), tx, mixed_precision="bf16")
    state = bf16.init(p0)
    assert all(v.dtype == jnp.bfloat16 for v in state.params.values())
    assert all(v.dtype == jnp.float32 for v in state.master.values())
    losses = []
    for b in data:
        state, loss = bf16.step(state, b)
        losses.append(float(loss))
    ref, ref_losses = reference_train(program, p0, data, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)  # bf16 ≈ 1e-2 (DESIGN.md §7)
    assert normwise_rel_err(bf16.full_params(state), ref) < 1e-2
    np.testing.assert_array_equal(np.asarray(state.params["chunk_0000"]),
                                  np.asarray(state.master["chunk_0000"].astype(jnp.bfloat16)))
    lowered = bf16.lower(BATCH, SEQ)
    issued = [line for line in lowered.as_text().splitlines() if '"stablehlo.all_gather"' in line]
    assert len(issued) == 2 * len(layout.chunks) and all(line.rstrip().endswith("xbf16>") for line in issued)
    # XLA:CPU widens bf16 collectives to f32 (a convert before each): the compiled HLO moves fp32 bytes
    counts = count_collectives(lowered.compile().as_text(), WORLD)
    assert counts.buffers["all-gather"] == 2 * len(layout.chunks)


def test_zero_rejects_bad_input(program):
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, WORLD)
    tx = optax.sgd(0.1)
    with pytest.raises(ConfigError, match="world size 4 but mesh axis 'shard' has 2"):
        ZeroTrainer(program, layout, make_mesh(2), tx)
    with pytest.raises(ConfigError, match="mixed_precision"):
        ZeroTrainer(program, layout, make_mesh(WORLD), tx, mixed_precision="fp8")
    other = ChunkLayout.build(program.specs[:-1], CHUNK_SIZE, WORLD)
    with pytest.raises(LayoutError, match="transformer.ln_f.bias"):
        ZeroTrainer(program, other, make_mesh(WORLD), tx)
    trainer = ZeroTrainer(program, layout, make_mesh(WORLD), tx)
    with pytest.raises(ConfigError, match="not divisible by the world size 4"):
        trainer.abstract_batch(6, SEQ)
    with pytest.raises(ConfigError, match="exceeds 128"):
        trainer.shard_batch({"idx": np.zeros((4, 129), np.int32), "targets": np.zeros((4, 129), np.int32)})
    with pytest.raises(LayoutError, match="no tensor 'transformer.wte.weight'"):
        trainer.init({})
