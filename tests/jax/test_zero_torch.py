"""Cross-framework: from the same chunkzero checkpoint, K steps of the JAX ZeRO-3 step on 4 simulated
devices equal K steps of torch ``ZeroDDP`` + ``ZeroOptimizer`` (single process, W=1) on the same
batches (fp32, normwise rtol 1e-4); and torch resumes from what the JAX step saves as if the
run had never left torch.

The checkpoint is written by ``torch_backend.checkpoint.sharded.save_checkpoint`` after two torch steps, so it
carries AdamW state (``exp_avg``, ``exp_avg_sq``, step 2); JAX restores it with
``jax_backend.restore_checkpoint`` at world size 4 (chunks re-padded) and continues with
``optax.adamw`` built from the checkpoint's hyper-parameters.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
import torch
from zero_utils import BATCH, SEQ, normwise_rel_err

import jax_backend as jb
from jax_backend.blocks import gpt_program
from jax_backend.optim import adamw_from_meta
from jax_backend.zero import ZeroTrainer
from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend.checkpoint.sharded import save_checkpoint as torch_save_checkpoint
from torch_backend.train.gpt import GPT, GPT_CONFIGS

CROSS_RTOL = 1e-4
"""torch vs JAX after K steps: ||θ_jax − θ_torch|| / ||θ_torch|| (different kernels and summation orders)."""
CHUNK_SIZE = 30_000
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
WARMUP, STEPS = 2, 3
JAX_STEPS, TORCH_STEPS = 2, 2
MAX_NORM = 0.5
"""Global-norm clipping of the resume test (gpt-tiny's gradient norms are above it: clipping acts)."""


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _torch_step(model, optim, seed: int) -> float:
    x, y = _batch(seed)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optim.backward(loss)
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


def test_jax_zero_matches_torch_zeroddp_from_checkpoint(tmp_path):
    cfg = GPT_CONFIGS["gpt-tiny"]
    torch.manual_seed(0)
    model = ZeroDDP(GPT(cfg), chunk_size=CHUNK_SIZE)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **HYPER)
    for i in range(WARMUP):
        _torch_step(model, optim, 100 + i)
    step_dir = torch_save_checkpoint(tmp_path / "ckpt", model, optim, step=WARMUP)

    torch_losses = [_torch_step(model, optim, 200 + i) for i in range(STEPS)]
    torch_params = {k: v.detach().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}

    mesh = jb.make_mesh(4)
    restored = jb.restore_checkpoint(step_dir, mesh, with_optimizer=True)
    assert restored.meta.layout.world_size == 1 and restored.layout.world_size == 4
    program = gpt_program(jb.GPTConfig.from_dict(restored.meta.model_config))
    trainer = ZeroTrainer(program, restored.layout, mesh, adamw_from_meta(restored.meta.optimizer))
    state = trainer.from_chunks(restored.chunks, restored.opt_state_chunks, restored.meta.optimizer.step)
    jax_losses = []
    for i in range(STEPS):
        x, y = _batch(200 + i)
        state, loss = trainer.step(state, {"idx": x.numpy(), "targets": y.numpy()})
        jax_losses.append(float(loss))
    got = jb.unflatten(trainer.chunks(state), restored.layout, nested=False)

    np.testing.assert_allclose(jax_losses, torch_losses, rtol=CROSS_RTOL)
    err = normwise_rel_err(got, torch_params)
    print(f"JAX ZeRO-3 (4 devices) vs torch ZeroDDP (W=1) after {STEPS} steps from step {WARMUP}: {err:.2e}")
    assert err < CROSS_RTOL
    exp_avg, step = trainer.opt_state_chunks(state)
    assert step == WARMUP + STEPS and sorted(exp_avg) == ["exp_avg", "exp_avg_sq"]


