"""Pinned host memory without the allocator's rounding: :class:`PinnedArena`, which cuts the engine's
pinned host buffers (offloaded fp32 master shards, offloaded parameter shards, the staging of
offloaded gradients) out of a few large slabs.

Torch's caching host allocator rounds every pinned request up to a power of two, so a chunk shard of
``1.05 × 2^k`` bytes holds ``2^k+1``: up to twice what the tensor needs. The arena asks for few, large
slabs instead and hands out aligned slices of them:

- a request larger than ``slab_bytes / 32`` (2 MiB) gets a slab of its own, of exactly its size;
  smaller requests share ``slab_bytes`` slabs (64 MiB), first fit, so a shared slab's unused tail is
  under 1/32 of it. What the arena holds beyond what its slices use is then at most one partly filled
  shared slab plus 1/32, and nothing is rounded up to a power of two. On CUDA a slab is pageable memory registered with
  ``cudaHostRegister`` (what torch's allocator does with ``pinned_use_cuda_host_register``): no
  rounding. Where registration is not at hand, a slab is one block of torch's caching host allocator,
  sized to that allocator's power-of-two blocks (so what is held is still what is counted).
- Each slice is a tensor with a storage of its own (``torch.frombuffer`` over the slab's memory), so
  its life is that of any tensor: when its last view goes, its range is free again. The range is
  reused only after the streams that may have used it are done: an event is recorded on the compute
  and communication streams at the free, and the host waits for it before the range is handed out
  again.
- Slabs are kept for reuse (as torch's caching allocator keeps its blocks) until :meth:`PinnedArena.trim`.

:attr:`PinnedArena.held_bytes` is what the slabs hold, :attr:`PinnedArena.used_bytes` what live slices
use; ``ZeroDDP.memory_report()`` gives both (``pinned_held_bytes``, ``pinned_used_bytes``).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch

from . import streams

__all__ = ["ALIGNMENT_BYTES", "PinnedArena", "SLAB_BYTES", "arena_bytes", "copied", "host_arena", "host_empty",
           "pinned_block_bytes", "pinned_slab"]

ALIGNMENT_BYTES = 512
"""Every slice starts at a multiple of this many bytes of its slab (DMA- and vector-friendly)."""

SLAB_BYTES = 64 * 2**20
"""The size of a shared slab; requests over 1/32 of it get an exact slab of their own."""

OWN_SLAB_FRACTION = 32
"""A request over ``slab_bytes / OWN_SLAB_FRACTION`` gets a slab of its own."""


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


class _Slab:
    __slots__ = ("free", "held", "memory", "nbytes", "own", "ptr", "request", "used")

    def __init__(self, memory: torch.Tensor, held: int):
        self.memory = memory  # keeps the slab's memory alive (and registered)
        self.ptr = memory.data_ptr()
        self.nbytes = memory.numel()
        self.held = int(held)
        self.own = False
        self.request = self.nbytes  # an own slab: the request it was made for (its block may be larger)
        self.free: list[list] = [[0, self.nbytes, []]]  # [offset, nbytes, events to wait for], by offset
        self.used = 0


class PinnedArena:
    """Host buffers as aligned slices of a few large slabs (module docstring).

    Args:
        allocate_slab: ``nbytes -> (uint8 tensor, held bytes)``: a slab of at least ``nbytes`` bytes
            (default: :func:`pinned_slab`, pinned; tests pass pageable memory).
        slab_bytes: the size of a shared slab (:data:`SLAB_BYTES`).
        events: ``() -> list`` of events recorded on the streams that may use the buffers, taken when
            a slice is freed; ``wait``: ``event -> None``, the host waits for one before its range is
            reused. Default: none (no streams).
    """

    def __init__(self, allocate_slab: Callable[[int], tuple[torch.Tensor, int]] | None = None, *,
                 slab_bytes: int = SLAB_BYTES, events: Callable[[], list] | None = None,
                 wait: Callable[[object], None] | None = None):
        if slab_bytes <= 0 or slab_bytes % ALIGNMENT_BYTES:
            raise ValueError(f"slab_bytes must be a positive multiple of {ALIGNMENT_BYTES}, got {slab_bytes}")
        self._allocate = allocate_slab or pinned_slab
        self.slab_bytes = int(slab_bytes)
        self._events = events or (lambda: [])
        self._wait = wait or (lambda event: None)
        self._slabs: list[_Slab] = []
        self.held_bytes = 0
        """Bytes the slabs hold (what the host allocator or the registration really pinned)."""
        self.used_bytes = 0
        """Bytes of the live slices, each rounded up to :data:`ALIGNMENT_BYTES`."""

    @property
    def num_slabs(self) -> int:
        return len(self._slabs)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D tensor of ``numel`` elements of ``dtype``, a slice of a slab; its
        range is free again when the tensor (and every view of it) is gone.

        Raises:
            ValueError: ``numel`` is negative.
        """
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        nbytes = int(numel) * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        need = _aligned(nbytes)
        own = need > self.slab_bytes // OWN_SLAB_FRACTION
        slab, offset = self._find(need, own)
        if slab is None:
            slab = _Slab(*self._allocate(need if own else self.slab_bytes))
            slab.own = own
            slab.request = need if own else slab.nbytes
            self._slabs.append(slab)
            self.held_bytes += slab.held
            offset = self._take(slab, 0, need)
        slab.used += need
        self.used_bytes += need
        view = (ctypes.c_char * nbytes).from_address(slab.ptr + offset)
        view.slab = slab  # the storage below keeps ``view``, which keeps the slab
        weakref.finalize(view, self._release, slab, offset, need)
        return torch.frombuffer(view, dtype=dtype, count=int(numel))

    def _find(self, need: int, own: bool):
        for slab in self._slabs:
            if slab.own != own or (own and slab.request != need):  # own slabs are reused at their size only
                continue
            for i, (_offset, n, _) in enumerate(slab.free):
                if n >= need:
                    return slab, self._take(slab, i, need)
        return None, 0

    def _take(self, slab: _Slab, i: int, need: int) -> int:
        offset, n, events = slab.free[i]
        for event in events:  # the streams that used this range before are done with it
            self._wait(event)
        if n == need:
            del slab.free[i]
        else:
            slab.free[i] = [offset + need, n - need, []]
        return offset

    def _release(self, slab: _Slab, offset: int, nbytes: int) -> None:
        slab.used -= nbytes
        self.used_bytes -= nbytes
        events = [e for e in self._events() if e is not None]
        free = slab.free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, [offset, nbytes, events])
        # coalesce with the neighbours (their events are kept: all must be waited for)
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i][1] += free[i + 1][1]
            free[i][2] += free.pop(i + 1)[2]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1][1] += free[i][1]
            free[i - 1][2] += free.pop(i)[2]

    def slices(self) -> list[tuple[int, int, int]]:
        """``(slab index, offset, bytes)`` of each used range (the complement of the free ranges)."""
        out = []
        for k, slab in enumerate(self._slabs):
            at = 0
            for offset, n, _ in slab.free:
                if offset > at:
                    out.append((k, at, offset - at))
                at = offset + n
            if at < slab.nbytes:
                out.append((k, at, slab.nbytes - at))
        return out

    def trim(self) -> int:
        """Give back the slabs no live slice uses (after the streams that used them are done);
        returns the bytes given back."""
        kept, given = [], 0
        for slab in self._slabs:
            if slab.used:
                kept.append(slab)
                continue
            for _, _, events in slab.free:
                for event in events:
                    self._wait(event)
            given += slab.held
        self._slabs = kept
        self.held_bytes -= given
        return given


