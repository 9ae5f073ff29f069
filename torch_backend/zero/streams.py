"""The stream and event layer of the torch engine: every cross-stream hand-over goes through here.

**Streams.** Every cross-stream hand-over of the engine goes through this stream layer
(:class:`CudaStreams`, the one instance :func:`stream_layer`), never through ``torch.cuda`` directly:
:func:`uses_streams` (does this device have a separate communication stream), :func:`compute_stream`,
:func:`communication_stream` (a context on it, after it waited for the compute stream),
:func:`hand_over` (an event recorded on the producer, the consumer waits for it), :func:`free_after`
(``record_stream``: the caching allocator reuses a buffer only after that stream's work queued so
far), :func:`record_event` / :func:`synchronize_event` (the host waits). The rule for a buffer: it is
allocated on one stream; a use on another stream comes after that stream waited for the writes it
reads; and before its last reference goes, either its allocation stream (or the host) waited for every
other stream that used it, or :func:`free_after` was called for that stream. A collective's buffers
are allocated on the compute stream and kept alive by its :class:`Pending` until :meth:`Pending.wait`,
which makes the *current* stream wait for the work: waited for on the compute stream, nothing more is
needed; waited for on the communication stream (an optimizer-offloaded chunk's device→host gradient
copy), :meth:`Pending.free_after` that stream first. A recording stand-in for the layer
(``tests/torch/stream_recorder.py``, installed with :func:`set_stream_layer`) runs this same code on
CPU and checks that order per buffer.

The collectives that use it are in :mod:`torch_backend.zero.collectives`.
"""

from __future__ import annotations

import torch

__all__ = ["CudaStreams", "compute_stream", "free_after", "hand_over", "host_wait", "record_event", "set_stream_layer",
           "stream_layer", "synchronize_event", "uses_streams"]


class CudaStreams:
    """The stream and event layer on CUDA: the only place the engine asks ``torch.cuda`` for streams and
    events (module docstring, **Streams**). A stand-in with the same methods may replace it
    (:func:`set_stream_layer`), e.g. a recorder that treats the CPU as a device with streams."""

    def __init__(self):
        self._communication: dict[int, torch.cuda.Stream] = {}

    def active(self, device: torch.device) -> bool:
        """Whether ``device`` has streams (a separate communication stream, pinned host copies)."""
        return device.type == "cuda"

    def current(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def communication(self, device: torch.device):
        """The device's communication stream (one per device; FSDP2 keeps one per collective kind)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._communication.get(index)
        if stream is None:
            stream = self._communication[index] = torch.cuda.Stream(device=index)
        return stream

    def enter(self, stream):
        """Context: kernels queued inside it go to ``stream``."""
        return torch.cuda.stream(stream)

    def wait_stream(self, consumer, producer) -> None:
        """``consumer``'s later work waits for everything queued on ``producer`` so far."""
        consumer.wait_stream(producer)

    def record_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, consumer, event) -> None:
        consumer.wait_event(event)

    def synchronize(self, event) -> None:
        """The host waits for ``event``."""
        event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D pinned host tensor (torch's caching host allocator reuses its block only after the
        events it recorded on the streams that copied it)."""
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def host_wait(self, device: torch.device | None) -> None:
        """The host waits for every stream of ``device`` (of every device: ``None``)."""
        torch.cuda.synchronize(device)

    def wait_work(self, work, issued_on) -> None:  # noqa: ARG002 - the stream layer's interface (stand-ins use it)
        """The current stream waits for an issued collective (NCCL's ``work.wait()`` does exactly that;
        ``issued_on``, the stream it was issued from, is for stand-ins that have no NCCL stream)."""
        work.wait()


_STREAMS = CudaStreams()


def stream_layer():
    """The stream layer in use (:class:`CudaStreams` unless a stand-in was set)."""
    return _STREAMS


def set_stream_layer(layer):
    """Use ``layer`` (an object with :class:`CudaStreams`'s methods) for every stream operation;
    returns the previous one. For tests: a recording stand-in on CPU."""
    global _STREAMS
    previous, _STREAMS = _STREAMS, layer
    return previous


def _device_of(where) -> torch.device:
    return where.device if isinstance(where, torch.Tensor) else torch.device(where)


def host_wait(device: torch.device | None = None) -> None:
    """The host waits for everything queued on ``device``'s streams (every CUDA device: ``None``)."""
    _STREAMS.host_wait(device)


def uses_streams(where) -> bool:
    """Whether the device of ``where`` (a tensor or a device) has a separate communication stream."""
    return _STREAMS.active(_device_of(where))


def compute_stream(where):
    """The current (compute) stream of ``where``'s device; ``None`` without streams."""
    device = _device_of(where)
    return _STREAMS.current(device) if _STREAMS.active(device) else None


def hand_over(from_stream, to_stream):
    """A buffer written on ``from_stream`` is used next on ``to_stream``: an event recorded on the
    producer, the consumer waits for it (nothing when either is ``None``, or they are the same).
    Returns the event (``None`` when nothing was recorded)."""
    if from_stream is None or to_stream is None or from_stream is to_stream:
        return None
    event = _STREAMS.record_event(from_stream)
    _STREAMS.wait_event(to_stream, event)
    return event


def free_after(tensor: torch.Tensor, stream) -> None:
    """``tensor``'s memory may be reused only after the work queued on ``stream`` so far (a buffer
    allocated on another stream and used on ``stream``; ``record_stream``). Nothing for ``None``."""
    if stream is not None:
        _STREAMS.record_stream(tensor, stream)


def record_event(stream):
    """An event recorded on ``stream`` (``None`` for ``None``), for :func:`synchronize_event`."""
    return None if stream is None else _STREAMS.record_event(stream)


def synchronize_event(event) -> None:
    """The host waits for ``event`` (nothing for ``None``)."""
    if event is not None:
        _STREAMS.synchronize(event)