def test_torch_resumes_a_jax_trained_step_as_if_uninterrupted(tmp_path):
    """torch trains and saves; ZeroTrainer.from_checkpoint trains K steps on 4 devices and saves with
    ZeroTrainer.save_checkpoint; torch — an optimizer built with wrong hyper-parameters — loads it
    (step, AdamW state, hyper-parameters, max_norm, loss scaler: nothing built by hand) and trains on.
    The result equals an uninterrupted torch run within the cross-framework tolerance."""
    from torch_backend.checkpoint.sharded import load_checkpoint, read_meta

    cfg = GPT_CONFIGS["gpt-tiny"]
    torch.manual_seed(0)
    model = ZeroDDP(GPT(cfg), chunk_size=CHUNK_SIZE)
    optim = ZeroOptimizer(model, torch.optim.AdamW, max_norm=MAX_NORM, **HYPER)
    for i in range(WARMUP):
        _torch_step(model, optim, 100 + i)
    step_dir = torch_save_checkpoint(tmp_path / "ckpt", model, optim, step=WARMUP)
    ref_losses = [_torch_step(model, optim, 200 + i) for i in range(JAX_STEPS + TORCH_STEPS)]  # uninterrupted
    ref = {k: v.detach().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}

    trainer, state = ZeroTrainer.from_checkpoint(step_dir, jb.make_mesh(4))
    assert trainer.max_norm == MAX_NORM and trainer.layout.world_size == 4
    jax_losses = []
    for i in range(JAX_STEPS):
        x, y = _batch(200 + i)
        state, loss = trainer.step(state, {"idx": x.numpy(), "targets": y.numpy()})
        jax_losses.append(float(loss))
    trainer.save_checkpoint(tmp_path / "ckpt", state, step=WARMUP + JAX_STEPS)
    meta = read_meta(tmp_path / "ckpt")
    assert meta.step == meta.optimizer.step == WARMUP + JAX_STEPS and meta.layout.world_size == 4
    assert (
        meta.loss_scaler["step_count"] == WARMUP + JAX_STEPS and meta.optimizer.hyperparameters["max_norm"] == MAX_NORM
    )

    torch.manual_seed(123)  # another init, and every hyper-parameter wrong: all must come from the checkpoint
    resumed = ZeroDDP(GPT(cfg), chunk_size=CHUNK_SIZE)
    resumed_optim = ZeroOptimizer(resumed, torch.optim.AdamW, lr=0.5, betas=(0.5, 0.5), eps=1e-3, weight_decay=0.0)
    load_checkpoint(tmp_path / "ckpt", resumed, resumed_optim, load_rng=False)
    group = resumed_optim.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == \
        (HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"])
    assert resumed_optim.max_norm == MAX_NORM and resumed_optim.step_count == WARMUP + JAX_STEPS
    torch_losses = [_torch_step(resumed, resumed_optim, 200 + JAX_STEPS + i) for i in range(TORCH_STEPS)]
    got = {k: v.detach().numpy() for k, v in resumed.state_dict().items() if k != "lm_head.weight"}

    np.testing.assert_allclose(jax_losses + torch_losses, ref_losses, rtol=CROSS_RTOL)
    err = normwise_rel_err(got, ref)
    print(f"torch -> JAX ({JAX_STEPS} steps) -> torch ({TORCH_STEPS} steps) vs uninterrupted torch: {err:.2e}")
    assert err < CROSS_RTOL


def test_a_trainer_from_scratch_saves_with_adamw_meta(tmp_path):
    """A ZeroTrainer built without a checkpoint records its optax.adamw through adamw_meta (the inverse of
    adamw_hyperparameters) and saves a step torch's loader accepts; without it, saving is refused."""
    from chunkzero.errors import ConfigError
    from jax_backend.optim import adamw_hyperparameters
    from torch_backend.checkpoint.sharded import load_checkpoint

    hyper = dict(learning_rate=1e-3, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.1)
    meta = jb.adamw_meta(**hyper, max_norm=1.0)
    assert adamw_hyperparameters(meta) == hyper and meta.hyperparameters["max_norm"] == 1.0
    with pytest.raises(ConfigError, match="learning_rate must be a number"):
        jb.adamw_meta(**{**hyper, "learning_rate": lambda step: 1e-3})

    program = gpt_program(jb.gpt_config("gpt-tiny"))
    torch.manual_seed(0)
    model = ZeroDDP(GPT(GPT_CONFIGS["gpt-tiny"]), chunk_size=CHUNK_SIZE)
    layout = model.layout.relayout(2)
    bare = ZeroTrainer(program, layout, jb.make_mesh(2), adamw_from_meta(meta))
    state = bare.init(program.init(0))
    with pytest.raises(ConfigError, match="has no optimizer_meta"):
        bare.save_checkpoint(tmp_path / "c", state, step=1)
    trainer = ZeroTrainer(program, layout, jb.make_mesh(2), adamw_from_meta(meta), optimizer_meta=meta, max_norm=1.0)
    x, y = _batch(7)
    state, _ = trainer.step(trainer.init(program.init(0)), {"idx": x.numpy(), "targets": y.numpy()})
    trainer.save_checkpoint(tmp_path / "c", state, step=1, model_config=GPT_CONFIGS["gpt-tiny"].to_dict())
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=0.5)
    loaded = load_checkpoint(tmp_path / "c", model, optim, load_rng=False)
    assert loaded.optimizer.step == 1 and optim.step_count == 1 and optim.max_norm == 1.0
    assert optim.param_groups[0]["lr"] == 1e-3 and tuple(optim.param_groups[0]["betas"]) == (0.9, 0.95)


