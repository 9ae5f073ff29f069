"""The step trace of issue 33: which project files one training step runs through, and how often.

:func:`trace_step` builds a 4-layer HF GPT-2 under ``ZeroDDP`` + ``ZeroOptimizer(AdamW)`` at world
size 1 (no process group), runs one untraced step (so the access orders are recorded, as in steady
training), then traces one step — forward, backward, ``step``, ``zero_grad`` — with ``sys.setprofile``
and counts the Python calls whose code lives in the project (``chunkzero/``, ``torch_backend/``,
``jax_backend/``), per file. ``python tests/torch/step_trace.py`` prints the table.
"""

from __future__ import annotations

import collections
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECT_DIRS = tuple(os.path.join(ROOT, d) + os.sep for d in ("chunkzero", "torch_backend", "jax_backend"))


def trace_step(n_layer: int = 4, warmup: int = 1) -> collections.Counter:
    """``{project file (relative path): Python calls}`` in one traced step (see the module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zero_cases import ADAMW, gpt2_loss, hf_gpt2

    from torch_backend import ZeroDDP, ZeroOptimizer

    model = ZeroDDP(hf_gpt2(n_layer=n_layer, n_embd=32))
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def step():
        optim.backward(gpt2_loss(model, batch))
        optim.step()
        optim.zero_grad()

    for _ in range(warmup):
        step()
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):  # noqa: ARG001
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(PROJECT_DIRS):
                counts[os.path.relpath(path, ROOT)] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts


if __name__ == "__main__":
    counts = trace_step()
    for path, n in counts.most_common():
        print(f"{n:6d}  {path}")
    print(f"{sum(counts.values()):6d}  total in {len(counts)} files")
