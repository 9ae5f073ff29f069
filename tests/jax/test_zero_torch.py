"""Cross-framework: from the same chunkzero checkpoint, K steps of the JAX ZeRO-3 step on 4 simulated
devices equal K steps of torch ``ZeroDDP`` + ``ZeroOptimizer`` (single process, W=1) on the same
batches (issue 7; fp32, normwise rtol 1e-4).

The checkpoint is written by ``torch_backend.checkpoint.save_checkpoint`` after two torch steps, so it
carries AdamW state (``exp_avg``, ``exp_avg_sq``, step 2); JAX restores it with
``jax_backend.restore_checkpoint`` at world size 4 (chunks re-padded) and continues with
``optax.adamw`` built from the checkpoint's hyper-parameters.
"""

from __future__ import annotations

import numpy as np
from zero_utils import BATCH, SEQ, normwise_rel_err

import torch
from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend.checkpoint import save_checkpoint as torch_save_checkpoint
from torch_backend.gpt import GPT, GPT_CONFIGS

import jax_backend as jb
from jax_backend.blocks import gpt_program
from jax_backend.optim import adamw_from_meta
from jax_backend.zero import ZeroTrainer

CROSS_RTOL = 1e-4
"""torch vs JAX after K steps: ||θ_jax − θ_torch|| / ||θ_torch|| (different kernels and summation orders)."""
CHUNK_SIZE = 30_000
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
WARMUP, STEPS = 2, 3


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
