"""Chunk storage for the torch backend: one :class:`Chunk` per chunk of the core ``ChunkLayout``.

A chunk owns, on this rank (the design of ColossalAI Gemini's ``Chunk``, itself from PatrickStar):

- ``shard`` — this rank's slice ``[r·size/W, (r+1)·size/W)`` of the chunk in the compute dtype
  (the *low-precision shard* in bf16/fp16; in fp32 it is the master shard itself). A keep-gathered
  chunk's "shard" is the whole chunk and doubles as its gathered buffer. In bf16/fp16, when the
  master sits on the compute device, no persistent low-precision copy is kept (``shard is None``):
  the gather casts the master shard on the fly (as FSDP2's mixed precision does), which saves
  2 bytes per element of model state; :meth:`Chunk.low_precision_shard` then returns a fresh cast.
- ``master`` — the fp32 master shard, an ``nn.Parameter`` leaf the inner torch optimizer updates
  (its ``.grad`` is the reduced, averaged gradient shard, fp32).
- ``buffer`` — the full chunk in the compute dtype; the module's parameters are views into it for
  the chunk's lifetime. Released, its storage is resized to zero bytes (the parameters keep their
  shapes but hold no data); gathered, it is resized back and filled by an all-gather.
- ``grad_buffer`` — the full-chunk gradient (compute dtype) accumulated in backward until reduced.
- ``states`` — the core :class:`chunkzero.ChunkStates` of its tensors.

All sizes are in elements; ``*_bytes`` are bytes.
"""

from __future__ import annotations

import torch

from chunkzero import ChunkLayout, ChunkStates, TensorPlacement, TensorState

from . import collectives