def pinned_slab(nbytes: int) -> tuple[torch.Tensor, int]:
    """A pinned host slab of ``nbytes`` (uint8, 1-D) and the bytes it holds: pageable memory registered
    with CUDA (exactly ``nbytes``, page-aligned) or, where registration fails, a block of torch's
    caching host allocator (rounded up to its power of two, the size returned then)."""
    page = 4096
    cudart = torch.cuda.cudart() if torch.cuda.is_available() else None
    register = getattr(cudart, "cudaHostRegister", None)
    if register is not None:
        raw = torch.empty(nbytes + page, dtype=torch.uint8)
        start = (-raw.data_ptr()) % page
        memory = raw[start : start + nbytes]
        memory.zero_()  # touch the pages before they are locked
        if int(register(memory.data_ptr(), nbytes, 0)) == 0:
            weakref.finalize(memory, _unregister, cudart, memory.data_ptr())  # the slab keeps ``memory``
            return memory, nbytes
    block = pinned_block_bytes(nbytes)
    return torch.empty(block, dtype=torch.uint8, pin_memory=True), block


def pinned_block_bytes(nbytes: int) -> int:
    """The bytes torch's caching host allocator holds for a pinned request of ``nbytes``: the block is
    rounded up to a power of two (up to twice the request; 0 stays 0).

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return 0 if nbytes == 0 else 1 << (int(nbytes) - 1).bit_length()


def _unregister(cudart, ptr: int) -> None:
    try:
        streams.host_wait()  # no copy may still read the slab
        cudart.cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver reclaims it with the process
        pass


_ARENAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stream layer -> {device: arena}


def host_arena(device: torch.device, layer) -> PinnedArena:
    """The process's arena for pinned host buffers of compute device ``device`` (one per device, as
    torch's host allocator is one per process), its slabs from ``layer`` (the stream layer in use,
    :func:`torch_backend.zero.collectives.stream_layer`): its ``host_empty`` for a stand-in, pinned
    slabs for CUDA. A freed slice waits for the device's compute and communication streams."""
    device = torch.device(device)
    per_layer = _ARENAS.setdefault(layer, {})
    arena = per_layer.get(str(device))
    if arena is None:
        ref = weakref.ref(layer)  # the arena must not keep its layer alive (the map's weak key)
        if isinstance(layer, streams.CudaStreams):
            allocate = pinned_slab
        else:
            def allocate(nbytes):
                return ref().host_empty(nbytes, torch.uint8), nbytes

        def events():
            lay = ref()
            return [] if lay is None else [lay.record_event(lay.current(device)),
                                           lay.record_event(lay.communication(device))]

        def wait(event):
            lay = ref()
            if lay is not None:
                lay.synchronize(event)

        arena = per_layer[str(device)] = PinnedArena(allocate, events=events, wait=wait)
    return arena


