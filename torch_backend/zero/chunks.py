"""One chunk of the core ``ChunkLayout`` on a rank: :class:`Chunk` (storage, gather, release, the
tensor states), which owns its gradient as a :class:`~torch_backend.zero.chunk_gradient.ChunkGradient`.

A chunk holds ``shard`` (this rank's slice in the compute dtype; ``None`` when it is cast from the
master at each gather), ``master`` (the fp32 master shard, an ``nn.Parameter``; ``None`` when frozen),
``buffer`` (the full chunk, its storage resized to zero while released; the module's parameters are
views of it while gathered, NaN placeholders of their shape while released) and ``gradient``. Only
its life methods change its tensors' states (the core table, :mod:`chunkzero.states`); the step's
owner (:class:`torch_backend.zero.schedule.Scheduler`) and the runtime call them. ``docs/ARCHITECTURE.md``
("A chunk on a rank") says why each piece is kept as it is. Sizes are in elements; ``*_bytes`` are bytes.
"""

from __future__ import annotations

import enum

import torch

from chunkzero import ChunkLayout, ChunkStates, TensorSlot, TensorState
from chunkzero.errors import ConfigError

from . import collectives
from .chunk_gradient import ChunkGradient
from .memory import AllocationTracker
from .pinned import copied
from .sharding_groups import INTRA, ShardingGroups, build_sharding_groups
from .torch_internals import storage_key

S = TensorState
_NOT_READY = frozenset({S.FREE, S.HOLD, S.COMPUTE})
_IN_GATHERED = frozenset({S.HOLD, S.COMPUTE})

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


