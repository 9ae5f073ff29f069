"""The gradients of a ``ZeroDDP``: :class:`ChunkGradient`, the gradient of one trainable chunk on a rank,
which its :class:`~torch_backend.zero.chunks.Chunk` owns as ``chunk.gradient``; and what ``param.grad`` holds
after a backward, :class:`ShardedGradPlaceholder` (set and cleared by :class:`GradPlaceholders`).

A backward's gradients land in one full-chunk buffer (compute dtype; Note [gradients in the buffer]); the
buffer is averaged over the ranks (reduce-scattered, or all-reduced for a keep-gathered chunk) and each
result is added into the fp32 master's ``.grad``, on the master's device. The
step's owner (:class:`torch_backend.zero.schedule.Scheduler`) and the runtime call its methods. Sizes are in
elements; ``*_bytes`` are bytes.
"""

from __future__ import annotations

import torch

from chunkzero import TensorState
from chunkzero.errors import ConfigError

from . import collectives
from .pinned import host_empty
from .sharding_groups import INTER, INTRA
from .torch_internals import wrapper_tensor

__all__ = ["ChunkGradient", "GradPlaceholders", "ShardedGradPlaceholder"]

S = TensorState


class ChunkGradient:
    """The gradient of one trainable chunk on this rank.

    Attributes:
        buffer: the full-chunk gradient (compute dtype, ``chunk.size`` elements) accumulated in this
            backward and not yet handed to a reduction, or ``None``.
        sq_norm: fp32 0-d squared L2 norm of ``chunk.master.grad`` over the valid elements (set when
            the reductions are finished), or ``None``.
    """

    __slots__ = ("_chunk", "_grad_nbytes", "_in_grad", "_spans", "_streams", "_to_host", "_view_specs",
                 "_whole", "_written", "buffer", "reductions", "sq_norm")

    def __init__(self, chunk):
        self._chunk = chunk
        self.buffer: torch.Tensor | None = None
        self._written: set[str] = set()
        self._in_grad: dict[str, torch.Tensor] = {}
        """Per tensor name: the view of :attr:`buffer` set as its parameter's ``.grad`` (Note [gradients
        in the buffer])."""
        itemsize = torch.empty((), dtype=chunk.dtype).element_size()
        self._grad_nbytes = {t.name: t.numel * itemsize for t in chunk.tensors}
        self.sq_norm: torch.Tensor | None = None
        self.reductions: list[tuple[collectives.Pending | None, torch.Tensor]] = []
        """Reductions issued and not yet added into ``master.grad``: ``(pending, output shard)``."""
        self._to_host: list[tuple[torch.Tensor, object, torch.Tensor]] = []
        self._spans = {t.name: (t.offset, t.offset + t.numel) for t in chunk.tensors}
        self._view_specs = [(t.name, t.shape, torch.empty(t.shape, device="meta").stride(), t.offset)
                            for t in chunk.tensors]
        """Per tensor: ``(name, shape, contiguous strides, offset)`` of its view of the buffer."""
        whole = [t.name for t in chunk.tensors if t.offset == 0 and t.offset + t.numel == chunk.size]
        self._whole = whole[0] if whole else None
        """The tensor that is the whole chunk (no padding), whose gradient is adopted as the buffer."""
        self._streams = collectives.uses_streams(chunk.device)

    @property
    def pending(self) -> bool:
        """Whether a gradient is accumulated here and not yet handed to a reduction."""
        return self.buffer is not None

    def _new_buffer(self) -> torch.Tensor:
        c = self._chunk
        self.buffer = c.tracker.track(torch.empty(c.size, dtype=c.dtype, device=c.device), "gradient_buffers")
        self._written = set()
        return self.buffer

    # Note [gradients in the buffer]. A chunk's first gradient of a backward is copied into a new,
    # zeroed buffer, and every other trainable parameter of the chunk whose ``.grad`` is empty gets its
    # view of that buffer as ``.grad``; autograd's AccumulateGrad then adds each later gradient into
    # the view in place (as DDP's ``gradient_as_bucket_view``), so the hook only notes that it arrived
    # (:meth:`landed`). The views leave ``.grad`` when the buffer is handed to its reduction or dropped,
    # and at the end of every backward (:meth:`take_views`), so outside a backward ``.grad`` never holds
    # one. A gradient that did not land in place (``create_graph``: AccumulateGrad then replaces
    # ``.grad``) is copied as before.
    def landed(self, name: str, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` (the parameter's ``.grad`` after accumulation) is tensor ``name``'s view of
        the buffer, i.e. the gradient was added in place (Note [gradients in the buffer])."""
        view = self._in_grad.get(name)
        if view is None or view is not grad:
            return False
        self._chunk.tracker.transient("autograd_grads", self._chunk.device, self._grad_nbytes[name])  # summed, dropped
        return True

    def _give_views(self) -> None:
        """Point each trainable parameter's empty ``.grad`` at its view of the (zeroed) buffer."""
        buf, params = self.buffer, self._chunk.params
        base = buf.storage_offset()  # (an adopted gradient may start inside its storage)
        for name, shape, stride, offset in self._view_specs:
            p = params[name]
            if p.grad is None and p.requires_grad and name not in self._in_grad:
                view = buf.as_strided(shape, stride, base + offset)
                p.grad = view
                self._in_grad[name] = view

    def take_views(self) -> None:
        """Take the buffer's views out of the parameters' ``.grad`` (where they still are)."""
        if not self._in_grad:
            return
        params = self._chunk.params
        for name, view in self._in_grad.items():
            p = params[name]
            if p.grad is view:
                p.grad = None
        self._in_grad = {}

    def add(self, name: str, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` (the full shape of tensor ``name``) into the buffer. A chunk that is exactly
        one tensor adopts ``grad`` as its buffer, without a copy (the caller hands it over: autograd's
        ``param.grad``, cleared by the engine). A new buffer is zeroed and lent to the chunk's other
        parameters (Note [gradients in the buffer])."""
        c = self._chunk
        buf = self.buffer
        if (buf is None and name == self._whole and grad.dtype == c.dtype and grad.device == c.device
                and grad.is_contiguous()):
            self.buffer = c.tracker.track(grad.detach().view(-1), "gradient_buffers")
            self._written = {name}
            return
        replaced = self._in_grad.pop(name, None) is not None  # AccumulateGrad replaced the view: grad includes it
        if buf is None:
            buf = self._new_buffer()
            buf.zero_()
            self._written = set(self._spans)
        if not self._in_grad and grad.dtype == c.dtype and grad.device == c.device:
            self._give_views()
        start, end = self._spans[name]
        c.tracker.transient("autograd_grads", grad.device, grad.numel() * grad.element_size())  # handed, then dropped
        if name in self._written and not replaced:
            buf[start:end].add_(grad.reshape(-1))
        else:
            buf[start:end].copy_(grad.reshape(-1))
            self._written.add(name)

    def begin_reduce(self, *, async_op: bool) -> None:
        """Issue the averaging of the buffer over the ranks (zeros where nothing was accumulated).
        Sharded chunks are reduce-scattered, keep-gathered chunks all-reduced; one rank alone has
        nothing to exchange. Regions of tensors that received no gradient, and the padding, are zeroed
        first. :meth:`finish_reduces` adds the result into ``master.grad``."""
        c = self._chunk
        buf = self.buffer if self.buffer is not None else self._new_buffer()
        if len(self._written) != len(self._spans):
            for name, (start, end) in self._spans.items():
                if name not in self._written:
                    buf[start:end].zero_()
        if c.padding_numel:
            buf[c.size - c.padding_numel :].zero_()
        self.take_views()
        self.buffer = None
        self._written = set()
        tracker, topo = c.tracker, c.sharding_groups
        tracker.track(buf, "reduce_inputs")
        if topo.world_size == 1:  # one rank: the average is the buffer itself
            self.reductions.append((None, buf))
            return
        nbytes = buf.numel() * buf.element_size()
        if c.keep_gathered or c.world_size == 1:
            out = buf
        else:
            out = tracker.track(torch.empty(c.shard_numel, dtype=c.dtype, device=c.device), "reduce_outputs")
        if topo.hybrid:  # two levels: the shard group, then the replica group
            topo.count(INTRA, "all_reduce" if out is buf else "reduce_scatter", nbytes)
            topo.count(INTER, "all_reduce", out.numel() * out.element_size())
            pending = collectives.reduce_hybrid(out, buf, c.group, topo.replica_group, world_size=topo.world_size,
                                                divide_first=c.divide_first, async_op=async_op, tracker=tracker)
        elif out is buf:  # keep-gathered, or one rank per shard group (S = 1): all-reduced over every rank
            topo.count(INTRA if topo.replicas == 1 else INTER, "all_reduce", nbytes)
            pending = collectives.all_reduce_avg(buf, topo.group, divide_first=c.divide_first, async_op=async_op)
        else:
            topo.count(INTRA, "reduce_scatter", nbytes)
            pending = collectives.reduce_scatter_avg(out, buf, c.group, divide_first=c.divide_first,
                                                     async_op=async_op, tracker=tracker)
        self.reductions.append((pending, out))

    def finish_reduces(self) -> None:
        """Wait for the issued reductions and add each result into ``master.grad`` (fp32, master device);
        :attr:`sq_norm` is recomputed over the valid elements.

        An optimizer-offloaded chunk on a device with streams waits on the communication stream and
        copies the gradient shard there into pinned host memory, so the compute stream does not wait
        (:meth:`finish_host_gradients` does, at the step). The reduction's buffers were allocated on the
        compute stream, which then has not waited for it: they are freed only after the communication
        stream's work (:meth:`collectives.Pending.free_after`), else the next chunk's gradient buffer
        could get their memory while the reduction still reads it.
        """
        if not self.reductions:
            return
        c = self._chunk
        to_host = self._streams and c.master_device.type == "cpu"
        for pending, out in self.reductions:
            if to_host:
                with collectives.communication_stream(out):
                    comm = collectives.compute_stream(out)  # the current stream: the communication one
                    if pending is not None:  # None: one rank, nothing was exchanged
                        pending.free_after(comm)
                        pending.wait()
                    staging = c.tracker.track(host_empty(out.numel(), out.dtype, c.device), "staging")
                    staging.copy_(out, non_blocking=True)
                    done = collectives.record_event(comm)
                self._to_host.append((staging, done, out))
            else:
                if pending is not None:
                    pending.wait()
                self._accumulate(out.to(c.master_device, torch.float32))
        self.reductions.clear()
        if not self._to_host:
            self._update_norm()

    def finish_host_gradients(self) -> None:
        """Complete the device→host gradient copies of an optimizer-offloaded chunk (a device with
        streams): the host waits for each copy's event, then adds the staged shard into ``master.grad``."""
        if not self._to_host:
            return
        for staging, done, _ in self._to_host:
            collectives.synchronize_event(done)
            self._accumulate(staging.float())
        self._to_host.clear()
        self._update_norm()

    def _accumulate(self, g: torch.Tensor) -> None:
        master = self._chunk.master
        if master.grad is None:
            master.grad = self._chunk.tracker.track(g, "fp32_gradients")
        else:
            master.grad.add_(g)

    def _update_norm(self) -> None:
        grad = self._chunk.master.grad
        if grad is not None:
            self.sq_norm = grad[: self._chunk.valid_numel].float().square().sum()

    def held(self) -> list[torch.Tensor]:
        """The gradient tensors held now besides ``master.grad``: the buffer, the reductions' outputs,
        the device shards and staging buffers of host copies in flight."""
        out = [] if self.buffer is None else [self.buffer]
        out += [t for _, t in self.reductions]
        for staging, _, t in self._to_host:
            out += [t, staging]
        return out

    def discard_buffer(self) -> None:
        """Drop the buffer not yet reduced (reductions in flight and ``master.grad`` stay)."""
        self.take_views()
        self.buffer = None
        self._written = set()

    def zero(self) -> None:
        """Drop every gradient: buffer, reductions in flight and the master's."""
        for pending, _ in self.reductions:
            if pending is not None:
                pending.wait()
        self.reductions.clear()
        self.finish_host_gradients()
        self.discard_buffer()
        self._chunk.master.grad = None
        self.sq_norm = None


class ShardedGradPlaceholder(torch.Tensor):
    """``param.grad`` of a ZeroDDP parameter after a backward: same shape, dtype and device, no data.

    Any operation on it raises :class:`chunkzero.errors.ConfigError` pointing to ``ZeroOptimizer``,
    so a plain torch optimizer or ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()`` fails
    loudly instead of doing nothing.
    """

    param_name: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str):
        t = wrapper_tensor(cls, param)
        t.param_name = name
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a.param_name for a in (*args, *(kwargs or {}).values()) if isinstance(a, ShardedGradPlaceholder)]
        names += [
            b.param_name
            for a in args
            if isinstance(a, (list, tuple))
            for b in a
            if isinstance(b, ShardedGradPlaceholder)
        ]
        raise ConfigError(
            f"the gradient of {names[0] if names else 'a ZeroDDP parameter'!r} lives in ZeroDDP's chunk shards, so "
            f"{func} cannot use param.grad: step with ZeroOptimizer(model, torch.optim.AdamW, max_norm=...) "
            "(it clips and steps the shards), or read ZeroDDP.grad_shard(chunk)")

    def __repr__(self) -> str:
        return f"ShardedGradPlaceholder({self.param_name!r}, shape={tuple(self.shape)})"


class GradPlaceholders:
    """The placeholders of a model's trainable parameters: set after a backward in the ``.grad`` of
    each parameter that received a gradient on some rank, cleared before the next forward, backward
    or ``zero_grad`` (only where ``.grad`` still holds the placeholder).

    Args:
        params: ``(parameter, name, layout tensor index)`` of each trainable parameter.
    """

    def __init__(self, params: list[tuple[torch.nn.Parameter, str, int]]):
        self.params = params
        self._made: dict[int, ShardedGradPlaceholder] = {}
        self.installed = False
        """Whether some parameter's ``.grad`` may hold its placeholder now."""

    def set(self, grad_received: torch.Tensor) -> None:
        """Put a placeholder in ``.grad`` of every parameter whose ``grad_received[index]`` is set."""
        received = grad_received.tolist()
        for param, name, index in self.params:
            if received[index] and param.grad is None:
                if index not in self._made:
                    self._made[index] = ShardedGradPlaceholder(param, name)
                param.grad = self._made[index]
                self.installed = True

    def clear(self) -> None:
        """Take the placeholders out of ``.grad`` again."""
        if self.installed:
            for param, _, index in self.params:
                if param.grad is not None and param.grad is self._made.get(index):
                    param.grad = None
            self.installed = False
