"""Gemini's ``auto`` placement in the torch engine (``ZeroDDP(placement="auto")``): the warm-up memory
tracer and the applier of the core's plan (:func:`chunkzero.plan_placement`).

**Budget.** ``steady_device_cap_ratio`` × the device memory (``device_memory_bytes``; by default the
CUDA device's total memory, and on CPU, where there is no device to ask, the machine's physical RAM)
is what the chunks on the device plus the non-model memory may use at every chunk access
(:func:`placement_budget_bytes`; Gemini's ``steady_cuda_cap_ratio``).

**Warm-up step.** Every parameter shard and every master (with its gradient and optimizer state)
starts on the host; the first training step runs so, gathering each chunk from the host, while
:class:`AutoPlacement` records, at each chunk access the scheduler records (its
:class:`~torch_backend.zero.schedule.AccessOrder` per phase: forward, then backward), the non-model memory
in use: on CUDA ``torch.cuda.memory_allocated()`` minus the engine's own bytes (chunk shards, masters,
gradients, gathered buffers, the optimizer's state); on CPU the bytes of the distinct storages that
autograd's saved tensors hold alive, chunk buffers excluded (the engine's saved-tensor hooks see every
saved tensor: :class:`SavedBytes`). The engine's transient bytes at the access (gathered buffers, the
accessed chunk's included, gradient buffers, reductions in flight) are recorded too.

**Plan.** At the next forward the plan is computed over the trace (:class:`PlacementTrace`): chunk
sizes = the parameter shards' bytes (keep-gathered chunks never move: their bytes count as memory the
plan cannot move, with the non-model and transient bytes), optimizer state = master + gradient +
optimizer state bytes per chunk. The masters of the plan's ``optim_host`` chunks stay on the host
(the optimizer steps them there), the others move to the device. A trace is taken again in the step
after one whose access order changed (the scheduler's ``AccessOrder.recordings``).

**Applying it.** Each chunk's placement is one :class:`chunkzero.ChunkPlacement`, changed only by
:meth:`AutoPlacement.apply`, which copies the tensors that change location (:meth:`Chunk.move_shard`,
:meth:`Chunk.move_master`). At each step start the device set is brought to the step's
``resident_at_start`` (a no-op in steady state); at each access ``t`` the plan's ``evict[t]`` move to
the host and ``prefetch[t]`` to the device; a chunk the engine gathers ahead of its access (the
prefetch window) is brought to the device when its gather is issued, so the gather reads it there and
the copy overlaps the computation before (the device then holds up to ``prefetch`` chunks more than
the plan says, for that while). A step whose accesses leave the recorded order goes off the plan for
the rest of the step: a chunk on the host is then gathered from there (every gather can), and the
next step re-traces. On CUDA the copies are asynchronous (pinned host memory, stream-ordered); on
CPU host and device are the same memory, the same copies run and the bytes are counted alike.

Source: PatrickStar (Fang et al. 2021) and ColossalAI Gemini's ``AutoPlacementPolicy`` and memory
tracer (``MemStatsCollector``: non-model memory sampled at each operator during the warm-up).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import weakref
from dataclasses import dataclass

import torch

from chunkzero import ChunkPlacement, Location, PlacementPlan, chunk_placements, plan_placement
from chunkzero.errors import ConfigError

from . import chunk_io, streams
from .chunks import Chunk
from .config import DEFAULT_STEADY_DEVICE_CAP_RATIO, AutoPlacementPolicy
from .schedule import BACKWARD, FORWARD
from .torch_internals import storage_key

__all__ = ["DEFAULT_STEADY_DEVICE_CAP_RATIO", "AutoPlacement", "PlacementTrace", "SavedBytes", "device_memory_bytes",
           "placement_budget_bytes", "warmup_placements"]

DEFAULT_OPTIM_STATE_BYTES_PER_ELEMENT = 8
"""Optimizer-state bytes per master element assumed before the optimizer has any state: Adam's two
fp32 moments (Gemini assumes its Adam too)."""


# ---------------------------------------------------------------------------------------- budget
def device_memory_bytes(device: torch.device) -> int:
    """Total memory of the training device: a CUDA device's ``total_memory``; for the CPU the
    machine's physical RAM (``SC_PHYS_PAGES × SC_PAGE_SIZE``).

    Raises:
        ConfigError: the CPU's RAM cannot be read (pass ``device_memory_bytes``).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        raise ConfigError(f"cannot read the memory of device {device}: pass ZeroDDP(device_memory_bytes=...)") from None