class Chunk:
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
        sharding_groups: the engine's :class:`~torch_backend.zero.sharding_groups.ShardingGroups` (hybrid sharding: the
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
        sharding_groups: ShardingGroups | None = None,
    ):
        info = layout.chunks[index]
        self.sharding_groups = sharding_groups if sharding_groups is not None else build_sharding_groups(group, None)
        """The shard group and replica group (:mod:`torch_backend.zero.sharding_groups`)."""
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
        self.tensors: tuple[TensorSlot, ...] = layout.chunk_tensors(index)
        """The chunk's tensors: each one's name, shape and offset in the chunk."""
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
        self.padding_numel = info.padding
        self.gradient = ChunkGradient(self) if self.requires_grad else None
        """The chunk's gradient on this rank (:class:`ChunkGradient`);
        ``None`` for a frozen chunk."""
        self._gather: collectives.Pending | None = None
        self.gather_in_flight = False
        """Whether a gather was issued and not yet waited for."""

        # the chunk's life between gathers (module docstring): first use, saved references, pin
        self._used_since_gather = self.resident
        self._saved_refs = 0
        self._saved_refs_by_tensor: dict[str, int] = {}
        self._pin: Pin | None = None
        self._held = False

        # The gathered buffer: one tensor for the chunk's lifetime whose storage is resized to zero
        # on release and back on gather (FSDP2's trick), so the parameters stay views of it with
        # their full shapes, and views autograd saved in forward see the re-gathered data.
        if self.resident:
            # a keep-gathered frozen chunk stored in another dtype: the compute-dtype copy lives beside it
            self.buffer = self.shard.to(self.dtype) if self.casts_frozen else self.shard
            self.is_gathered = True
            """Whether the full chunk is present and its gather complete (always for resident chunks)."""
        else:
            self.buffer = torch.empty(self.size, dtype=self.dtype, device=self.device)
            self.is_gathered = False
        self.storage_key = storage_key(self.buffer)
        """Identity of the gathered buffer's storage (views of it found by the backward's pack hook)."""
        # Each parameter holds its view of the buffer while the chunk is gathered, and a placeholder
        # of its full shape while it is released (module docstring): both made once, swapped by
        # ``.data`` assignments (a few per gather and release).
        self._param_views = [(params[t.name], self.buffer[t.offset : t.end].view(t.shape)) for t in self.tensors]
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
        if not self.is_gathered:
            nbytes = self.size * self.buffer.element_size()
            self.buffer.untyped_storage().resize_(nbytes)
            self._gathered_key = self.tracker.add("gathered_buffers", self.buffer.device, nbytes)
            self._point_params(gathered=True)
        self.sharding_groups.count(INTRA, "all_gather", self.size * self.buffer.element_size())
        self.gather_in_flight = True
        self._gather = collectives.all_gather_flat(self.buffer, self._gather_source(), self.group, async_op=async_op,
                                                   tracker=self.tracker)

    def finish_gather(self) -> None:
        """Wait for the issued gather; tensors move FREE → HOLD."""
        pending, self._gather = self._gather, None
        self.gather_in_flight = False
        if pending is None:
            return
        pending.wait()
        if not self.is_gathered:
            self.is_gathered = True
            self.states.transition_all(S.HOLD, only_from=S.FREE)

    def release(self) -> bool:
        """Free the gathered buffer's storage (sharded chunks; a gather in flight is waited for first);
        tensors HOLD → FREE, READY_FOR_REDUCE ones stay (their gradient is final whatever the data).
        Returns whether there was a buffer to free. A held chunk (:meth:`hold`) keeps it: ``False``.

        Raises:
            IllegalTransitionError: a tensor is still in use (COMPUTE).
        """
        if self.resident or self._held:
            return False
        if self._gather is not None:
            self.finish_gather()
        if not self.is_gathered:
            return False
        self.states.transition_all(S.FREE, only_from=_IN_GATHERED)
        self._point_params(gathered=False)  # before the storage goes: no parameter ever points past it
        self.buffer.untyped_storage().resize_(0)
        self.tracker.free(self._gathered_key)
        self._gathered_key = None
        self.is_gathered = False
        self._used_since_gather = False
        self._pin = None
        return True

    def hold(self) -> None:
        """Keep the gathered buffer until :meth:`unhold` (the runtime's suspended access mode, Note
        [suspended access mode] in :mod:`torch_backend.zero.runtime`): :meth:`release` frees nothing
        meanwhile, and :meth:`refresh_from_master` and :meth:`load_master` raise."""
        self._held = True

    def unhold(self) -> None:
        """End :meth:`hold`: releases free the buffer again."""
        self._held = False

    def _refuse_update_while_held(self) -> None:
        if self._held:
            raise ConfigError(
                f"chunk {self.index}'s values changed (an optimizer step or a load) inside ZeroDDP's forward: "
                "its parameters are in use there; step or load between steps")

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
        self.states.transition(name, S.COMPUTE, _NOT_READY)

    def done_using(self, name: str) -> None:
        """The computation that used ``name`` is over (COMPUTE → HOLD; any other state stays)."""
        self.states.transition(name, S.HOLD, S.COMPUTE)

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
        states = self.states
        return states.transition(name, S.READY_FOR_REDUCE, _NOT_READY) is not S.READY_FOR_REDUCE and states.can_reduce

    @property
    def idle(self) -> bool:
        """Gathered, sharded, and no tensor in use: it may be released."""
        return self.is_gathered and not self.resident and self.states.can_release

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
        states = self.states
        if self.is_gathered:
            states.transition_all(S.HOLD)
        else:
            states.transition_all(S.HOLD, only_from=S.COMPUTE)  # no longer used: COMPUTE → HOLD → FREE
            states.transition_all(S.FREE)
        if release and self._pin is None:
            self.release()

    def refresh_from_master(self) -> None:
        """Copy the fp32 master shard into the low-precision shard (and drop the stale gathered copy).

        The gathered copy is released first: a gather still in flight may be reading the shard on the
        communication stream, and its wait (on the compute stream) must come before the shard is
        overwritten there."""
        if self.master is None:
            return
        self._refuse_update_while_held()
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

    # ------------------------------------------------------------------ values and placement moves
    def master_values(self) -> torch.Tensor:
        """The fp32 values of this rank's shard: the live master, or a frozen chunk's storage-dtype
        shard as fp32 (exact for fp32, bf16 and fp16 storage; the shard itself when it is fp32)."""
        return self.master.detach() if self.master is not None else self.shard.float()

    def load_master(self, values: torch.Tensor) -> None:
        """Copy a 1-D shard of ``shard_numel`` elements (any floating dtype) into the fp32 master (a
        frozen chunk: into its storage-dtype shard, and a resident compute-dtype copy from it) and
        release the stale gathered copy.

        Raises:
            IllegalTransitionError: a tensor of the chunk is in use (its gathered data is needed).
            ConfigError: the chunk is held (:meth:`hold`: inside a forward).
        """
        self._refuse_update_while_held()
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

    def move_shard(self, device: torch.device, *, offloaded: bool) -> int:
        """Move the persistent parameter shard to ``device`` (host: pinned when computing on CUDA); the
        copy is asynchronous on CUDA, and always a copy (also where host and device are one memory).
        ``offloaded``: the shard is now off the device. Returns the bytes copied.

        Raises:
            ValueError: the chunk is not movable, or resident (its shard is the gathered buffer).
        """
        if not self.movable or self.resident:
            raise ValueError(
                f"chunk {self.index}'s parameter shard cannot move (movable={self.movable}, resident={self.resident})"
            )
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
        self.gradient.finish_reduces()
        self.gradient.finish_host_gradients()
        grad, self.master.grad = self.master.grad, None
        self.master.data = copied(self.master.detach(), device, self.device, non_blocking=True)
        moved = self.master.numel() * 4
        if grad is not None:
            self.master.grad = self.tracker.track(
                copied(grad, device, self.device, non_blocking=True), "fp32_gradients"
            )
            moved += grad.numel() * 4
        self.master_device = torch.device(device)
        self.account_persistent()
        return moved
