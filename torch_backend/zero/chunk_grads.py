"""A chunk's gradient on a rank: accumulated into one flat buffer during the backward, reduced
(reduce-scattered over the shard group, or all-reduced; hybrid sharding: then across the replicas)
when its last gradient arrives, and added into the fp32 master's ``.grad`` (through the communication
stream to a host master when the optimizer is offloaded). :class:`ChunkGradients` is this part of
:class:`torch_backend.zero.chunks.Chunk`, whose storage, gather and release it builds on.
"""

from __future__ import annotations

import torch

from chunkzero import TensorPlacement

from . import collectives
from .chunk_io import host_empty
from .topology import INTER, INTRA

__all__ = ["ChunkGradients"]


class ChunkGradients:
    """The gradient methods of :class:`~torch_backend.zero.chunks.Chunk` (its attributes: ``grad_buffer``,
    ``placements``, ``tracker``, ``topology``, ``master``, ``master_device`` and the reduction queues)."""

    def _grad_buffer(self) -> torch.Tensor:
        if self.grad_buffer is None:
            self.grad_buffer = self.tracker.track(torch.empty(self.size, dtype=self.dtype, device=self.device),
                                                  "gradient_buffers")
            self._grad_written.clear()
        return self.grad_buffer

    @property
    def has_grad(self) -> bool:
        """Whether gradients were accumulated here since the last reduction."""
        return self.grad_buffer is not None

    def add_grad(self, name: str, placement: TensorPlacement, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` (full shape of the tensor) into the chunk's gradient buffer.

        A chunk that is exactly one tensor (no padding) adopts ``grad`` as its buffer, without a copy
        (the caller hands it over: autograd's ``param.grad``, cleared by the engine).
        """
        if (self.grad_buffer is None and placement.offset == 0 and placement.end == self.size
                and grad.is_contiguous() and grad.dtype == self.dtype and grad.device == self.device):
            self.grad_buffer = self.tracker.track(grad.detach().view(-1), "gradient_buffers")
            self._grad_written = {name}
            return
        buf = self._grad_buffer()[placement.offset : placement.end]
        handed = self.tracker.add("autograd_grads", grad.device, grad.numel() * grad.element_size())
        g = grad.reshape(-1)
        if name in self._grad_written:
            buf.add_(g)
        else:
            buf.copy_(g)
            self._grad_written.add(name)
        self.tracker.free(handed)  # the caller drops it on return

    def begin_reduce(self, *, async_op: bool) -> None:
        """Issue the averaging of the gradient buffer over ranks (zeros where nothing was accumulated).

        Sharded chunks are reduce-scattered, keep-gathered chunks all-reduced. Regions of tensors that
        received no gradient, and the padding, are zeroed first. :meth:`finish_reduces` adds the
        result into ``master.grad``.
        """
        buf = self._grad_buffer()
        for t in self.placements:
            if t.name not in self._grad_written:
                buf[t.offset : t.end].zero_()
        if self.info.padding:
            buf[self.info.utilized :].zero_()
        self.grad_buffer = None
        self._grad_written = set()
        self.tracker.track(buf, "reduce_inputs")
        topo, nbytes = self.topology, buf.numel() * buf.element_size()
        if self.keep_gathered or self.world_size == 1:
            out = buf
        else:
            out = self.tracker.track(torch.empty(self.shard_numel, dtype=self.dtype, device=self.device), "reduce_outputs")
        if topo.hybrid:  # two levels: the shard group, then the replica group
            topo.count(INTRA, "all_reduce" if out is buf else "reduce_scatter", nbytes)
            topo.count(INTER, "all_reduce", out.numel() * out.element_size())
            pending = collectives.reduce_hybrid(out, buf, self.group, topo.replica_group, world_size=topo.world_size,
                                                divide_first=self.divide_first, async_op=async_op, tracker=self.tracker)
        elif out is buf:  # keep-gathered, or one rank per shard group (S = 1): all-reduced over every rank
            topo.count(INTRA if topo.replicas == 1 else INTER, "all_reduce", nbytes)
            pending = collectives.all_reduce_avg(buf, topo.group, divide_first=self.divide_first, async_op=async_op)
        else:
            topo.count(INTRA, "reduce_scatter", nbytes)
            pending = collectives.reduce_scatter_avg(out, buf, self.group, divide_first=self.divide_first, async_op=async_op,
                                                     tracker=self.tracker)
        self._reduces.append((pending, out))

    def finish_reduces(self) -> None:
        """Wait for the issued reductions and add each result into ``master.grad`` (fp32, master device);
        :attr:`grad_sq_norm` is recomputed over the valid elements.

        An optimizer-offloaded chunk on a device with streams (:func:`collectives.uses_streams`) waits on
        the communication stream and copies the gradient shard there into pinned host memory, so the
        compute stream does not wait (:meth:`finish_host_gradients` does, at the step). The buffers the
        reduction used were allocated on the compute stream, which then has not waited for it: they are
        freed only after the communication stream's work (:meth:`collectives.Pending.free_after`), else
        the next chunk's gradient buffer could get their memory while the reduction still reads it.
        """
        if not self._reduces:
            return
        for pending, out in self._reduces:
            if self._reduces_to_host(out):
                with collectives.communication_stream(out):
                    comm = collectives.compute_stream(out)  # the current stream: the communication one
                    pending.free_after(comm)
                    pending.wait()
                    staging = self.tracker.track(host_empty(out.numel(), out.dtype, self.device), "staging")
                    staging.copy_(out, non_blocking=True)
                    done = collectives.record_event(comm)
                self._to_host.append((staging, done, out))
                continue
            pending.wait()
            self._accumulate(out.to(self.master_device, torch.float32))
        self._reduces.clear()
        if not self._to_host:
            self._update_norm()

    def _reduces_to_host(self, out: torch.Tensor) -> bool:
        """Whether the reduced shard ``out`` goes to a host master through the communication stream
        (a device with streams and the master on the host; where host and device are one memory, as on
        CPU under a stand-in stream layer, a master on ``cpu`` counts as on the host)."""
        return collectives.uses_streams(out) and self.master_device.type == "cpu"

    def finish_host_gradients(self) -> None:
        """Complete the device→host gradient copies of an optimizer-offloaded chunk (a device with
        streams): the host waits for each copy's event, then adds the staged shard into ``master.grad``
        and drops the staging buffer and the device shard it was copied from."""
        if not self._to_host:
            return
        for staging, done, _ in self._to_host:
            collectives.synchronize_event(done)
            self._accumulate(staging.float())
        self._to_host.clear()
        self._update_norm()

    def _accumulate(self, g: torch.Tensor) -> None:
        if self.master.grad is None:
            self.master.grad = self.tracker.track(g, "fp32_gradients")
        else:
            self.master.grad.add_(g)

    def _update_norm(self) -> None:
        if self.master is not None and self.master.grad is not None:
            self.grad_sq_norm = self.master.grad[: self.valid_numel].float().square().sum()

    def discard_grad_buffer(self) -> None:
        """Drop the gradient buffer not yet reduced (reductions in flight and ``master.grad`` stay)."""
        self.grad_buffer = None
        self._grad_written = set()

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (buffer, reductions in flight and master gradient)."""
        for pending, _ in self._reduces:
            pending.wait()
        self._reduces.clear()
        self.finish_host_gradients()
        self.discard_grad_buffer()
        if self.master is not None:
            self.master.grad = None
        self.grad_sq_norm = None
