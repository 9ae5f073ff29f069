"""A chunk's shards outside the training step, as functions over :class:`~torch_backend.zero.chunks.Chunk`'s
public shard API: the full fp32 values for checkpoints and state dicts (collective), a rank's shard
built from full tensors, and the bytes a chunk holds (the memory report).
"""

from __future__ import annotations

import torch

from . import collectives

__all__ = ["bytes_by_kind", "frozen_bytes_by_dtype", "gather_master", "gather_shard_tensor", "held_bytes",
           "shard_from_full"]


def held_bytes(t: torch.Tensor) -> int:
    """Bytes ``t``'s memory takes: ``numel × element_size``. Pinned host tensors are slices of the
    pinned arena, not rounded blocks of their own; the arena's slack is reported apart
    (``MemoryReport.pinned_held_bytes``)."""
    return t.numel() * t.element_size()


def gather_shard_tensor(chunk, shard: torch.Tensor) -> torch.Tensor:
    """All-gather a 1-D per-rank tensor of ``chunk.shard_numel`` elements (a master shard, an
    optimizer state) into the full chunk (``chunk.size`` elements, on ``chunk.device``; collective)."""
    if chunk.keep_gathered or chunk.world_size == 1:
        return shard
    src = shard.to(chunk.device)
    out = chunk.tracker.track(torch.empty(chunk.size, dtype=shard.dtype, device=chunk.device), "staging")
    collectives.all_gather_flat(out, src, chunk.group, tracker=chunk.tracker)
    return out


def gather_master(chunk) -> torch.Tensor:
    """The full fp32 chunk (``chunk.size`` elements), assembled from every rank's master (collective)."""
    return gather_shard_tensor(chunk, chunk.master_values())


def shard_from_full(chunk, tensors: dict[str, torch.Tensor], dtype=torch.float32,
                    base: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's 1-D shard of ``chunk`` (``shard_numel`` elements, CPU) from full-shaped tensors keyed by
    primary name; tensors not given keep ``base``'s values (zeros without ``base``), padding is zero."""
    out = torch.zeros(chunk.shard_numel, dtype=dtype) if base is None else base.to("cpu", dtype, copy=True)
    for t, a, b, off in chunk.layout.shard_pieces(chunk.index, chunk.rank):
        full = tensors.get(t.name)
        if full is not None:
            out[off : off + b - a] = full.detach().reshape(-1)[a:b].to("cpu", dtype)
    return out


def bytes_by_kind(chunk) -> list[tuple[torch.device, str, int]]:
    """``(device, kind, bytes)`` of everything ``chunk`` holds now, on the device each tensor is on;
    pinned host tensors at their size (:func:`held_bytes`), device→host gradient copies in flight
    (their device shard and pinned staging buffer) included."""
    out = []
    shard, master = chunk.shard, chunk.master
    shared = shard is not None and master is not None and shard.data_ptr() == master.data_ptr()
    if shard is not None:
        out.append((shard.device, "parameters", held_bytes(shard)))
    if chunk.resident and chunk.casts_frozen:  # keep-gathered frozen in another dtype: its compute copy
        out.append((chunk.buffer.device, "parameters", chunk.size * chunk.buffer.element_size()))
    if master is not None and not shared:
        out.append((master.device, "fp32_master", held_bytes(master.detach())))
    if (chunk.is_gathered or chunk.gather_in_flight) and not chunk.resident:
        out.append((chunk.buffer.device, "gathered_buffers", chunk.size * chunk.buffer.element_size()))
    if chunk.gradient is not None:
        out += [(t.device, "gradients", held_bytes(t)) for t in chunk.gradient.held()]
    if master is not None and master.grad is not None:
        out.append((master.grad.device, "gradients", held_bytes(master.grad)))
    return out


def frozen_bytes_by_dtype(chunk) -> list[tuple[torch.device, str, int]]:
    """``(device, dtype name, bytes)`` of a frozen chunk's persistent tensors (its storage-dtype shard,
    and the compute-dtype copy a keep-gathered chunk stored in another dtype keeps); ``[]`` for a
    trainable chunk. These bytes are part of :func:`bytes_by_kind`'s ``parameters``."""
    if chunk.requires_grad:
        return []
    shard = chunk.shard
    out = [(shard.device, str(shard.dtype).removeprefix("torch."), shard.numel() * shard.element_size())]
    if chunk.resident and chunk.casts_frozen:
        out.append(
            (chunk.buffer.device, str(chunk.dtype).removeprefix("torch."), chunk.size * chunk.buffer.element_size())
        )
    return out