S = TensorState

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Chunk:
    """One chunk's storage and state on this rank.

    Args:
        layout: the model's layout; ``index`` selects the chunk.
        rank: this rank in the process group.
        params: the module's parameter object for each tensor name of the chunk (primary names).
        device: compute device (where gathered buffers and gradients live).
        param_device: device of the persistent low-precision shard (``cpu`` when parameter-offloaded).
        master_device: device of the fp32 master shard, its gradient and optimizer state
            (``cpu`` when optimizer-offloaded).
        group: process group or ``None`` (single process).
        divide_first: divide gradients by the world size before reducing (fp16).
        initial: the full chunk's initial values (fp32, 1-D, ``size`` elements) — already identical
            on every rank.
    """

    def __init__(
        self,
        layout: ChunkLayout,
        index: int,
        rank: int,
        params: dict[str, torch.nn.Parameter],
        *,
        device: torch.device,
        param_device: torch.device,
        master_device: torch.device,
        group,
        divide_first: bool,
        initial: torch.Tensor,
    ):
        info = layout.chunks[index]
        self.index = index
        self.info = info
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self.group = group
        self.dtype = TORCH_DTYPES[info.dtype]
        self.device = torch.device(device)
        self.param_device = torch.device(param_device)
        self.master_device = torch.device(master_device)
        self.divide_first = divide_first
        self.size = info.size
        self.shard_numel = layout.shard_numel(index)
        self.shard_start, self.shard_stop = layout.shard_range(index, rank)
        self.valid_numel = layout.valid_length(index, rank)
        self.keep_gathered = info.keep_gathered
        self.requires_grad = info.requires_grad
        self.placements: tuple[TensorPlacement, ...] = layout.chunk_tensors(index)
        self.params = params
        self.resident = self.keep_gathered or self.world_size == 1
        """Never released: keep-gathered, or a single rank (the shard is the whole chunk)."""
        self.states = ChunkStates(info.tensor_names, initial=S.HOLD if self.resident else S.FREE)

        master = initial[self.shard_start : self.shard_stop].to(self.master_device, torch.float32, copy=True)
        self.master = torch.nn.Parameter(master, requires_grad=self.requires_grad)
        self.shard: torch.Tensor | None
        shard_device = self.device if self.resident else self.param_device
        if self.dtype == torch.float32 and self.master_device == shard_device:
            self.shard = self.master.data  # fp32: the master shard is the parameter shard
        elif self.resident or self.param_device != self.master_device:
            self.shard = master.to(shard_device, self.dtype, copy=True)
        else:
            self.shard = None  # cast from the master at gather time
        self.grad_buffer: torch.Tensor | None = None
        self._grad_written: set[str] = set()
        self.grad_sq_norm: torch.Tensor | None = None
        """fp32 0-d: squared L2 norm of the accumulated gradient shard over valid elements (set at reduce)."""

        # The gathered buffer: one tensor for the chunk's lifetime whose storage is resized to zero
        # on release and back on gather (FSDP2's trick), so the parameters stay views of it with
        # their full shapes, and views autograd saved in forward see the re-gathered data.
        if self.resident:
            self.buffer = self.shard
            self._gathered = True
        else:
            self.buffer = torch.empty(self.size, dtype=self.dtype, device=self.device)
            self._gathered = False
        self.storage_key = self.buffer.untyped_storage()._cdata
        """Identity of the gathered buffer's storage (views of it found by the backward's pack hook)."""
        for t in self.placements:
            params[t.name].data = self.buffer[t.offset : t.end].view(t.shape)
        if not self.resident:
            self.buffer.untyped_storage().resize_(0)

    @property
    def is_gathered(self) -> bool:
        """Whether the full chunk is present (always for resident chunks)."""
        return self._gathered

    @property
    def gathered(self) -> torch.Tensor | None:
        """The full chunk (``size`` elements, compute dtype) while gathered, else ``None``."""
        return self.buffer if self._gathered else None

    def gather(self) -> bool:
        """All-gather the chunk into its buffer (the parameters' storage). Tensors move FREE → HOLD.

        Returns ``True`` if a gather happened (``False``: already gathered).
        """
        if self._gathered:
            return False
        if self.shard is None:
            src = self.master.detach().to(self.device, self.dtype)
        else:
            src = self.shard if self.shard.device == self.device else self.shard.to(self.device, non_blocking=True)
        self.buffer.untyped_storage().resize_(self.size * self.buffer.element_size())
        collectives.all_gather_flat(self.buffer, src, self.group)
        self._gathered = True
        self.states.transition_all(S.HOLD, only_from=S.FREE)
        return True

    def release(self) -> bool:
        """Free the gathered buffer's storage (sharded chunks only); tensors HOLD → FREE.

        Raises:
            IllegalTransitionError: a tensor is still in use (COMPUTE, HOLD_AFTER_BWD, READY_FOR_REDUCE).
        """
        if self.resident or not self._gathered:
            return False
        self.states.transition_all(S.FREE)
        self.buffer.untyped_storage().resize_(0)
        self._gathered = False
        return True

    def refresh_from_master(self) -> None:
        """Copy the fp32 master shard into the low-precision shard (and the gathered buffer)."""
        if self.shard is not None and self.shard.data_ptr() != self.master.data_ptr():
            self.shard.copy_(self.master.detach())
        if not self.resident and self._gathered:
            self.release()  # the gathered copy is stale; the next use gathers the new values

    # ------------------------------------------------------------------ gradients
    def _grad_buffer(self) -> torch.Tensor:
        if self.grad_buffer is None:
            self.grad_buffer = torch.empty(self.size, dtype=self.dtype, device=self.device)
            self._grad_written.clear()
        return self.grad_buffer

    def add_grad(self, name: str, placement: TensorPlacement, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` (full shape of the tensor) into the chunk's gradient buffer."""
        buf = self._grad_buffer()[placement.offset : placement.end]
        g = grad.reshape(-1)
        if name in self._grad_written:
            buf.add_(g)
        else:
            buf.copy_(g)
            self._grad_written.add(name)

    def reduce(self) -> None:
        """Average the gradient buffer over ranks into this rank's fp32 master gradient shard.

        Sharded chunks are reduce-scattered, keep-gathered chunks all-reduced. Regions of tensors
        that received no gradient, and the padding, are zeroed first. The reduced shard is added
        to ``master.grad`` (fp32, master device) and :attr:`grad_sq_norm` is recomputed over the
        valid elements.
        """
        buf = self.grad_buffer
        if buf is None:
            buf = self._grad_buffer()
        for t in self.placements:
            if t.name not in self._grad_written:
                buf[t.offset : t.end].zero_()
        if self.info.padding:
            buf[self.info.utilized :].zero_()
        if self.keep_gathered:
            collectives.all_reduce_avg(buf, self.group, divide_first=self.divide_first)
            out = buf
        elif self.world_size == 1:
            out = buf
        else:
            out = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
            collectives.reduce_scatter_avg(out, buf, self.group, divide_first=self.divide_first)
        self.grad_buffer = None
        self._grad_written.clear()
        g = out.to(self.master_device, torch.float32)
        if self.master.grad is None:
            self.master.grad = g
        else:
            self.master.grad.add_(g)
        valid = self.master.grad[: self.valid_numel]
        self.grad_sq_norm = valid.float().square().sum()

    def discard_grad_buffer(self) -> None:
        self.grad_buffer = None
        self._grad_written.clear()

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (buffer and master gradient)."""
        self.discard_grad_buffer()
        self.master.grad = None
        self.grad_sq_norm = None

    # ------------------------------------------------------------------ state I/O
    def load_master(self, values: torch.Tensor) -> None:
        """Copy a 1-D fp32 shard of ``shard_numel`` elements into the master and refresh."""
        with torch.no_grad():
            self.master.copy_(values.to(self.master_device, torch.float32))
        if self.shard is not None and self.shard.data_ptr() != self.master.data_ptr():
            self.shard.copy_(self.master.detach())
        if not self.resident and self._gathered:
            self.release()

    def low_precision_shard(self) -> torch.Tensor:
        """The compute-dtype shard: the live persistent tensor, or a fresh cast of the master when
        none is kept (bf16/fp16 without offload)."""
        if self.shard is None:
            return self.master.detach().to(self.device, self.dtype)
        return self.shard

    def gather_master(self) -> torch.Tensor:
        """The full fp32 chunk (``size`` elements) on the master device, assembled from every rank's master."""
        return self.gather_shard_tensor(self.master.detach())

    def gather_shard_tensor(self, shard: torch.Tensor) -> torch.Tensor:
        """All-gather a 1-D per-rank tensor of ``shard_numel`` elements (e.g. an optimizer state)."""
        if self.keep_gathered or self.world_size == 1:
            return shard
        comm_device = self.device
        src = shard.to(comm_device)
        out = torch.empty(self.size, dtype=shard.dtype, device=comm_device)
        collectives.all_gather_flat(out, src, self.group)
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
        """``(device, kind, bytes)`` of everything this chunk holds now."""
        out = []
        shared = self.shard is not None and self.shard.data_ptr() == self.master.data_ptr()
        if self.shard is not None:
            out.append((self.shard.device, "parameters", self.shard.numel() * self.shard.element_size()))
        if not shared:
            out.append((self.master.device, "fp32_master", self.master.numel() * 4))
        if self._gathered and not self.resident:
            out.append((self.buffer.device, "gathered_buffers", self.size * self.buffer.element_size()))
        if self.grad_buffer is not None:
            out.append((self.grad_buffer.device, "gradients", self.grad_buffer.numel() * self.grad_buffer.element_size()))
        if self.master.grad is not None:
            out.append((self.master.grad.device, "gradients", self.master.grad.numel() * 4))
        return out