def arena_bytes(device: torch.device) -> dict[str, int]:
    """``{"pinned_held_bytes", "pinned_used_bytes"}`` of the arena of compute device ``device`` under
    the stream layer in use (zeros where the device has no streams, so nothing is pinned)."""
    if not streams.uses_streams(torch.device(device)):
        return {"pinned_held_bytes": 0, "pinned_used_bytes": 0}
    arena = host_arena(device, streams.stream_layer())
    return {"pinned_held_bytes": arena.held_bytes, "pinned_used_bytes": arena.used_bytes}


def host_empty(numel: int, dtype: torch.dtype, like_device: torch.device) -> torch.Tensor:
    """An empty 1-D host tensor, pinned when the compute device ``like_device`` has streams (CUDA; so
    copies can be async): a slice of the process's arena for that device (no power-of-two rounding
    per buffer), whose ranges are reused only after the device's streams are done with them."""
    if streams.uses_streams(like_device):
        return host_arena(torch.device(like_device), streams.stream_layer()).empty(numel, dtype)
    return torch.empty(numel, dtype=dtype)


def copied(t: torch.Tensor, device: torch.device, compute_device: torch.device, dtype: torch.dtype | None = None,
           *, non_blocking: bool = False) -> torch.Tensor:
    """A fresh 1-D copy of ``t`` on ``device``, in ``dtype`` (default: ``t``'s); host copies are pinned
    when computing on CUDA (:func:`host_empty`), so that ``non_blocking`` copies are asynchronous."""
    device, dtype = torch.device(device), dtype or t.dtype
    if device.type == "cpu":
        out = host_empty(t.numel(), dtype, compute_device)
    else:
        out = torch.empty(t.numel(), dtype=dtype, device=device)
    out.copy_(t.reshape(-1), non_blocking=non_blocking)
    return out
