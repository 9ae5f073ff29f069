"""Chunk storage for the torch backend: one :class:`Chunk` per chunk of the core ``ChunkLayout``.

A chunk owns, on this rank (the design of ColossalAI Gemini's ``Chunk``, itself from PatrickStar):

- ``shard`` — this rank's slice ``[r·size/W, (r+1)·size/W)`` of the chunk in the compute dtype
  (the *low-precision shard* in bf16/fp16; in fp32 it is the master shard itself). A keep-gathered
  chunk's "shard" is the whole chunk and doubles as its gathered buffer. In bf16/fp16, for a
  sharded chunk whose master sits on the compute device, no persistent low-precision copy is kept
  (``shard is None``): the gather casts the master shard on the fly (as FSDP2's mixed precision
  does), which saves 2 bytes per element of model state; :meth:`Chunk.low_precision_shard` then
  returns a fresh cast.
  A parameter-offloaded chunk keeps its shard on the host (pinned on CUDA); each gather first
  copies it to the device, so no device copy is kept between uses.
- ``master`` — the fp32 master shard, an ``nn.Parameter`` leaf the optimizer updates (its ``.grad``
  is the reduced, averaged gradient shard, fp32), on the master device (the host when
  optimizer-offloaded). A **frozen** chunk (``requires_grad=False``) has no master, no gradient
  and no optimizer state: only its shard, kept in the **storage dtype** its tensors came in (the
  layout chunk's dtype, :attr:`Chunk.storage_dtype`; FSDP2 keeps a sharded parameter in its own
  dtype too), so its values survive bf16/fp16 compute bit for bit. A gather casts the shard to the
  compute dtype, then all-gathers. Where the two dtypes differ, a frozen chunk at world size 1 is
  gathered (a cast copy) per use instead of staying resident, and a keep-gathered one keeps its
  whole storage-dtype chunk plus the compute-dtype buffer, refreshed from it on load.
- ``buffer`` — the full chunk in the compute dtype. Released, its storage is resized to zero bytes;
  gathered, it is resized back and filled by an all-gather (FSDP2's trick), so views autograd saved
  in forward (``weight.t()`` saved by ``F.linear``) see the re-gathered data in backward. The
  module's parameter objects are kept (FSDP2 swaps in sharded DTensors instead): while the chunk is
  gathered each one's ``.data`` is its view into the buffer; released, a placeholder of the same
  shape, dtype and device that reads as NaN and holds no memory (a stride-0 expand of one element),
  so a read outside the engine (``module.weight.sum()``, the inner module's ``state_dict()``) shows
  NaN instead of touching a zero-byte storage; the full values are ``ZeroDDP.state_dict()``'s.
- ``grad_buffer`` — the full-chunk gradient (compute dtype) accumulated in backward until reduced.

**Its life.** The chunk owns the state of its tensors (the core :class:`chunkzero.ChunkStates`:
FREE, HOLD, COMPUTE, READY_FOR_REDUCE, with the core's table of legal transitions) and what keeps it
gathered between uses; nothing else changes them. The runtime (:mod:`torch_backend.zero.runtime`) calls:

- :meth:`Chunk.use` / :meth:`Chunk.done_using` around a computation (HOLD → COMPUTE → HOLD);
- :meth:`Chunk.add_saved_ref` / :meth:`Chunk.drop_saved_ref` as autograd saves and frees tensors that
  need the gathered data (a tensor unpacked in backward stays COMPUTE until its last one goes);
- :meth:`Chunk.pin` when a recomputation or a ``create_graph`` backward needs it kept (:class:`Pin`);
- :meth:`Chunk.grad_ready` when a tensor's final gradient arrived (→ READY_FOR_REDUCE; ``True``
  once the whole chunk can be reduced);
- :meth:`Chunk.rest` at the end of a forward or backward, :meth:`Chunk.release_if_idle` at a
  backward's release points, :meth:`Chunk.end_backward` when a backward is over;

and the scheduler calls :meth:`Chunk.record_use` / :meth:`Chunk.forget_uses` (the first use since a
gather is recorded in the access order), :meth:`Chunk.begin_gather` (gathered: FREE → HOLD) and
:meth:`Chunk.begin_reduce`. :meth:`Chunk.release` (HOLD/READY_FOR_REDUCE → FREE) raises while a
tensor is in use.

Gathers and reductions are split in two: :meth:`Chunk.begin_gather` / :meth:`Chunk.begin_reduce`
issue the collective (asynchronously when asked), :meth:`Chunk.finish_gather` /
:meth:`Chunk.finish_reduces` wait for it. Which chunk is gathered or reduced when is decided by
:mod:`torch_backend.zero.schedule`, identically on every rank.

All sizes are in elements; ``*_bytes`` are bytes.
"""