def placement_budget_bytes(device: torch.device, policy: AutoPlacementPolicy) -> int:
    """``floor(policy.steady_device_cap_ratio × policy.device_memory_bytes)`` bytes; a
    ``device_memory_bytes`` of ``None`` is :func:`device_memory_bytes` of ``device``.

    Raises:
        ConfigError: the CPU's RAM cannot be read (from :func:`device_memory_bytes`).
    """
    total = device_memory_bytes(device) if policy.device_memory_bytes is None else policy.device_memory_bytes
    return int(total * policy.steady_device_cap_ratio)


def warmup_placements(chunks) -> tuple[ChunkPlacement, ...]:
    """Where ``placement="auto"`` starts: every sharded chunk's parameter shard and every trainable
    chunk's master, gradient and optimizer state on the host (keep-gathered chunks' parameters stay
    on the device). ``chunks``: ``ChunkLayout.chunks``."""
    return chunk_placements(chunks, param_host=[c.index for c in chunks if not c.keep_gathered],
                            optim_host=[c.index for c in chunks if c.requires_grad])


# ---------------------------------------------------------------------------------------- tracer
class SavedActivation:
    """A saved tensor that is not model data (an activation), as autograd holds it while a
    :class:`SavedBytes` counts it (:meth:`SavedBytes.hold`): counted when saved, released when
    autograd frees it; unpacked, it is ``tensor``."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, counter, tensor):
        self.counter, self.tensor = counter, tensor
        self.key = counter.add(tensor)

    def __del__(self):
        try:
            self.counter.release(self.key)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class SavedBytes:
    """Bytes of the distinct storages that autograd's saved activations hold alive now.

    :meth:`add` counts a saved tensor's storage once however many saved tensors share it (a storage's
    whole ``nbytes``, what it holds alive); :meth:`release` drops the reference. Storages in
    ``excluded`` (keep-gathered chunk buffers) are not counted.
    """

    def __init__(self, excluded: set[int] = frozenset()):
        self.excluded = excluded
        self.active = True
        """Whether the traced step is still running (the runtime stops holding tensors through it after)."""
        self.bytes = 0
        """Bytes alive now."""
        self._live: dict[int, list[int]] = {}

    def hold(self, t: torch.Tensor) -> SavedActivation:
        """What autograd keeps instead of the saved tensor ``t``: counted until autograd frees it."""
        return SavedActivation(self, t)

    def add(self, t: torch.Tensor) -> int | None:
        key = storage_key(t)
        if key is None or key in self.excluded:
            return None
        entry = self._live.get(key)
        if entry is None:
            n = t.untyped_storage().nbytes()
            self._live[key] = [1, n]
            self.bytes += n
        else:
            entry[0] += 1
        return key

    def release(self, key: int | None) -> None:
        entry = self._live.get(key) if key is not None else None
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.bytes -= entry[1]


@dataclass(frozen=True)
class PlacementTrace:
    """What a traced step recorded, one entry per chunk access (forward accesses, then backward).

    Attributes:
        access_order: the chunk of each access (the scheduler's recorded orders, forward + backward).
        forward_accesses: how many of them are in the forward.
        non_model_bytes: non-model memory in use at each access (see the module docstring).
        transient_bytes: the engine's transient bytes at each access (gathered buffers, the accessed
            chunk's included; gradient buffers; reductions in flight).
    """

    access_order: tuple[int, ...]
    forward_accesses: int
    non_model_bytes: tuple[int, ...]
    transient_bytes: tuple[int, ...]

    @property
    def peak_bytes(self) -> int:
        """The largest non-model plus transient bytes of any access."""
        return max((a + b for a, b in zip(self.non_model_bytes, self.transient_bytes)), default=0)


# ---------------------------------------------------------------------------------------- applier
class AutoPlacement:
    """Traces, plans and applies ``placement="auto"`` for one ZeroDDP (see the module docstring).

    Args:
        chunks: the model's chunks (built ``movable``), by index.
        orders: the scheduler's recorded access orders by phase (read when a traced step ends).
        placements: the starting placement (:func:`warmup_placements`).
        device: the compute device.
        budget_bytes: the device budget (:func:`placement_budget_bytes`).
        prefetch: the engine's prefetch window (chunks).

    Attributes of interest: :attr:`placements`, :attr:`budget_bytes` (assignable: the next step
    re-plans with the new budget), :attr:`trace`, :attr:`plan`, :attr:`policy`, :attr:`chunk_bytes`,
    :attr:`h2d_bytes`, :attr:`d2h_bytes`, :attr:`step_bytes_moved`, :attr:`traces`.
    """

    def __init__(self, chunks: list[Chunk], orders, *, placements, device: torch.device,
                 budget_bytes: int, prefetch: int):
        self.chunks = chunks
        self._orders = orders
        self.placements: list[ChunkPlacement] = list(placements)
        """One :class:`chunkzero.ChunkPlacement` per chunk, as things are now."""
        self.device = torch.device(device)
        self.prefetch = prefetch
        self._budget_bytes = int(budget_bytes)
        self.policy = "auto"
        """The rule :func:`chunkzero.plan_placement` uses (``"auto"``; benchmarks set ``"static"`` or
        ``"belady"`` to run another through the same engine; takes effect at the next plan)."""
        self.chunk_bytes: tuple[int, ...] = tuple(
            0 if c.resident else c.shard_numel * c.shard.element_size() for c in chunks)
        """Bytes of each chunk's parameter shard (a frozen one's in its storage dtype), what the plan
        moves (0 for keep-gathered chunks)."""
        self.resident_bytes = sum(
            n for c in chunks if c.resident for _, kind, n in chunk_io.bytes_by_kind(c) if kind == "parameters"
        )
        """Bytes of the keep-gathered chunks, always on the device."""
        self.trace: PlacementTrace | None = None
        """The latest trace (``None`` before the first traced step ended); the next training step plans
        from it."""
        self.plan: PlacementPlan | None = None
        """The plan being applied (``None`` during the warm-up)."""
        self.traces = 0
        """Traced steps so far."""
        self.h2d_bytes = 0
        """Parameter-shard bytes moved host→device so far."""
        self.d2h_bytes = 0
        """Parameter-shard bytes moved device→host so far."""
        self.master_bytes_moved = 0
        """Master and gradient bytes moved so far (when a plan changes ``optim_host``)."""
        self.step_bytes_moved: list[int] = []
        """Per training step finished (forward + backward): parameter-shard bytes moved in it, the moves
        that enter the step's start set included."""
        self._optimizer = None
        self._where = {Location.DEVICE: self.device, Location.HOST: torch.device("cpu")}
        self._count_saved = self.device.type != "cuda"
        self.saved_counter: SavedBytes | None = None
        """The counter of the saved activations of the step being traced on CPU (``None`` otherwise): the
        model hands it to its runtime after :meth:`before_forward`."""
        self._resident_storages = {c.storage_key for c in chunks if c.resident}
        # per step
        self._in_step = False
        self._tracing = False
        self._records: list[tuple[int, int]] = []
        self._forward_records = 0
        self._new_trace = False
        self._retrace = False
        self._replan = False
        self._recordings: tuple[int, int] | None = None
        self._k = 0
        self._step_done = False
        self._on_plan = False
        self._pos = 0
        self._early: dict[int, int] = {}
        self._moved_in_step = 0

    # ------------------------------------------------------------------ public
    @property
    def budget_bytes(self) -> int:
        """The device budget in bytes; setting it re-plans at the next training step."""
        return self._budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ConfigError(f"budget_bytes must be a non-negative int, got {value!r}")
        self._budget_bytes = int(value)
        self._replan = True

    def budget_for_fraction(self, fraction: float) -> int:
        """A simulated budget: ``fraction`` of the parameter shards (``sum(chunk_bytes)``, the model
        data the plan places) plus the latest trace's peak non-model, transient and keep-gathered
        bytes, so that ``1.0`` holds every chunk beside the activations.

        Raises:
            ConfigError: no step has been traced yet, or ``fraction`` is negative.
        """
        if self.trace is None:
            raise ConfigError("budget_for_fraction needs a traced step: run one training step first")
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or fraction < 0:
            raise ConfigError(f"fraction must be a non-negative number, got {fraction!r}")
        return int(fraction * sum(self.chunk_bytes)) + self.trace.peak_bytes + self.resident_bytes

    def optim_state_bytes(self) -> tuple[int, ...]:
        """Per chunk: bytes of its master, gradient and optimizer state (0 when frozen); the state is
        what the attached optimizer keeps per element, or :data:`DEFAULT_OPTIM_STATE_BYTES_PER_ELEMENT`
        before it has any."""
        opt = self._optimizer() if self._optimizer is not None else None
        per_element = opt.state_bytes_per_element() if opt is not None else None
        if per_element is None:
            per_element = DEFAULT_OPTIM_STATE_BYTES_PER_ELEMENT
        return tuple(c.shard_numel * (8 + per_element) if c.requires_grad else 0 for c in self.chunks)

    def attach_optimizer(self, optimizer) -> None:
        """Called by the ZeroOptimizer over this model (kept weakly): its state is then excluded from
        the non-model memory on CUDA and sized for the plan."""
        self._optimizer = weakref.ref(optimizer)

    def apply(self, index: int, placement: ChunkPlacement) -> None:
        """Make ``placement`` chunk ``index``'s: the one place a placement changes. Copies the parameter
        shard when ``param`` changes (counted in :attr:`h2d_bytes` / :attr:`d2h_bytes`), the master
        and its gradient when ``master`` changes (the optimizer state follows at the next step)."""
        old = self.placements[index]
        if placement == old:
            return
        c = self.chunks[index]
        if placement.param is not old.param:
            n = c.move_shard(self._where[placement.param], offloaded=placement.param_offloaded)
            if placement.param is Location.DEVICE:
                self.h2d_bytes += n
            else:
                self.d2h_bytes += n
            self._moved_in_step += n
        if placement.master is not old.master:
            self.master_bytes_moved += c.move_master(self._where[placement.master])
        self.placements[index] = placement

    def synchronize(self) -> None:
        """Wait for the copies in flight (CUDA), so the host may read the shards and masters."""
        if self.device.type == "cuda":
            streams.host_wait(self.device)

    # ------------------------------------------------------------------ steps (ZeroDDP.forward)
    def replans(self, grad_enabled: bool) -> bool:
        """Whether :meth:`before_forward` will adopt a new plan (moving masters: every collective in
        flight must be complete first)."""
        return grad_enabled and self.trace is not None and (self._new_trace or self._replan)

    def before_forward(self, grad_enabled: bool) -> None:
        """A forward begins: with gradients it starts a training step (adopt a new plan, enter the
        step's start set, maybe trace); without, the plan is not followed (chunks stay where they are).

        The caller has completed every collective in flight first when :meth:`replans` said so.

        Raises:
            PlacementBudgetError: the budget cannot hold some access of the trace (from the plan).
        """
        self._on_plan = False
        if not grad_enabled:
            return
        if self.trace is not None and (self._new_trace or self._replan):
            self._adopt(self.trace)
        elif self.plan is not None and self._step_done:
            self._k += 1
        self._in_step, self._step_done, self._pos, self._early = True, False, 0, {}
        self._moved_in_step = 0
        self._tracing = self.plan is None or self._retrace
        if self._tracing:
            self._records, self._forward_records = [], 0
            if self._count_saved:
                self.saved_counter = SavedBytes(self._resident_storages)
        if self.plan is not None:
            self._enter(set(self.plan.step(self._k).resident_at_start))
            self._on_plan = True

    def _adopt(self, trace: PlacementTrace) -> None:
        extra = [a + b + self.resident_bytes for a, b in zip(trace.non_model_bytes, trace.transient_bytes)]
        plan = plan_placement(self.chunk_bytes, trace.access_order, extra, self._budget_bytes, policy=self.policy,
                              optim_state_bytes=self.optim_state_bytes())
        self.plan, self._new_trace, self._replan, self._k = plan, False, False, 0
        optim_host = set(plan.optim_host)
        moved_to_host = False
        for i, p in enumerate(self.placements):
            if p.trainable:
                where = Location.HOST if i in optim_host else Location.DEVICE
                moved_to_host |= where is Location.HOST and p.master is not where
                self.apply(i, dataclasses.replace(p, master=where, grad=where, optim_state=where))
        if moved_to_host:
            self.synchronize()  # the optimizer reads host masters on the CPU

    def _enter(self, start: set[int]) -> None:
        for i, p in enumerate(self.placements):  # evictions first, then prefetches
            if p.param is Location.DEVICE and i not in start and not self.chunks[i].resident:
                self._set_param(i, Location.HOST)
        for i in sorted(start):
            if self.placements[i].param is Location.HOST and not self.chunks[i].resident:
                self._set_param(i, Location.DEVICE)

    def _set_param(self, i: int, where: Location) -> None:
        self.apply(i, dataclasses.replace(self.placements[i], param=where))

    # ------------------------------------------------------------------ the step owner's named points
    def phase_started(self, phase: str) -> None:
        if phase is BACKWARD and self._in_step:
            self._forward_records = len(self._records)
            if self._on_plan and self._pos != self.trace.forward_accesses:
                self._on_plan = False

    def accessed(self, phase: str, chunk: Chunk) -> None:
        if not self._in_step or phase not in (FORWARD, BACKWARD):
            return
        if self._tracing:
            self._records.append(self._measure(chunk))
        if not self._on_plan:
            return
        t, order = self._pos, self.trace.access_order
        if t >= len(order) or order[t] != chunk.index:
            self._on_plan = False
            return
        step = self.plan.step(self._k)
        for i in step.evict[t]:
            self._set_param(i, Location.HOST)
        for i in step.prefetch[t]:
            if self._early.get(i) == t:
                del self._early[i]
            else:
                self._set_param(i, Location.DEVICE)
        self._pos = t + 1

    def gathering(self, chunk: Chunk) -> None:
        """A gather is about to be issued: a chunk on the host that the plan brings to the device at
        its next access, within the prefetch window, moves now (the gather then reads it there)."""
        i = chunk.index
        if not self._on_plan or chunk.resident or self.placements[i].param is Location.DEVICE:
            return
        order, prefetch = self.trace.access_order, self.plan.step(self._k).prefetch
        between: set[int] = set()
        for t in range(self._pos, len(order)):
            if order[t] == i:
                if i in prefetch[t]:
                    self._set_param(i, Location.DEVICE)
                    self._early[i] = t
                return
            between.add(order[t])
            if len(between) > self.prefetch + 1:
                return

    def phase_ended(self, phase: str) -> None:
        if phase is not BACKWARD or not self._in_step:
            return
        self._in_step = False
        self._step_done = self._on_plan and self.plan is not None and self._pos == len(self.trace.access_order)
        self.step_bytes_moved.append(self._moved_in_step)
        orders = self._orders
        recordings = (orders[FORWARD].recordings, orders[BACKWARD].recordings)
        if self._tracing:
            self._tracing = False
            if self.saved_counter is not None:
                self.saved_counter.active = False
                self.saved_counter = None
            self._finish_trace(recordings)
        elif recordings != self._recordings:
            self._retrace = True  # the order changed in this step: trace the next one

    def _finish_trace(self, recordings: tuple[int, int]) -> None:
        nf = self._forward_records
        nb = len(self._records) - nf
        fwd = list(self._orders[FORWARD].previous or []) if nf else []
        bwd = list(self._orders[BACKWARD].previous or []) if nb else []
        if len(fwd) != nf or len(bwd) != nb:
            self._retrace = True  # another pass recorded in between: trace again
            return
        self.trace = PlacementTrace(tuple(fwd + bwd), nf, tuple(r[0] for r in self._records),
                                    tuple(r[1] for r in self._records))
        self._new_trace = True
        self._recordings = recordings
        self._retrace = False
        self.traces += 1

    # ------------------------------------------------------------------ measuring
    def _measure(self, accessed: Chunk) -> tuple[int, int]:
        """``(non-model bytes, transient bytes)`` now (see the module docstring)."""
        transient = 0
        engine_device = 0
        for c in self.chunks:
            for dev, kind, n in chunk_io.bytes_by_kind(c):
                if kind in ("gathered_buffers", "gradients"):
                    transient += n
                if dev.type == self.device.type:
                    engine_device += n
            if c.master is not None and c.master.grad is not None:
                transient -= c.master.grad.numel() * c.master.grad.element_size()
        if not accessed.resident and not (accessed.is_gathered or accessed.gather_in_flight):
            transient += accessed.size * accessed.buffer.element_size()
        if self._count_saved:
            return self.saved_counter.bytes, transient
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is not None:
            engine_device += sum(n for dev, n in opt.state_bytes() if dev.type == "cuda")
        return max(0, torch.cuda.memory_allocated(self.device) - engine_device), transient
