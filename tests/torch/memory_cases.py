"""Workers and models for ``test_memory_bound.py`` (spawned workers import them by name)."""

from __future__ import annotations

import torch
from torch import nn

from torch_backend import ZeroDDP

WIDTH = 64
LAYERS = 8
LAYER_NUMEL = WIDTH * WIDTH + WIDTH
"""Elements of one layer (weight + bias); the tests use chunks of two layers each."""


class Stack(nn.Module):
    """``LAYERS`` linear layers of ``WIDTH``: with ``chunk_size=2 * LAYER_NUMEL``, ``LAYERS / 2`` chunks
    of two layers each, used in backward in reverse order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def chunk_bytes(model: ZeroDDP) -> int:
    """The largest chunk's bytes in the compute dtype."""
    return max(c.size for c in model.chunks) * model.chunks[0].buffer.element_size()


def backward_peaks(model: ZeroDDP, x: torch.Tensor) -> dict[str, int]:
    """One forward and backward of ``model`` on ``x``; the allocation peaks (cpu, by kind) of the backward."""
    loss = model(x)
    model.reset_peak_memory()
    model.backward(loss)
    model.synchronize()
    return dict(model.memory_report().peak_allocated.get("cpu", {}))


def worker_gradient_bound(rank: int, world: int):
    """At W ranks with prefetch 1: the peak of full gradient chunks alive during the backward (being
    accumulated, waiting, or reducing) and of exchange buffers; the gradients' agreement with a
    single-process reference is checked by the caller from the returned mean gradient."""
    model = ZeroDDP(Stack(), chunk_size=2 * LAYER_NUMEL, prefetch=1)
    torch.manual_seed(1)
    x = torch.randn(world * 4, WIDTH)[rank * 4 : (rank + 1) * 4]
    peaks = backward_peaks(model, x)
    grads = [model.grad_shard(c.index).clone() for c in model.chunks]
    return {"peaks": peaks, "chunk_bytes": chunk_bytes(model), "chunks": len(model.chunks),
            "grads": [g.tolist() for g in grads]}