from __future__ import annotations

import enum

import torch

from chunkzero import ChunkLayout, ChunkStates, TensorPlacement, TensorState

from . import collectives
from .chunk_grads import ChunkGradients
from .chunk_io import ChunkShardIO, copied
from .memory import AllocationTracker
from .topology import INTRA, Topology, build_topology
from .torch_internals import storage_key

S = TensorState

class Pin(enum.Enum):
    """Why a chunk stays gathered in backward regardless of its saved references."""

    RECOMPUTE = "recompute"
    """A recomputation (activation checkpointing) used it: kept until its gradients are final (a
    frozen chunk: until the backward ends), since the recomputed graph needs it."""
    GRAPH = "graph"
    """A ``create_graph`` backward's new graph references it raw: kept until the next backward ends."""
    GRAPH_HELD = "graph-held"
    """:attr:`GRAPH` carried over into the following backward, at whose end it goes."""


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _released_placeholder(view: torch.Tensor) -> torch.Tensor:
    """What a parameter of a released chunk holds in place of its ``view`` of the buffer: the full
    shape, dtype and device, every element NaN, no memory (one element expanded with stride 0; one
    per parameter, so a write into a one-element parameter shows in no other). Reads outside the
    engine see NaN, never stale values or memory past a zero-byte storage; an in-place write into a
    multi-element one raises (torch refuses writes to overlapping memory)."""
    return torch.full((), float("nan"), dtype=view.dtype, device=view.device).expand(view.shape)


