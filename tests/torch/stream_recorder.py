"""A recording stand-in for the engine's stream layer (:mod:`torch_backend.zero.collectives`), so the
CUDA stream discipline runs and is checked on CPU.

:class:`StreamRecorder` has the methods of :class:`~torch_backend.zero.collectives.CudaStreams`; set
with ``collectives.set_stream_layer``, it makes the engine believe the CPU is a device with a compute
and a communication stream (``uses_streams`` is true), so the engine takes its CUDA paths — collectives
issued on the communication stream, optimizer-offloaded gradients copied to the host there — with the
same functions that run on CUDA. The kernels themselves run at once on CPU; the recorder only keeps the
order CUDA would guarantee, with one vector clock per stream (and one for the host):

- every aten op (seen by a ``TorchDispatchMode``) is queued on the current stream, after what the host
  has waited for; each storage it touches records that access (a write when the op's schema says so,
  every tensor of a collective counted as written);
- ``wait_stream`` / ``wait_event`` / ``wait_work`` (a collective's wait: the current stream waits for
  the stream it was issued on — as of the wait, which may also cover work queued there after the
  collective: a slight over-approximation) merge clocks; ``synchronize`` merges into the host's;
- a storage is allocated on the stream current at its first access (storages older than the recording
  count as compute-stream ones), and freed when its last reference goes (a weak reference on the
  storage); ``record_stream`` marks the streams its free waits for. Pinned host memory (the layer's
  ``host_empty``, and the pinned arena's slices cut from such memory) is freed safely whatever the
  order: torch's host allocator reuses a block, and the arena a slice, only after the streams that
  used it are done.

The check, per storage: an access conflicting with an earlier access on another stream (one of them a
write) must come after its stream waited for that one; and when it is freed, its allocation stream,
the host or a ``record_stream``'d stream must have waited for every access on another stream (else the
caching allocator could hand its memory to the next allocation on the allocation stream while that
access still runs). Each violation is recorded with the storage's history (allocate, uses per stream,
waits, free).

Not modelled: the release of a gathered buffer by resizing its storage to zero (the same storage lives
on; its gathers are all waited for on the compute stream before a release), and host code that reads
host memory outside a stream (the recorder treats host ops as compute-stream ops).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class FakeStream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return self.name


class FakeEvent:
    def __init__(self, stream: FakeStream, clock: dict):
        self.stream, self.clock = stream, dict(clock)


@dataclass
class Buffer:
    """What the recorder knows of one storage."""

    label: str
    alloc: FakeStream
    nbytes: int
    last_write: dict = field(default_factory=dict)  # stream -> clock tick of its last write
    last_read: dict = field(default_factory=dict)
    recorded: set = field(default_factory=set)  # record_stream'd streams
    host: bool = False  # pinned host memory (the stream layer's host_empty)
    history: list = field(default_factory=list)

    def other_streams(self) -> set:
        return (set(self.last_write) | set(self.last_read)) - {self.alloc}


def _merge(into: dict, other: dict) -> None:
    for s, t in other.items():
        if into.get(s, 0) < t:
            into[s] = t


class StreamRecorder(TorchDispatchMode):
    """The stand-in stream layer and its recorder (module docstring). Use as a context manager around
    the engine's work, after ``collectives.set_stream_layer(recorder)``."""

    def __init__(self):
        super().__init__()
        self.compute = FakeStream("compute")
        self.comm = FakeStream("communication")
        self.host = FakeStream("host")
        self.clock = {s: {s: 0} for s in (self.compute, self.comm, self.host)}
        self._stack = [self.compute]
        self.buffers: dict[int, Buffer] = {}
        self.violations: list[str] = []
        self.freed_cross_stream = 0
        """Storages used on a stream other than their allocation stream and then freed (checked)."""
        self.host_ranges: list[tuple[int, int]] = []
        """``(start, end)`` addresses of the pinned host memory handed out by :meth:`host_empty`."""
        self.comm_uses = 0
        """Tensor accesses of ops queued on the communication stream."""
        self._count = 0

    # ------------------------------------------------------------------ the stream layer's methods
    def active(self, device) -> bool:  # noqa: ARG002 - the stream layer's interface
        return True

    def current(self, device):  # noqa: ARG002 - the stream layer's interface
        return self._stack[-1]

    def communication(self, device):  # noqa: ARG002 - the stream layer's interface
        return self.comm

    @contextlib.contextmanager
    def enter(self, stream):
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def wait_stream(self, consumer, producer) -> None:
        _merge(self.clock[consumer], self.clock[producer])

    def record_event(self, stream):
        return FakeEvent(stream, self.clock[stream])

    def wait_event(self, consumer, event) -> None:
        _merge(self.clock[consumer], event.clock)

    def synchronize(self, event) -> None:
        _merge(self.clock[self.host], event.clock)

    def record_stream(self, tensor, stream) -> None:
        buf = self._buffer(tensor, self._stack[-1])
        if buf is not None:
            buf.recorded.add(stream)
            buf.history.append(f"record_stream({stream})")

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)  # recorded as allocated on the current stream
        buf = self._buffer(t, self._stack[-1])
        buf.host = True
        buf.history.append("(pinned host memory)")
        self.host_ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        return t

    def wait_work(self, work, issued_on) -> None:
        work.wait()  # gloo: the host waits; CUDA makes the current stream wait for the collective
        _merge(self.clock[self._stack[-1]], self.clock[issued_on])

    # ------------------------------------------------------------------ recording
    def _buffer(self, t: torch.Tensor, stream: FakeStream) -> Buffer | None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        key = storage._cdata
        buf = self.buffers.get(key)
        if buf is None:
            self._count += 1
            buf = Buffer(f"#{self._count} {tuple(t.shape)} {t.dtype}", stream, storage.nbytes())
            buf.history.append(f"allocate on {stream}")
            ptr = storage.data_ptr()
            if storage.nbytes() and any(a <= ptr < b for a, b in self.host_ranges):
                buf.host = True  # a slice of a pinned slab: the arena waits for the streams before reuse
                buf.history.append("(pinned arena slice)")
            self.buffers[key] = buf
            weakref.finalize(storage, self._freed, key)
        return buf

    def _access(self, t: torch.Tensor, stream: FakeStream, tick: int, write: bool, op: str) -> None:
        buf = self._buffer(t, stream)
        if buf is None:
            return
        seen = self.clock[stream]
        for other, when in buf.last_write.items():
            if other is not stream and seen.get(other, 0) < when:
                self._violation(buf, f"{op} on {stream} not ordered after the write on {other}")
        if write:
            for other, when in buf.last_read.items():
                if other is not stream and seen.get(other, 0) < when:
                    self._violation(buf, f"{op} on {stream} writes while {other} may still read it")
        (buf.last_write if write else buf.last_read)[stream] = tick
        self.comm_uses += stream is self.comm
        if stream is not buf.alloc and len(buf.history) < 40:
            buf.history.append(f"{'write' if write else 'read'} by {op} on {stream}")

    def _freed(self, key: int) -> None:
        buf = self.buffers.pop(key, None)
        if buf is None:
            return
        others = buf.other_streams()
        if not others or buf.host:  # the host allocator waits for the streams that copied it
            return
        self.freed_cross_stream += 1
        known = dict(self.clock[buf.alloc])
        _merge(known, self.clock[self.host])
        for s in buf.recorded:
            _merge(known, self.clock[s])
        for other in others:
            when = max(buf.last_write.get(other, 0), buf.last_read.get(other, 0))
            if known.get(other, 0) < when:
                self._violation(buf, f"freed (memory back to {buf.alloc}'s pool) before {buf.alloc} waited for its "
                                     f"use on {other}, without record_stream")

    def _violation(self, buf: Buffer, what: str) -> None:
        if len(self.violations) < 20:
            self.violations.append(f"buffer {buf.label} ({buf.nbytes} bytes): {what}; history: "
                                   + " -> ".join(buf.history))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stream = self._stack[-1]
        _merge(self.clock[stream], self.clock[self.host])  # queued after what the host waited for
        self.clock[stream][stream] = tick = self.clock[stream].get(stream, 0) + 1
        out = func(*args, **kwargs)
        collective = func.namespace == "c10d"
        written = set()
        for a in func._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                written.add(a.name)
        op = str(func.overloadpacket.__name__)
        for i, a in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    self._access(t, stream, tick, collective or a.name in written, op)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._access(t, stream, tick, True, op)
        return out

    def check(self) -> list[str]:
        """Collect the storages dropped so far (their frees are checked) and return the violations."""
        gc.collect()
        return list(self.violations)
