"""Spawned workers of ``test_streams.py``: real ZeroDDP training steps on gloo under the recording
stand-in stream layer (``stream_recorder.py``), so the engine runs its CUDA stream paths on CPU."""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_backend.zero import collectives
from torch_backend.zero.pinned import host_empty

ADAMW = dict(lr=1e-2, eps=1e-6)
STEPS = 3


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 4)
    )


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank: int, placement: dict) -> list[torch.Tensor]:
    """``STEPS`` AdamW steps of ZeroDDP (prefetch 1, 4 chunks) with ``placement``; the full parameters after."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    model = ZeroDDP(_module(), chunk_size=600, prefetch=1, **placement)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    for step in range(STEPS):
        optim.backward(model(_batch(rank, step)).square().mean())
        assert optim.step()
        optim.zero_grad()
    model.synchronize()
    return [v.clone() for v in model.state_dict().values()]


def finish_reduces_before_the_fix(self) -> None:
    """``ChunkGradient.finish_reduces`` as it was: the optimizer-offloaded branch waits for the
    reduce-scatter on the communication stream and lets its buffers go straight back to the compute
    stream's pool."""
    if not self.reductions:
        return
    c = self._chunk
    for pending, out in self.reductions:
        if self._streams and c.master_device.type == "cpu":
            with collectives.communication_stream(out):
                if pending is not None:
                    pending.wait()
                staging = host_empty(out.numel(), out.dtype, c.device)
                staging.copy_(out, non_blocking=True)
                done = collectives.record_event(collectives.compute_stream(out))
            self._to_host.append((staging, done, out))
            continue
        if pending is not None:
            pending.wait()
        self._accumulate(out.to(c.master_device, torch.float32))
    self.reductions.clear()
    if not self._to_host:
        self._update_norm()


def worker_recorded_step(rank: int, world: int, placement: dict, mutant: bool = False) -> dict:
    """Train under the recorder; also without it (the plain CPU paths) for the reference values.
    Returns the violations, how many cross-stream buffers were freed (checked), and the largest
    difference of the parameters to the reference run."""
    from stream_recorder import StreamRecorder

    from torch_backend.zero.chunk_gradient import ChunkGradient

    reference = _train(rank, placement)
    recorder = StreamRecorder()
    previous = collectives.set_stream_layer(recorder)
    original = ChunkGradient.finish_reduces
    if mutant:
        ChunkGradient.finish_reduces = finish_reduces_before_the_fix
    try:
        with recorder:
            recorded = _train(rank, placement)
        violations = recorder.check()
    finally:
        ChunkGradient.finish_reduces = original
        collectives.set_stream_layer(previous)
    diff = max(float((a - b).abs().max()) for a, b in zip(recorded, reference))
    return {"violations": violations, "freed_cross_stream": recorder.freed_cross_stream,
            "comm_buffers": recorder.comm_uses, "max_diff": diff}
