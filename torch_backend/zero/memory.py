"""What a rank holds, by device and kind: :class:`MemoryReport` (``ZeroDDP.memory_report``), and
:class:`AllocationTracker`, the ledger every allocation site of the engine writes to, from which the
report's current and peak allocated bytes come.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from . import chunk_io

__all__ = ["ALLOCATION_KINDS", "MEMORY_KINDS", "AllocationTracker", "MemoryReport"]

MEMORY_KINDS = ("parameters", "gathered_buffers", "gradients", "fp32_master", "optimizer_states", "ema")

ALLOCATION_KINDS = ("parameters", "fp32_master", "gathered_buffers", "gradient_buffers", "autograd_grads",
                    "reduce_inputs", "reduce_outputs", "exchange_buffers", "staging", "fp32_gradients")
"""The kinds :class:`AllocationTracker` counts: ``parameters`` (persistent parameter shards, resident
chunks whole), ``fp32_master`` (master shards not shared with the parameter shard), ``gathered_buffers``
(sharded chunks gathered or being gathered), ``gradient_buffers`` (a chunk's full gradient while it is
accumulated, also a gradient tensor a one-tensor chunk adopts), ``autograd_grads`` (a ``.grad`` that
autograd hands to the gradient hook, while it is copied into its chunk's buffer), ``reduce_inputs``
(gradient buffers handed to a reduction in flight), ``reduce_outputs`` (a reduction's output shard until
it becomes the fp32 gradient), ``exchange_buffers`` (the receive buffer of gloo's all-to-all
reduce-scatter), ``staging`` (host staging of offloaded gradients, device copies of offloaded or cast
shards for a gather, the full chunk assembled at construction and by checkpoint gathers),
``fp32_gradients`` (the reduced fp32 gradient shards, ``master.grad``)."""


_DEVICE_NAMES: dict = {}


def _device_name(device) -> str:
    """``str(device)``, made once per device (``str`` of a ``torch.device`` formats it each call)."""
    if type(device) is str:
        return device
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


class AllocationTracker:
    """Bytes allocated by the engine, now and at their peak, per device and kind.

    Each allocation site calls :meth:`track` (a tensor, freed when the tensor object is collected: a
    ``weakref.finalize``) or :meth:`add` / :meth:`free` (storage resized in place, or a tensor whose
    Python object is not kept, e.g. ``param.data = ...``). One dict update per buffer event; nothing per
    torch op. Devices are ``str(tensor.device)`` (``"cpu"``, ``"cuda:0"``).
    """

    def __init__(self):
        self._entries: dict[int, tuple[str, str, int]] = {}
        self._by_tensor: dict[int, int] = {}
        self._next = 0
        self.current: dict[str, dict[str, int]] = {}
        """``{device: {kind: bytes}}`` allocated now."""
        self.peak: dict[str, dict[str, int]] = {}
        """``{device: {kind: bytes}}``: each kind's own peak since :meth:`reset_peak`."""
        self.peak_total: dict[str, int] = {}
        """``{device: bytes}``: the peak of all kinds together on the device since :meth:`reset_peak`."""
        self._total: dict[str, int] = {}

    def add(self, kind: str, device, nbytes: int) -> int:
        """Count ``nbytes`` of ``kind`` on ``device`` as allocated; returns the key :meth:`free` takes."""
        dev = _device_name(device)
        self._next += 1
        key = self._next
        self._entries[key] = (dev, kind, int(nbytes))
        self._change(dev, kind, int(nbytes))
        return key

    def free(self, key: int | None) -> None:
        """Count the allocation ``key`` as freed (``None`` or a key already freed: nothing)."""
        entry = self._entries.pop(key, None) if key is not None else None
        if entry is not None:
            self._change(entry[0], entry[1], -entry[2])

    def track(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """Count ``tensor``'s bytes (``numel × element_size`` on its device) as ``kind`` until the tensor
        object is collected; a tensor already tracked changes kind (a gradient buffer handed to its
        reduction). Returns ``tensor``."""
        key = self._by_tensor.get(id(tensor))
        if key is not None and key in self._entries:
            dev, old, n = self._entries[key]
            if old != kind:
                self._entries[key] = (dev, kind, n)
                self._change(dev, old, -n)
                self._change(dev, kind, n)
            return tensor
        key = self.add(kind, tensor.device, tensor.numel() * tensor.element_size())
        self._by_tensor[id(tensor)] = key
        weakref.finalize(tensor, self._collected, id(tensor), key)
        return tensor

    def transient(self, kind: str, device, nbytes: int) -> None:
        """Count ``nbytes`` of ``kind`` on ``device`` as allocated for a moment (a tensor handed over and
        dropped at once): the peaks see it, the current bytes do not. One call, no ledger entry."""
        dev, n = _device_name(device), int(nbytes)
        peak = self.peak.setdefault(dev, {})
        now = self.current.get(dev, {}).get(kind, 0) + n
        if now > peak.get(kind, 0):
            peak[kind] = now
        total = self._total.get(dev, 0) + n
        if total > self.peak_total.get(dev, 0):
            self.peak_total[dev] = total

    def _collected(self, tensor_id: int, key: int) -> None:
        if self._by_tensor.get(tensor_id) == key:
            del self._by_tensor[tensor_id]
        self.free(key)

    def _change(self, dev: str, kind: str, n: int) -> None:
        per = self.current.setdefault(dev, {})
        now = per[kind] = per.get(kind, 0) + n
        total = self._total[dev] = self._total.get(dev, 0) + n
        if n > 0:
            peak = self.peak.setdefault(dev, {})
            if now > peak.get(kind, 0):
                peak[kind] = now
            if total > self.peak_total.get(dev, 0):
                self.peak_total[dev] = total

    def total(self, device=None) -> int:
        """Bytes allocated now on ``device`` (all devices when ``None``)."""
        return sum(b for d, b in self._total.items() if device is None or d == str(device))

    def reset_peak(self) -> None:
        """Start the peaks again from what is allocated now."""
        self.peak = {d: {k: b for k, b in per.items() if b} for d, per in self.current.items()}
        self.peak_total = dict(self._total)


@dataclass
class MemoryReport:
    """Bytes this rank holds, per device and kind, plus the placement decisions.

    Attributes:
        bytes: ``{device: {kind: bytes}}``, each tensor counted on the device it is on now, with kinds
            ``parameters`` (persistent parameter shards: compute dtype for trainable chunks — the fp32
            master itself in fp32 —, the storage dtype for frozen chunks, see
            :attr:`frozen_parameters`; keep-gathered chunks whole), ``gathered_buffers`` (sharded chunks gathered or
            being gathered now), ``gradients`` (chunk gradient buffers, reductions in flight and fp32
            gradient shards), ``fp32_master`` (master shards held apart from the parameter shard: 0
            in fp32, where they coincide; none for frozen chunks), ``optimizer_states`` (the
            ZeroOptimizer's state shards, when it is passed), ``ema`` (the shards of the optimizer's
            :class:`~torch_backend.zero.ema.ZeroEMA`, when it has one: 4 bytes per trainable
            element of this rank's shards, on the master's device).
        offload_optim_chunks: chunk indices whose master, gradient and optimizer state are on the host.
        offload_param_chunks: chunk indices whose parameter shard is on the host.
        peak_gathered_chunks: the most sharded chunks gathered at once so far.
        frozen_parameters: ``{device: {dtype name: bytes}}`` — the part of ``parameters`` that frozen
            chunks hold, by dtype: each frozen shard in the dtype its tensors came in (a bf16 frozen
            tensor costs 2 bytes per element of this rank's shard whatever the compute dtype), plus
            the compute-dtype copy a keep-gathered frozen chunk stored in another dtype keeps.
        allocated: ``{device: {kind: bytes}}`` — what the engine's own allocations hold now, by the
            finer :data:`ALLOCATION_KINDS` (from :class:`AllocationTracker`; the optimizer's state is
            torch's allocation, in :attr:`bytes` only).
        peak_allocated: ``{device: {kind: bytes}}`` — each kind's peak since construction or
            ``ZeroDDP.reset_peak_memory()``.
        peak_allocated_total: ``{device: bytes}`` — the peak of all the engine's allocations together.
        pinned_held_bytes: bytes of pinned host memory the process's pinned arena holds for this
            compute device (:mod:`torch_backend.zero.pinned`: the slabs themselves, what is locked);
            0 where the device has no streams (CPU: nothing is pinned).
        pinned_used_bytes: the part of ``pinned_held_bytes`` its live slices use (the pinned tensors
            counted in :attr:`bytes`, each rounded up to the arena's 512-byte alignment).
    """

    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    offload_optim_chunks: tuple[int, ...] = ()
    offload_param_chunks: tuple[int, ...] = ()
    peak_gathered_chunks: int = 0
    frozen_parameters: dict[str, dict[str, int]] = field(default_factory=dict)
    allocated: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_allocated: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_allocated_total: dict[str, int] = field(default_factory=dict)
    pinned_held_bytes: int = 0
    pinned_used_bytes: int = 0

    @classmethod
    def collect(cls, chunks, device, optimizer=None, tracker: AllocationTracker | None = None,
                **decisions) -> MemoryReport:
        """The report of what ``chunks`` (:class:`~torch_backend.zero.chunks.Chunk`) and ``optimizer``'s
        state shards hold now; ``device``: the compute device (always listed); ``tracker``: the
        engine's :class:`AllocationTracker` (the ``allocated`` fields); ``decisions``: the
        placement fields (``offload_optim_chunks``, ``offload_param_chunks``, ``peak_gathered_chunks``)
        and the pinned arena's (``pinned_held_bytes``, ``pinned_used_bytes``)."""
        report: dict[str, dict[str, int]] = {}

        def add(where, kind, n):
            per = report.setdefault(str(where), {k: 0 for k in MEMORY_KINDS})
            per[kind] += int(n)

        add(device, "parameters", 0)
        frozen: dict[str, dict[str, int]] = {}
        for c in chunks:
            for where, kind, n in chunk_io.bytes_by_kind(c):
                add(where, kind, n)
            for where, dtype, n in chunk_io.frozen_bytes_by_dtype(c):
                per = frozen.setdefault(str(where), {})
                per[dtype] = per.get(dtype, 0) + int(n)
        if optimizer is not None:
            for where, n in optimizer.state_bytes():
                add(where, "optimizer_states", n)
            ema = getattr(optimizer, "ema", None)
            for where, n in ([] if ema is None else ema.state_bytes()):
                add(where, "ema", n)
        if tracker is not None:
            decisions.update(allocated={d: {k: b for k, b in per.items() if b} for d, per in tracker.current.items()},
                             peak_allocated={d: dict(per) for d, per in tracker.peak.items()},
                             peak_allocated_total=dict(tracker.peak_total))
        return cls(report, frozen_parameters=frozen, **decisions)

    def allocated_total(self, kind: str | None = None, device: str | None = None, *, peak: bool = False) -> int:
        """Bytes the engine's allocations of ``kind`` (all kinds when ``None``) hold on ``device`` (all when
        ``None``) now, or with ``peak`` at their peak (for ``kind=None``, the peak of all kinds together,
        :attr:`peak_allocated_total`; otherwise the kind's own peak)."""
        if peak and kind is None:
            return sum(b for d, b in self.peak_allocated_total.items() if device is None or d == device)
        src = self.peak_allocated if peak else self.allocated
        return sum(b for d, per in src.items() if device is None or d == device
                   for k, b in per.items() if kind is None or k == kind)

    def total(self, kind: str | None = None, device: str | None = None) -> int:
        """Bytes of ``kind`` (all kinds when ``None``) on ``device`` (all devices when ``None``)."""
        return sum(b for dev, per in self.bytes.items() if device is None or dev == device
                   for k, b in per.items() if kind is None or k == kind)

    def frozen_total(self, dtype: str | None = None, device: str | None = None) -> int:
        """Bytes of frozen parameters in ``dtype`` (e.g. ``"bfloat16"``; all when ``None``) on ``device``."""
        return sum(b for dev, per in self.frozen_parameters.items() if device is None or dev == device
                   for d, b in per.items() if dtype is None or d == dtype)

    def model_state_bytes(self) -> int:
        """Parameters + gradients + fp32 master + optimizer states + EMA (gathered buffers excluded)."""
        return self.total() - self.total("gathered_buffers")

    def __str__(self) -> str:
        lines = ["| device | " + " | ".join(MEMORY_KINDS) + " |", "|---" * (len(MEMORY_KINDS) + 1) + "|"]
        for dev, per in self.bytes.items():
            lines.append(f"| {dev} | " + " | ".join(str(per.get(k, 0)) for k in MEMORY_KINDS) + " |")
        for dev, per in self.frozen_parameters.items():
            lines.append(f"frozen parameters on {dev}: " + ", ".join(f"{d} {b}" for d, b in sorted(per.items())))
        lines.append(f"offloaded optimizer chunks: {list(self.offload_optim_chunks)}; parameter chunks: "
                     f"{list(self.offload_param_chunks)}; peak gathered chunks: {self.peak_gathered_chunks}")
        if self.pinned_held_bytes:
            lines.append(f"pinned host memory: {self.pinned_held_bytes} bytes held, {self.pinned_used_bytes} used")
        for dev, per in self.peak_allocated.items():
            lines.append(f"peak allocated on {dev}: {self.peak_allocated_total.get(dev, 0)} bytes in all; by kind: "
                         + ", ".join(f"{k} {b}" for k, b in per.items() if b))
        return "\n".join(lines)
