"""What the tests that step both engines side by side share (``test_train_bf16.py``, ``test_train_skip.py``):
the global batch of a step, torch's parameters as numpy, and the normwise error of an update."""

from __future__ import annotations

import numpy as np
import torch

BATCH, SEQ = 8, 32
"""The global batch of every step: ``BATCH`` sequences of ``SEQ`` byte tokens."""


def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch ``(inputs, targets)``, int64 ``[BATCH, SEQ]`` each, random bytes seeded by
    the step."""
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def torch_params(adapter) -> dict[str, np.ndarray]:
    """The torch adapter's parameters by name, fp32 numpy (the tied head left out: it is the embedding)."""
    return {k: v.detach().float().numpy().copy() for k, v in adapter.model.state_dict().items()
            if k != "lm_head.weight"}


def update_error(got: dict, want: dict, start: dict) -> float:
    """``‖Δgot − Δwant‖ / ‖Δwant‖`` over every tensor of ``want``, ``Δ = final − start`` (float64)."""
    num = sum(float(((np.asarray(got[n], np.float64) - want[n]) ** 2).sum()) for n in want)
    den = sum(float(((np.asarray(want[n], np.float64) - start[n]) ** 2).sum()) for n in want)
    return (num / den) ** 0.5
