"""The tiny model the checkpoint tests train, and helpers to compare full training states.

Distributed runs use ``torch_backend._testing.run_distributed`` (fresh spawned gloo ranks).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from tiny_models import GPT_TINY

TINY = dict(GPT_TINY, dropout=0.1)
"""A GPT of 34,176 parameters; dropout makes the loss depend on the torch RNG."""


# ------------------------------------------------------------------ the model the tests train


def build(chunk_size: int = 3000, mixed_precision: str = "fp32", seed: int = 0):
    """The tiny GPT wrapped in ZeroDDP (frozen ``wpe``, keep-gathered ``ln_f.weight``) and a ZeroOptimizer
    with two param groups (weight decay on matrices; none, and half the learning rate, on the rest)."""
    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.train.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    module = GPT(GPTConfig(**TINY))
    module.transformer.wpe.weight.requires_grad_(False)
    model = ZeroDDP(module, chunk_size=chunk_size, mixed_precision=mixed_precision,
                    keep_gathered=["transformer.ln_f.weight"])
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3}]
    optim = ZeroOptimizer(model, torch.optim.AdamW, param_groups=groups, lr=1e-2, max_norm=1.0)
    return model, optim


def train_step(model, optim, step: int, rank: int) -> float:
    """One optimizer step on this rank's batch of ``step`` (fixed by ``step`` and ``rank``); the local loss."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (2, 16), generator=g)
    y = torch.roll(x, -1, dims=1)
    loss = F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
    optim.backward(loss)
    optim.step()
    optim.zero_grad()
    return loss.item()


def full_state(model, optim) -> dict[str, np.ndarray]:
    """Every parameter (fp32 master, by every name), optimizer state (full-shaped) and every group's
    hyper-parameters with ``max_norm`` (collective)."""
    out = {f"param/{k}": v.numpy().copy() for k, v in model.state_dict().items()}
    for i, g in enumerate(optim.param_groups):
        for k in ("lr", "weight_decay", "betas", "eps"):
            out[f"hyper/{i}/{k}"] = np.asarray(g[k])
    out["hyper/max_norm"] = np.asarray(np.nan if optim.max_norm is None else optim.max_norm)
    for name, st in optim.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{name}/{k}"] = v.numpy().copy() if torch.is_tensor(v) else np.asarray(v)
    return out


def assert_same_state(got: dict, want: dict, what: str = "") -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        assert got[k].shape == want[k].shape and np.array_equal(got[k], want[k]), f"{what}: {k} differs"