GROUPED = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.5)
"""Two param groups that differ in both lr and weight decay (nanoGPT's split, exaggerated so that a step
that ignores the groups is far outside the tolerance)."""


def test_jax_keeps_torch_param_groups_exactly(tmp_path):
    """torch ZeroDDP with nanoGPT's two groups (weight decay on matrices; none and half the lr on biases and
    LayerNorm, which share chunks with the matrices) saves; ZeroTrainer.from_checkpoint continues on 4
    devices equal to torch within the cross-framework tolerance, per tensor; ignoring the groups (one
    optax.adamw with group 0's values) does not; and the JAX save hands the groups back to torch."""
    from zero_utils import max_rel_err

    from chunkzero.errors import ConfigError
    from jax_backend.optim import adamw_hyperparameters
    from torch_backend.checkpoint.sharded import load_checkpoint, read_meta

    cfg = GPT_CONFIGS["gpt-tiny"]
    torch.manual_seed(0)
    model = ZeroDDP(GPT(cfg), chunk_size=CHUNK_SIZE)
    no_decay = [p for p in model.module.parameters() if p.dim() < 2]
    groups = [{"params": no_decay, "weight_decay": 0.0, "lr": GROUPED["lr"] / 2}]
    optim = ZeroOptimizer(model, torch.optim.AdamW, param_groups=groups, **GROUPED)
    mixed = {t.chunk for t in model.layout.tensors if t.name.endswith("bias")} & \
        {t.chunk for t in model.layout.tensors if t.name.endswith("weight") and len(t.shape) == 2}
    assert mixed, "the test wants chunks that mix the two groups"
    for i in range(WARMUP):
        _torch_step(model, optim, 100 + i)
    step_dir = torch_save_checkpoint(tmp_path / "ckpt", model, optim, step=WARMUP)
    torch_losses = [_torch_step(model, optim, 200 + i) for i in range(STEPS)]
    ref = {k: v.detach().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}

    def run_jax(trainer, state):
        losses = []
        for i in range(STEPS):
            x, y = _batch(200 + i)
            state, loss = trainer.step(state, {"idx": x.numpy(), "targets": y.numpy()})
            losses.append(float(loss))
        return state, losses, jb.unflatten(trainer.chunks(state), trainer.layout, nested=False)

    trainer, state = ZeroTrainer.from_checkpoint(step_dir, jb.make_mesh(4))
    state, jax_losses, got = run_jax(trainer, state)
    np.testing.assert_allclose(jax_losses, torch_losses, rtol=CROSS_RTOL)
    err = max_rel_err(got, ref)
    print(f"JAX with torch's two param groups vs torch after {STEPS} steps: per-tensor max rel {err:.2e}")
    assert err < CROSS_RTOL

    # the mutant: one set of hyper-parameters for every element
    restored = jb.restore_checkpoint(step_dir, jb.make_mesh(4), with_optimizer=True)
    with pytest.raises(ConfigError, match="pass the layout"):
        adamw_from_meta(restored.meta.optimizer)
    flat = optax.adamw(**adamw_hyperparameters(restored.meta.optimizer, groups_may_differ=True))
    wrong = ZeroTrainer(trainer.program, restored.layout, jb.make_mesh(4), flat)
    _, _, wrong_got = run_jax(wrong, wrong.from_chunks(restored.chunks, restored.opt_state_chunks, WARMUP))
    assert max_rel_err(wrong_got, ref) > 10 * CROSS_RTOL

    # JAX saves, torch (built with the right groups but wrong values) resumes them
    trainer.save_checkpoint(tmp_path / "ckpt", state, step=WARMUP + STEPS)
    meta = read_meta(tmp_path / "ckpt")
    assert [g["weight_decay"] for g in meta.optimizer.param_groups] == [0.0, GROUPED["weight_decay"]]
    resumed = ZeroDDP(GPT(cfg), chunk_size=CHUNK_SIZE)
    resumed_optim = ZeroOptimizer(resumed, torch.optim.AdamW, lr=0.5, param_groups=[
        {"params": [p for p in resumed.module.parameters() if p.dim() < 2], "weight_decay": 0.1}])
    load_checkpoint(tmp_path / "ckpt", resumed, resumed_optim, load_rng=False)
    assert [(g["lr"], g["weight_decay"]) for g in resumed_optim.param_groups] == \
        [(GROUPED["lr"] / 2, 0.0), (GROUPED["lr"], GROUPED["weight_decay"])]
