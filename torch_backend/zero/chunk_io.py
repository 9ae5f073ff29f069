"""A chunk's shards outside the training step: :class:`ChunkShardIO`, the part of
:class:`torch_backend.zero.chunks.Chunk` that checkpoints, state dicts, the placement and the memory
report use — reading and writing the fp32 values of a rank's shard, moving shards between host and
device (``placement="auto"``), and counting the bytes a chunk holds. The chunk's storage itself and
its life during a step are described in :mod:`torch_backend.zero.chunks`.
"""

from __future__ import annotations

import torch

from . import collectives
from .pinned import host_arena, pinned_block_bytes

__all__ = ["ChunkShardIO", "copied", "held_bytes", "host_empty", "pinned_block_bytes"]


def held_bytes(t: torch.Tensor) -> int:
    """Bytes ``t``'s memory takes: ``numel × element_size``. Pinned host tensors are slices of the
    pinned arena (:func:`host_empty`), not rounded blocks of their own; the arena's slack (slab bytes
    no slice uses) is reported apart (``MemoryReport.pinned_held_bytes``)."""
    return t.numel() * t.element_size()


def host_empty(numel: int, dtype: torch.dtype, like_device: torch.device) -> torch.Tensor:
    """An empty 1-D host tensor, pinned when the compute device has streams (CUDA; so copies can be
    async): a slice of the process's pinned arena for that device (:mod:`torch_backend.zero.pinned`:
    no power-of-two rounding per buffer), whose ranges are reused only after the device's streams are
    done with them."""
    if collectives.uses_streams(like_device):
        return host_arena(torch.device(like_device), collectives.stream_layer()).empty(numel, dtype)
    return torch.empty(numel, dtype=dtype)


def copied(t: torch.Tensor, device: torch.device, compute_device: torch.device, dtype: torch.dtype | None = None,
           *, non_blocking: bool = False) -> torch.Tensor:
    """A fresh 1-D copy of ``t`` on ``device``, in ``dtype`` (default: ``t``'s); host copies are pinned
    when computing on CUDA, so that ``non_blocking`` copies are asynchronous (stream-ordered)."""
    device, dtype = torch.device(device), dtype or t.dtype
    if device.type == "cpu":
        out = host_empty(t.numel(), dtype, compute_device)
    else:
        out = torch.empty(t.numel(), dtype=dtype, device=device)
    out.copy_(t.reshape(-1), non_blocking=non_blocking)
    return out