class Chunk(ChunkShardIO, ChunkGradients):
    """One chunk's storage and state on this rank.

    Args:
        layout: the model's layout; ``index`` selects the chunk.
        rank: this rank in the process group.
        params: the module's parameter object for each tensor name of the chunk (primary names).
        device: compute device (where gathered buffers and gradients live).
        param_device: device of the persistent compute-dtype shard between uses (``cpu`` when
            parameter-offloaded).
        param_offloaded: the placement keeps the parameter shard off the device between uses, so the
            chunk is gathered for each use even on one rank (on a CPU-only machine host and device
            are the same memory, and the decision is still applied: a copy per use).
        master_device: device of the fp32 master shard, its gradient and optimizer state (``cpu``
            when optimizer-offloaded); ignored for a frozen chunk.
        group: the shard group (the process group the chunk is sharded over) or ``None`` (one rank).
        topology: the engine's :class:`~torch_backend.zero.topology.Topology` (hybrid sharding: the
            replica group the reduced shard is all-reduced over; the collective bytes counted);
            default: flat over ``group``.
        divide_first: divide gradients by the world size before reducing (fp16).
        movable: the placement may move the parameter shard and the master between host and device
            between uses (``placement="auto"``, :meth:`move_shard` / :meth:`move_master`): the shard is
            then always a tensor of its own (never the master's storage, never ``None``) and only a
            keep-gathered chunk is resident (at world size 1 the gathered buffer is a copy of the shard).
        initial: the full chunk's initial values (fp32, 1-D, ``size`` elements) — already identical
            on every rank.
        compute_dtype: dtype of the gathered buffer and gradients (default: the layout chunk's dtype);
            a frozen chunk's layout dtype is its storage dtype and may differ from it.
        tracker: the engine's :class:`~torch_backend.zero.memory.AllocationTracker`, told of every
            buffer the chunk allocates and frees (default: one of its own).
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
        param_offloaded: bool = False,
        group,
        divide_first: bool,
        initial: torch.Tensor,
        movable: bool = False,
        compute_dtype: torch.dtype | None = None,
        tracker: AllocationTracker | None = None,
        topology: Topology | None = None,
    ):
        info = layout.chunks[index]
        self.topology = topology if topology is not None else build_topology(group, None)
        """The shard group and replica group (:mod:`torch_backend.zero.topology`)."""
        self.tracker = tracker if tracker is not None else AllocationTracker()
        """Where the chunk's allocations are counted (:class:`~torch_backend.zero.memory.AllocationTracker`)."""
        self._persistent_keys: dict[str, int] = {}
        self._gathered_key: int | None = None
        self.index = index
        self.info = info
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self.group = group
        self.storage_dtype = TORCH_DTYPES[info.dtype]
        """dtype of the persistent shard of a frozen chunk (the layout chunk's); the compute dtype otherwise."""
        self.dtype = compute_dtype or self.storage_dtype
        """The compute dtype: gathered buffer and gradients."""
        self.device = torch.device(device)
        self.param_device = torch.device(param_device)
        self.requires_grad = info.requires_grad
        self.master_device = torch.device(master_device) if self.requires_grad else None
        self.divide_first = divide_first
        self.size = info.size
        self.shard_numel = layout.shard_numel(index)
        self.shard_start, self.shard_stop = layout.shard_range(index, rank)
        self.valid_numel = layout.valid_length(index, rank)
        self.keep_gathered = info.keep_gathered
        self.placements: tuple[TensorPlacement, ...] = layout.chunk_tensors(index)
        self.params = params
        self.param_offloaded = bool(param_offloaded) and not self.keep_gathered
        self.movable = movable
        self.casts_frozen = not self.requires_grad and self.storage_dtype != self.dtype
        """A frozen chunk whose storage dtype is not the compute dtype: each gather casts its shard."""
        self.resident = self.keep_gathered or (self.world_size == 1 and not self.param_offloaded and not movable
                                               and not self.casts_frozen)
        """Never released: keep-gathered, or a single rank whose shard is the whole chunk on the device
        (in the compute dtype)."""
        self.states = ChunkStates(info.tensor_names, initial=S.HOLD if self.resident else S.FREE)

        shard_device = self.device if self.resident else self.param_device
        mine = initial[self.shard_start : self.shard_stop]
        self.master: torch.nn.Parameter | None = None
        self.shard: torch.Tensor | None
        if not self.requires_grad:
            self.shard = copied(mine, shard_device, self.device, self.storage_dtype)  # frozen: storage dtype only
        else:
            self.master = torch.nn.Parameter(copied(mine, self.master_device, self.device, torch.float32))
            if self.dtype == torch.float32 and self.master_device == shard_device and not movable:
                self.shard = self.master.data  # fp32: the master shard is the parameter shard
            elif self.resident or movable or shard_device != self.master_device or shard_device != self.device:
                self.shard = copied(mine, shard_device, self.device, self.dtype)
            else:
                self.shard = None  # cast from the master at gather time
        self.grad_buffer: torch.Tensor | None = None
        self._grad_written: set[str] = set()
        self.grad_sq_norm: torch.Tensor | None = None
        """fp32 0-d: squared L2 norm of the accumulated gradient shard over valid elements (set at reduce)."""
        self._reduces: list[tuple[collectives.Pending, torch.Tensor]] = []
        self._to_host: list[tuple[torch.Tensor, object, torch.Tensor]] = []
        self._gather: collectives.Pending | None = None

        # the chunk's life between gathers (module docstring): first use, saved references, pin
        self._used_since_gather = self.resident
        self._saved_refs = 0
        self._saved_refs_by_tensor: dict[str, int] = {}
        self._pin: Pin | None = None

        # The gathered buffer: one tensor for the chunk's lifetime whose storage is resized to zero
        # on release and back on gather (FSDP2's trick), so the parameters stay views of it with
        # their full shapes, and views autograd saved in forward see the re-gathered data.
        if self.resident:
            # a keep-gathered frozen chunk stored in another dtype: the compute-dtype copy lives beside it
            self.buffer = self.shard.to(self.dtype) if self.casts_frozen else self.shard
            self._gathered = True
        else:
            self.buffer = torch.empty(self.size, dtype=self.dtype, device=self.device)
            self._gathered = False
        self.storage_key = storage_key(self.buffer)
        """Identity of the gathered buffer's storage (views of it found by the backward's pack hook)."""
        # Each parameter holds its view of the buffer while the chunk is gathered, and a placeholder
        # of its full shape while it is released (module docstring): both made once, swapped by
        # ``.data`` assignments (a few per gather and release).
        self._param_views = [(params[t.name], self.buffer[t.offset : t.end].view(t.shape)) for t in self.placements]
        self._param_placeholders = [(p, _released_placeholder(v)) for p, v in self._param_views]
        self._point_params(gathered=self.resident)
        if not self.resident:
            self.buffer.untyped_storage().resize_(0)
        self.account_persistent()

    def _point_params(self, *, gathered: bool) -> None:
        """Point every parameter's ``.data`` at its view of the gathered buffer, or at its placeholder."""
        for p, t in self._param_views if gathered else self._param_placeholders:
            p.data = t

    def account_persistent(self) -> None:
        """(Re)count the persistent tensors in the tracker — the parameter shard (the master itself in
        fp32), the master when apart, a resident compute-dtype copy — on the devices they are on now
        (called at construction and after a placement move)."""
        for key in self._persistent_keys.values():
            self.tracker.free(key)
        self._persistent_keys = {}
        shared = self.shard is not None and self.master is not None and self.shard.data_ptr() == self.master.data_ptr()
        held = [("shard", "parameters", self.shard)]
        if self.master is not None and not shared:
            held.append(("master", "fp32_master", self.master))
        if self.resident and self.casts_frozen:
            held.append(("buffer", "parameters", self.buffer))
        for slot, kind, t in held:
            if t is not None:
                self._persistent_keys[slot] = self.tracker.add(kind, t.device, t.numel() * t.element_size())

    # ------------------------------------------------------------------ gather / release
    @property
    def is_gathered(self) -> bool:
        """Whether the full chunk is present and its gather complete (always for resident chunks)."""
        return self._gathered

    @property
    def gather_in_flight(self) -> bool:
        """Whether a gather was issued and not yet waited for."""
        return self._gather is not None

    def _gather_source(self) -> torch.Tensor:
        if self.shard is None:
            return self.tracker.track(self.master.detach().to(self.device, self.dtype), "staging")
        if self.shard.dtype != self.dtype:  # a frozen chunk in its storage dtype: move (async), then cast there
            return self.tracker.track(self.shard.to(self.device, non_blocking=True).to(self.dtype), "staging")
        return self.shard  # on the host when parameter-offloaded: the collective copies it over first

    def begin_gather(self, *, async_op: bool) -> None:
        """Allocate the buffer and issue its all-gather (a host→device copy first when offloaded).

        A chunk already gathered here is gathered again in place (another rank asked for it); a
        gather still in flight is waited for first.
        """
        if self.resident:
            return
        if self._gather is not None:
            self.finish_gather()
        if not self._gathered:
            nbytes = self.size * self.buffer.element_size()
            self.buffer.untyped_storage().resize_(nbytes)
            self._gathered_key = self.tracker.add("gathered_buffers", self.buffer.device, nbytes)
            self._point_params(gathered=True)
        self.topology.count(INTRA, "all_gather", self.size * self.buffer.element_size())
        self._gather = collectives.all_gather_flat(self.buffer, self._gather_source(), self.group, async_op=async_op,
                                                   tracker=self.tracker)

    def finish_gather(self) -> None:
        """Wait for the issued gather; tensors move FREE → HOLD."""
        pending, self._gather = self._gather, None
        if pending is None:
            return
        pending.wait()
        if not self._gathered:
            self._gathered = True
            self.states.transition_all(S.HOLD, only_from=S.FREE)

    def release(self) -> bool:
        """Free the gathered buffer's storage (sharded chunks only), also of a gather still in flight
        (waited for first: never free a buffer a collective is writing); tensors HOLD → FREE. A
        tensor whose gradient is already final stays READY_FOR_REDUCE: readiness is about the
        gradient, not the gathered data, and a chunk released in the middle of its backward (its
        last saved weight freed before its last gradient arrived) must still become reducible when
        its other tensors' gradients arrive — else its gradient buffer waits for the end of the
        backward. Returns whether there was a buffer to free.

        Raises:
            IllegalTransitionError: a tensor is still in use (COMPUTE).
        """
        if self.resident:
            return False
        if self._gather is not None:
            self.finish_gather()
        if not self._gathered:
            return False
        for name in self.states.names_in(S.HOLD, S.COMPUTE):
            self.states.transition(name, S.FREE)
        self._point_params(gathered=False)  # before the storage goes: no parameter ever points past it
        self.buffer.untyped_storage().resize_(0)
        self.tracker.free(self._gathered_key)
        self._gathered_key = None
        self._gathered = False
        self._used_since_gather = False
        self._pin = None
        return True

    # ------------------------------------------------------------------ life between gathers
    # Every tensor-state change of the chunk goes through these methods (the core table,
    # chunkzero.states, raises on anything else); the runtime calls them from torch's events.
    def record_use(self) -> bool:
        """Note a use of the chunk; returns whether it is the first since it was gathered (or since
        :meth:`forget_uses`), which the scheduler records in the access order."""
        first = not self._used_since_gather
        self._used_since_gather = True
        return first

    def forget_uses(self) -> None:
        """A new phase begins: a chunk still gathered counts as not yet used in it (sharded chunks)."""
        if not self.resident:
            self._used_since_gather = False

    def use(self, name: str) -> None:
        """Tensor ``name`` is in use by a computation (HOLD/COMPUTE → COMPUTE). A tensor whose
        gradient is already final stays READY_FOR_REDUCE (a node that saved it may read it after
        the gradient was accumulated).

        Raises:
            IllegalTransitionError: the chunk is not gathered (FREE → COMPUTE: nothing to compute with).
        """
        if self.states.state(name) is not S.READY_FOR_REDUCE:
            self.states.transition(name, S.COMPUTE)

    def done_using(self, name: str) -> None:
        """The computation that used ``name`` is over (COMPUTE → HOLD; any other state stays)."""
        if self.states.state(name) is S.COMPUTE:
            self.states.transition(name, S.HOLD)

    def add_saved_ref(self, name: str | None = None) -> None:
        """Autograd saved a reference that needs the gathered data (``name``: the tensor itself was
        saved; ``None``: a view of the buffer)."""
        self._saved_refs += 1
        if name is not None:
            self._saved_refs_by_tensor[name] = self._saved_refs_by_tensor.get(name, 0) + 1

    def drop_saved_ref(self, name: str | None = None) -> None:
        """Autograd freed a saved reference; a tensor in use for its saved references (unpacked in
        backward) leaves COMPUTE once none of its own is left."""
        self._saved_refs -= 1
        if name is not None:
            left = self._saved_refs_by_tensor.pop(name) - 1
            if left:
                self._saved_refs_by_tensor[name] = left
            else:
                self.done_using(name)

    @property
    def has_saved_refs(self) -> bool:
        """Whether some tensor autograd saved still needs this chunk's gathered data."""
        return self._saved_refs > 0

    def pin(self, reason: Pin) -> None:
        """Keep the chunk gathered in backward whatever its saved references (:class:`Pin`); a
        stronger reason already set is kept."""
        if self._pin is None or reason is Pin.GRAPH:
            self._pin = reason

    @property
    def pin_reason(self) -> Pin | None:
        """Why the chunk stays gathered in backward (``None``: it follows its saved references)."""
        return self._pin

    def grad_ready(self, name: str) -> bool:
        """The final gradient of ``name`` for this backward arrived (→ READY_FOR_REDUCE). Returns
        whether this made every tensor of the chunk ready (the chunk can be reduced); ``False``
        for a tensor already ready (a second backward accumulates into the same buffer)."""
        if self.states.state(name) is S.READY_FOR_REDUCE:
            return False
        self.states.transition(name, S.READY_FOR_REDUCE)
        return self.states.can_reduce

    @property
    def idle(self) -> bool:
        """Gathered, sharded, and no tensor in use: it may be released."""
        return self._gathered and not self.resident and self.states.can_release

    def release_if_idle(self) -> None:
        """Release the chunk if it is :attr:`idle` (a backward's release point)."""
        if self.idle:
            self.release()

    def end_backward(self) -> None:
        """A backward is over: a ``create_graph`` backward's pin holds through the next backward
        (:attr:`Pin.GRAPH_HELD`); every other pin ends."""
        self._pin = Pin.GRAPH_HELD if self._pin is Pin.GRAPH else None

    def rest(self, *, release: bool) -> None:
        """Bring every tensor to its resting state (HOLD if gathered, else FREE: a gradient still
        READY_FOR_REDUCE was handed to the scheduler, a tensor still COMPUTE is no longer used) and,
        with ``release``, release the chunk unless pinned (also a gather still in flight:
        prefetched, then not used)."""
        target = S.HOLD if self._gathered else S.FREE
        for t in self.placements:
            state = self.states.state(t.name)
            if state is S.COMPUTE and target is S.FREE:
                self.states.transition(t.name, S.HOLD)
                state = S.HOLD
            if state is not target:
                self.states.transition(t.name, target)
        if release and self._pin is None:
            self.release()

    def refresh_from_master(self) -> None:
        """Copy the fp32 master shard into the low-precision shard (and drop the stale gathered copy).

        The gathered copy is released first: a gather still in flight may be reading the shard on the
        communication stream, and its wait (on the compute stream) must come before the shard is
        overwritten there."""
        if self.master is None:
            return
        self.release()  # the gathered (or being gathered) copy is stale; the next use gathers the new values
        if self.shard is not None and self.shard.data_ptr() != self.master.data_ptr():
            master = self.master.detach()
            if collectives.uses_streams(master) and master.device.type != "cpu" and self.shard.device.type == "cpu":
                # device → host (placement="auto": master on the device, shard evicted): cast on the
                # device, then one stream-ordered copy into the pinned shard. (``.to("cpu",
                # non_blocking=True)`` followed by a host copy would read the staging buffer before
                # the device has written it.) Host readers synchronize first (ZeroDDP.synchronize).
                self.shard.copy_(master.to(self.dtype), non_blocking=self.shard.is_pinned())
            else:
                # host → device: move first (async from pinned memory) and cast on the device: a copy
                # that also casts would go through a pageable host buffer
                self.shard.copy_(master.to(self.shard.device, non_blocking=True))
