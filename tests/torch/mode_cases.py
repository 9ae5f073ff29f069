"""Shared by the access-mode tests (``test_suspended_mode.py``, ``test_recorded_units.py``,
``test_released_params.py``): small models trained by ZeroDDP on one rank against plain torch."""

from __future__ import annotations

import copy

import torch
from torch import nn

from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend.zero.access_mode import ParamAccessMode


def mode_on() -> bool:
    """Whether ZeroDDP's access mode is on the torch-function mode stack now."""
    return any(isinstance(m, ParamAccessMode) for m in torch.overrides._get_current_function_mode_stack())


def inputs(steps: int = 4) -> list[torch.Tensor]:
    """``steps`` batches of shape ``(4, 8)``."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(steps)]


def reference(net: nn.Module, xs: list[torch.Tensor]) -> tuple[list[float], dict]:
    """Plain torch AdamW on a copy of ``net``, one step per batch: the losses and the final state dict."""
    ref = copy.deepcopy(net)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for x in xs:
        loss = ref(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def train(model: ZeroDDP, xs: list[torch.Tensor]) -> list[float]:
    """The same steps under ``ZeroOptimizer(AdamW)``: the losses."""
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    losses = []
    for x in xs:
        loss = model(x).square().mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_losses_match(got: list[float], want: list[float]) -> None:
    """Equal up to float rounding (ZeroOptimizer steps flat chunks, the reference each tensor: the kernels
    may round differently by CPU); a skipped step or another learning rate is far outside it."""
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=1e-8)