class ChunkShardIO:
    """State I/O, placement moves and byte counts of a :class:`~torch_backend.zero.chunks.Chunk` (a base
    class of it: the methods read the chunk's ``shard``, ``master``, buffers and layout)."""

    # ------------------------------------------------------------------ placement moves (movable chunks)
    def move_shard(self, device: torch.device, *, offloaded: bool) -> int:
        """Move the persistent parameter shard to ``device`` (host: pinned when computing on CUDA); the
        copy is asynchronous on CUDA. Always a copy, also where host and device are the same memory
        (CPU), so the path is the same. ``offloaded``: the shard is now off the device (sets
        :attr:`param_offloaded`). Returns the bytes copied.

        Raises:
            ValueError: the chunk is not movable, or resident (its shard is the gathered buffer).
        """
        if not self.movable or self.resident:
            raise ValueError(f"chunk {self.index}'s parameter shard cannot move (movable={self.movable}, resident={self.resident})")
        self.shard = copied(self.shard, device, self.device, non_blocking=True)
        self.param_device = torch.device(device)
        self.param_offloaded = bool(offloaded)
        self.account_persistent()
        return self.shard.numel() * self.shard.element_size()

    def move_master(self, device: torch.device) -> int:
        """Move the fp32 master shard and its gradient to ``device`` (a copy, as :meth:`move_shard`);
        reductions in flight are completed first. The optimizer state follows the master at the next
        ``ZeroOptimizer.step`` (it sees the master replaced). Returns the bytes copied (0 when frozen).

        Raises:
            ValueError: the chunk is not movable.
        """
        if not self.movable:
            raise ValueError(f"chunk {self.index}'s master cannot move (not movable)")
        if self.master is None:
            return 0
        self.finish_reduces()
        self.finish_host_gradients()
        grad, self.master.grad = self.master.grad, None
        self.master.data = copied(self.master.detach(), device, self.device, non_blocking=True)
        moved = self.master.numel() * 4
        if grad is not None:
            self.master.grad = self.tracker.track(copied(grad, device, self.device, non_blocking=True), "fp32_gradients")
            moved += grad.numel() * 4
        self.master_device = torch.device(device)
        self.account_persistent()
        return moved

    # ------------------------------------------------------------------ state I/O
    def master_values(self) -> torch.Tensor:
        """The fp32 values of this rank's shard: the live master, or a frozen chunk's storage-dtype
        shard as fp32 (exact for fp32, bf16 and fp16 storage; the shard itself when it is fp32)."""
        return self.master.detach() if self.master is not None else self.shard.float()

    def load_master(self, values: torch.Tensor) -> None:
        """Copy a 1-D shard of ``shard_numel`` elements (any floating dtype) into the fp32 master (a
        frozen chunk: into its storage-dtype shard, and a resident compute-dtype copy from it) and
        refresh."""
        with torch.no_grad():
            if self.master is not None:
                self.master.copy_(values.to(self.master_device, torch.float32))
                if self.shard is not None and self.shard.data_ptr() != self.master.data_ptr():
                    self.shard.copy_(self.master.detach())
            else:
                self.shard.copy_(values.to(self.shard.device, self.storage_dtype))
                if self.resident and self.casts_frozen:
                    self.buffer.copy_(self.shard)
        self.release()

    def low_precision_shard(self) -> torch.Tensor:
        """The compute-dtype shard: the live persistent tensor, or a fresh cast of the master when
        none is kept (bf16/fp16 without offload), or of a frozen shard kept in another storage dtype."""
        if self.shard is None:
            return self.master.detach().to(self.device, self.dtype)
        if self.shard.dtype != self.dtype:
            return self.shard.to(self.device, self.dtype)
        return self.shard

    def gather_master(self) -> torch.Tensor:
        """The full fp32 chunk (``size`` elements), assembled from every rank's master (collective)."""
        return self.gather_shard_tensor(self.master_values())

    def gather_shard_tensor(self, shard: torch.Tensor) -> torch.Tensor:
        """All-gather a 1-D per-rank tensor of ``shard_numel`` elements (e.g. an optimizer state)."""
        if self.keep_gathered or self.world_size == 1:
            return shard
        src = shard.to(self.device)
        out = self.tracker.track(torch.empty(self.size, dtype=shard.dtype, device=self.device), "staging")
        collectives.all_gather_flat(out, src, self.group, tracker=self.tracker)
        return out

    def shard_from_full(self, tensors: dict[str, torch.Tensor], dtype=torch.float32, base: torch.Tensor | None = None) -> torch.Tensor:
        """Build this rank's 1-D shard (``shard_numel``, CPU) from full-shaped tensors keyed by primary
        name; tensors not given keep ``base``'s values (zeros without ``base``), padding is zero."""
        out = torch.zeros(self.shard_numel, dtype=dtype) if base is None else base.to("cpu", dtype, copy=True)
        for t, a, b, off in self.layout.shard_pieces(self.index, self.rank):
            full = tensors.get(t.name)
            if full is not None:
                out[off : off + b - a] = full.detach().reshape(-1)[a:b].to("cpu", dtype)
        return out

    # ------------------------------------------------------------------ memory
    def bytes_by_kind(self) -> list[tuple[torch.device, str, int]]:
        """``(device, kind, bytes)`` of everything this chunk holds now, on the device each tensor is on;
        pinned host tensors at their size (:func:`held_bytes`), device→host
        gradient copies in flight (their device shard and pinned staging buffer) included."""
        out = []
        shared = self.shard is not None and self.master is not None and self.shard.data_ptr() == self.master.data_ptr()
        if self.shard is not None:
            out.append((self.shard.device, "parameters", held_bytes(self.shard)))
        if self.resident and self.casts_frozen:  # keep-gathered frozen in another dtype: its compute copy
            out.append((self.buffer.device, "parameters", self.size * self.buffer.element_size()))
        if self.master is not None and not shared:
            out.append((self.master.device, "fp32_master", held_bytes(self.master.detach())))
        if (self._gathered or self._gather is not None) and not self.resident:
            out.append((self.buffer.device, "gathered_buffers", self.size * self.buffer.element_size()))
        if self.grad_buffer is not None:
            out.append((self.grad_buffer.device, "gradients", self.grad_buffer.numel() * self.grad_buffer.element_size()))
        for _, t in self._reduces:
            out.append((t.device, "gradients", t.numel() * t.element_size()))
        for staging, _, t in self._to_host:
            out.append((t.device, "gradients", t.numel() * t.element_size()))
            out.append((staging.device, "gradients", held_bytes(staging)))
        if self.master is not None and self.master.grad is not None:
            out.append((self.master.grad.device, "gradients", held_bytes(self.master.grad)))
        return out

    def frozen_bytes_by_dtype(self) -> list[tuple[torch.device, str, int]]:
        """``(device, dtype name, bytes)`` of a frozen chunk's persistent tensors (its storage-dtype
        shard, and the compute-dtype copy a keep-gathered chunk stored in another dtype keeps); ``[]``
        for a trainable chunk. These bytes are part of :meth:`bytes_by_kind`'s ``parameters``."""
        if self.requires_grad:
            return []
        out = [(self.shard.device, str(self.shard.dtype).removeprefix("torch."), self.shard.numel() * self.shard.element_size())]
        if self.resident and self.casts_frozen:
            out.append((self.buffer.device, str(self.dtype).removeprefix("torch."), self.size * self.buffer.element_size()))
        return out
