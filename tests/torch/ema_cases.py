"""Per-rank workers of the ZeroEMA tests, run in spawned gloo processes (world sizes 1, 2, 3).

The reference is torch's own: ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))`` over a plain
fused AdamW run of the unwrapped model on the full batch, updated once before training (so its EMA
starts at the initial weights, as ZeroEMA's does) and after every step. Tolerance: 1e-6 absolute
(fp32; the masters differ from the reference only by the gradients' summation order; Adam eps 1e-6).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from zero_cases import ADAMW, batches, gpt2_loss, hf_gpt2, micro

DECAY = 0.9
"""A fast EMA, so 5 steps move it well away from both the initial and the live weights."""
ATOL = 1e-6
CHUNK_SIZE = 1500
STEPS = 5
GLOBAL_BATCH = 6
"""Divisible by 1, 2 and 3."""


def build(chunk_size: int = CHUNK_SIZE, decay: float = DECAY):
    """HF GPT-2 (2 layers, tied) with ``wpe`` frozen and ``ln_f`` keep-gathered, a fused AdamW
    ZeroOptimizer and a ZeroEMA; also the unwrapped module's copy for the reference."""
    from torch_backend import ZeroDDP, ZeroEMA, ZeroOptimizer

    module = hf_gpt2()
    module.transformer.wpe.weight.requires_grad_(False)
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=chunk_size, keep_gathered=lambda n: n.startswith("transformer.ln_f"))
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    ema = ZeroEMA(optim, decay)
    return model, optim, ema, ref


def zero_step(model, optim, batch, rank: int, world: int) -> None:
    optim.backward(gpt2_loss(model, micro(batch, rank, world)))
    assert optim.step()
    optim.zero_grad()


def ema_state(model, ema) -> dict[str, np.ndarray]:
    """The full EMA weights by name (collective), read inside ``ema_weights()``."""
    with ema.ema_weights():
        return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def reference(ref, steps: int, decay: float = DECAY):
    """The plain-torch run and its torch EMA: ``(the weights before and after each step, EMA weights)``."""
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], fused=True, **ADAMW)
    averaged = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(decay))
    averaged.update_parameters(ref)  # n_averaged 0 -> copies: the EMA starts at the initial weights
    live = [_numpy(ref)]
    for batch in batches("gpt2", steps, GLOBAL_BATCH):
        gpt2_loss(ref, batch).backward()
        opt.step()
        opt.zero_grad()
        averaged.update_parameters(ref)
        live.append(_numpy(ref))
    return live, _numpy(averaged.module)


def _numpy(module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def formula_ema(weights: list[dict], weight: float) -> dict[str, np.ndarray]:
    """``ema = (1 - weight) * ema + weight * w`` over ``weights[1:]``, starting at ``weights[0]`` (float64)."""
    ema = {k: v.astype(np.float64) for k, v in weights[0].items()}
    for w in weights[1:]:
        ema = {k: (1 - weight) * ema[k] + weight * w[k] for k in ema}
    return ema


def max_error(got: dict, want: dict) -> float:
    return max(float(np.abs(got[k] - want[k]).max()) for k in want)


def worker_equals_torch(rank: int, world: int):
    """5 AdamW steps with the EMA; returns (the same on every rank) the EMA's and the live weights'
    largest error against torch, the errors against two wrong EMAs (the decay's roles swapped; torch's
    AveragedModel started at the first step's weights instead of the initial ones), and checks."""
    model, optim, ema, ref = build()
    initial = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    trainable = {c.index for c in model.layout.chunks if c.requires_grad}
    for batch in batches("gpt2", STEPS, GLOBAL_BATCH):
        zero_step(model, optim, batch, rank, world)
    got_live = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    got = ema_state(model, ema)
    after = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    live, want = reference(ref, STEPS)
    report = optim.memory_report()
    return {
        "ema_error": max_error(got, want),
        "formula_error": max_error(got, formula_ema(live, 1 - DECAY)),
        "live_error": max_error(got_live, live[-1]),
        "restored_bitwise": all(np.array_equal(after[k], got_live[k]) for k in got_live),
        "swapped_decay_error": max_error(got, formula_ema(live, DECAY)),
        "late_start_error": max_error(got, formula_ema(live[1:], 1 - DECAY)),
        "moved_from_start": max_error(got, initial),
        "moved_from_live": max_error(got, got_live),
        "frozen_equal": bool(np.array_equal(got["transformer.wpe.weight"], initial["transformer.wpe.weight"])),
        "chunks": sorted(ema.shards) == sorted(trainable) and len(trainable) < len(model.layout.chunks),
        "update_count": ema.update_count,
        "ema_bytes": report.total("ema"),
        "ema_bytes_expected": 4 * sum(model.layout.shard_numel(i) for i in trainable),
    }


def worker_resume_phase_a(rank: int, world: int, root: str):
    """World size 2: 3 steps, save (with the EMA) at step 3, 2 more steps; the final EMA (rank 0)."""
    from torch_backend import save_checkpoint

    model, optim, ema, _ = build()
    data = batches("gpt2", STEPS, GLOBAL_BATCH)
    for batch in data[:3]:
        zero_step(model, optim, batch, rank, world)
    save_checkpoint(root, model, optim, step=3)
    for batch in data[3:]:
        zero_step(model, optim, batch, rank, world)
    return {"ema": ema_state(model, ema), "update_count": ema.update_count}


def worker_resume_phase_b(rank: int, world: int, root: str):
    """World size 3, another chunk size and another decay: load step 3, 2 more steps; the EMA (rank 0)."""
    from torch_backend import load_checkpoint

    model, optim, ema, _ = build(chunk_size=1100, decay=0.5)
    meta = load_checkpoint(root, model, optim)
    loaded = {"decay": ema.decay, "update_count": ema.update_count, "meta": meta.ema.to_dict()}
    data = batches("gpt2", STEPS, GLOBAL_BATCH)
    for batch in data[3:]:
        zero_step(model, optim, batch, rank, world)
    return {"ema": ema_state(model, ema), "update_count": ema.update_count, "loaded": loaded}
