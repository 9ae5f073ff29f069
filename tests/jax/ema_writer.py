"""A torch run with a ZeroEMA, checkpointed at world size 2, for the JAX EMA restore test (spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DECAY = 0.5
STEPS = 3


def worker_save_with_ema(rank: int, world: int, root: str):
    """A tiny GPT (frozen ``wpe``, keep-gathered ``ln_f.weight``), 3 AdamW steps with a ZeroEMA, saved
    at step 3; returns (rank 0) the full live and EMA weights."""
    from torch_backend import ZeroDDP, ZeroEMA, ZeroOptimizer, save_checkpoint
    from torch_backend.train.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    module = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, dropout=0.0))
    module.transformer.wpe.weight.requires_grad_(False)
    model = ZeroDDP(module, chunk_size=1500, keep_gathered=["transformer.ln_f.weight"])
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    ema = ZeroEMA(optim, DECAY)
    for step in range(STEPS):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = F.cross_entropy(model(x).float().reshape(-1, 64), torch.roll(x, -1, 1).reshape(-1))
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
    save_checkpoint(root, model, optim, step=STEPS)
    live = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    with ema.ema_weights():
        averaged = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    return {"live": live, "ema": averaged} if rank == 0 else None

