"""A step skipped for non-finite gradients moves the learning-rate schedule on, on the JAX engine as on torch's.

torch is the reference: its loop sets ``lr_at(step - 1)`` before every step, skipped or not (as a
``torch.optim.lr_scheduler`` steps after a skipped optimizer step), while ``ZeroOptimizer`` counts only
the applied steps for Adam's bias correction. The JAX step keeps both counts in the optax state; a skip
must keep Adam's and advance the schedule's, and a resume must set the schedule's to the checkpoint's step
(skips included), not to Adam's.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import torch
from engine_steps import BATCH, SEQ, step_batch, torch_params, update_error
from zero_utils import CHUNK_SIZE, WORLD, batches, tiny_program

import jax_backend as jb
from chunkzero import ChunkLayout
from chunkzero.train_config import TrainConfig, lr_at
from jax_backend.optim import adam_state_to_chunks
from jax_backend.schedule import TrainState
from jax_backend.train.adapter import JaxAdapter
from jax_backend.zero import ZeroTrainer
from torch_backend.checkpoint.sharded import read_meta, save_checkpoint
from torch_backend.train.adapter import TorchAdapter
from torch_backend.train.models import build_module, lm_loss

FP32_RTOL = 1e-5
"""fp32, one engine: normwise relative error of the update (DESIGN.md §7)."""
CROSS_RTOL = 1e-4
"""fp32, torch vs JAX: the update's normwise relative error (different kernels and summation orders, and the
engines' AdamW eps 1e-8, which turns rounding noise in a tiny gradient into a step of about the LR)."""


def _schedule(count):
    return 1e-3 * (count + 1.0)  # a different LR at every count, so a count off by one shows


def _adam(schedule) -> optax.GradientTransformation:
    return optax.chain(optax.scale_by_adam(eps=1e-6), optax.scale_by_learning_rate(schedule))


def _schedule_count(opt_state) -> int:
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    counts = [int(s.count) for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
    assert len(counts) == 1, counts
    return counts[0]


def test_a_skipped_step_keeps_adam_and_moves_the_schedule_on():
    """Step 1 skipped (a NaN weight), step 2 applied: the update is Adam's first (bias correction t = 1) at the
    schedule's second LR, as a run that started at step 2 computes it."""
    program = tiny_program()
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, WORLD)
    mesh = jb.make_mesh(WORLD)
    trainer = ZeroTrainer(program, layout, mesh, _adam(_schedule), skip_nonfinite=True, grad_norm=True)
    p0 = program.init(0)
    b0, b1 = batches(program, 2)
    poisoned = {k: np.array(v) for k, v in p0.items()}
    name = next(iter(poisoned))
    poisoned[name].flat[0] = np.nan
    state, _, norm = trainer.step_fn(trainer.init(poisoned), trainer.shard_batch(b0))
    assert not np.isfinite(float(norm))
    kept = trainer.full_params(state)
    for k in p0:
        np.testing.assert_array_equal(kept[k], poisoned[k], err_msg=k)  # the weights as they were
    assert adam_state_to_chunks(state.opt_state)[1] == 0 and _schedule_count(state.opt_state) == 1

    state = TrainState(trainer.init(p0).master, None, state.opt_state)  # the weights repaired, the counts kept
    state, _, norm = trainer.step_fn(state, trainer.shard_batch(b1))
    assert np.isfinite(float(norm))
    assert adam_state_to_chunks(state.opt_state)[1] == 1 and _schedule_count(state.opt_state) == 2
    got = trainer.full_params(state)

    reference = ZeroTrainer(program, layout, mesh, _adam(lambda c: _schedule(c + 1)))  # starts at the 2nd LR
    want = reference.full_params(reference.step_fn(reference.init(p0), reference.shard_batch(b1))[0])
    assert update_error(got, want, p0) <= FP32_RTOL
    lagging = ZeroTrainer(program, layout, mesh, _adam(_schedule))  # the schedule one step behind
    behind = lagging.full_params(lagging.step_fn(lagging.init(p0), lagging.shard_batch(b1))[0])
    assert update_error(behind, want, p0) > FP32_RTOL, "the check cannot tell the schedule's step"


SKIPPED, SAVED_AT, STEPS = 2, 3, 5


def _cfg() -> TrainConfig:
    cfg = TrainConfig(model="gpt-tiny", mixed_precision="fp32", lr=3e-3, steps=STEPS, warmup=1, seq_len=SEQ,
                      batch_size=BATCH // 2, max_norm=0.0)
    cfg.model_kind, cfg.schedule_steps = "gpt", STEPS
    return cfg


def test_a_resume_after_a_skipped_step_continues_torchs_schedule(tmp_path):
    """torch (W = 1) skips step 2 (an infinite loss) and saves at step 3 (2 steps applied); the JAX engine
    (2 devices) resumed there trains steps 4-5 as torch does: at ``lr_at(3)`` and ``lr_at(4)``."""
    cfg = _cfg()
    engine = TorchAdapter(build_module(cfg), cfg, torch.device("cpu"))
    for s in range(1, STEPS + 1):
        engine.set_lr(lr_at(s - 1, cfg))
        x, y = step_batch(s)
        loss = lm_loss(engine.model(x), y)
        engine.backward(loss * float("inf") if s == SKIPPED else loss)
        assert engine.step() is (s != SKIPPED)
        engine.zero_grad()
        if s == SAVED_AT:
            save_checkpoint(tmp_path, engine.model, engine.optim, step=s)
            start = torch_params(engine)
    want = torch_params(engine)
    meta = read_meta(tmp_path)
    assert (meta.step, meta.optimizer.step) == (SAVED_AT, SAVED_AT - 1)

    jax_engine = JaxAdapter(cfg, jb.make_mesh(2), resume_from=tmp_path)
    for s in range(SAVED_AT + 1, STEPS + 1):
        x, y = step_batch(s)
        half = BATCH // 2
        jax_engine.step(s, jax_engine.global_batch({r: (x[r * half:(r + 1) * half].numpy(),
                                                        y[r * half:(r + 1) * half].numpy()) for r in range(2)}))
    full = jax_engine.full_params()
    got = {k: full[k] for k in want}
    assert update_error(got, want, start) <= CROSS_RTOL  # a schedule one step behind: 1.6 (lr_at(2), lr_at(3))
    assert adam_state_to_chunks(jax_engine.state.opt_state)[1] == STEPS - 1
    assert _schedule_count(jax_engine.state.opt_state) == STEPS
