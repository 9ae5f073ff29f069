"""The memory plan of a ZeroDDP run: each rank's predicted peak, term by term, before anything starts.

The arithmetic lives here (the standard library only); what needs the model — its tensors and the
activations of one traced forward and backward — comes from a backend (``torch_backend.plan``), as an
:class:`ActivationTrace`. A figure is bytes per rank.

The peak is the largest of three phases:

- **build**: the interpreter baseline, the whole fp32 model as the job builds it on every rank (and, for
  the byte-level GPT, its numpy initial values beside it), and this rank's chunk shards;
- **step**: the baseline; the persistent shards (parameters, fp32 master, optimizer states, EMA); and, at
  each moment of one traced forward and backward (and of the optimizer step), the activations then alive,
  the fp32 gradient shards of the parameters whose gradients have arrived, the gathered chunks (up to
  ``prefetch + 2`` of the largest; in backward only those whose gradients are still to come), the
  full-chunk gradient buffers (simulated chunk by chunk from the traced order of gradient arrivals; every
  chunk's under gradient accumulation, where ``no_sync`` keeps them) and, on CPU, gloo's all-to-all receive
  buffer of each reduction in flight. The allocator's overhead is a share of what is allocated
  (:data:`ALLOCATOR_OVERHEAD`);
- **save**, in a run that saves or loads checkpoints: the step phase (with Orbax's libraries,
  :data:`CHECKPOINT_LIBRARY_BYTES`, there from the first save or load on) and a host copy of the persistent
  shards, which an asynchronous save stages and holds while the next steps run, until its write ends.

On a GPU the same terms are split between the device (what is placed there) and the host (the
baseline, the build, and what the offload fractions move to the host).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from .cost import FP32_BYTES, PRECISION_BYTES
from .errors import ConfigError
from .layout import ChunkLayout

TERMS = ("baseline", "parameters", "gradients", "fp32_master", "optimizer_states", "ema", "gathered_chunks",
         "gradient_buffers", "activations", "communication_buffers", "checkpoint_io", "allocator_overhead")
"""The terms of a plan, in the order they are printed; ``build`` replaces the step's model terms in the
build phase (the whole model, as the job builds it)."""

CPU_BASELINE_BYTES = 377 * 2**20
"""What a CPU worker of ``chunkzero train`` holds besides its model: the interpreter, torch, gloo's process
group, the job's modules and the default corpus (12 MB of tokens): the peak RSS of a ``gpt-tiny`` run, less
the 6 MiB its model's terms are planned at (``docs/memory_plan.md``)."""
CUDA_HOST_BASELINE_BYTES = 1200 * 2**20
"""... and of a CUDA worker on the host (CUDA's libraries and context)."""
CUDA_DEVICE_BASELINE_BYTES = 600 * 2**20
"""The CUDA context and cuBLAS workspace on the device, outside ``max_memory_allocated``."""
ALLOCATOR_OVERHEAD = {"host": 0.02, "device": 0.05}
"""The allocator's share on top of what is allocated: on the host glibc's page rounding (the workers' buffers
of 1 MiB or more are their own mappings, returned when freed: ``torch_backend.train.launch``), on a GPU the
CUDA caching allocator's rounding to its block sizes."""
CHECKPOINT_LIBRARY_BYTES = 151 * 2**20
"""What a worker's first checkpoint save or load adds to its host memory beyond the data: Orbax, JAX and
TensorStore imported, their thread pools (a ``gpt-tiny`` run's peak RSS with and without ``--save-interval``
at W = 2 on this machine: 482 against 331 MiB)."""
PERSISTENT_TERMS = ("parameters", "fp32_master", "optimizer_states", "ema")
"""The terms a checkpoint saves: a save stages a host copy of them (``gpt2`` at W = 2, 1 × 64 tokens, fp32 and
bf16: 1,507 MiB per rank with a save against 1,065 and 1,038 without), held until its asynchronous write ends,
so on a slow write into the next step's peak (``gpt2``, 2 × 256 tokens, a save every step: 1,617 MiB measured
on an idle machine, 1,774 under a test run's load)."""
GATHERED_EXTRA_CHUNKS = 2
"""Gathered chunks beyond ``prefetch``: the chunk in use and the one being released
(``ZeroDDP.memory_report().peak_gathered_chunks`` of gpt2 at W = 2, prefetch 1: 3 with 5 chunks, 4 with 43)."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"``, ``"1e9"`` -> bytes.

    Raises:
        ConfigError: not a positive size with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"expected a size such as 80GiB or 512MB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ActivationTrace:
    """What one traced forward and backward of the model holds, per rank (its micro-batch).

    Attributes:
        live_bytes: after each traced op, the bytes of the tensors the op created that are still alive
            (activations saved for backward and the temporaries of the moment; parameters and their
            ``.grad`` excluded), in the compute dtype.
        grad_arrived_numel: after each op, the parameter elements whose gradient has arrived so far.
        grad_events: ``(op index, tensor name)`` as each parameter's final gradient arrives, in order.
        batch_size, seq_len: the traced micro-batch (sequences, tokens).
        activation_checkpointing: whether each block was recomputed in backward.
    """

    live_bytes: tuple[int, ...]
    grad_arrived_numel: tuple[int, ...]
    grad_events: tuple[tuple[int, str], ...]
    batch_size: int
    seq_len: int
    activation_checkpointing: bool = False

    @property
    def peak_bytes(self) -> int:
        return max(self.live_bytes, default=0)


@dataclass(frozen=True)
class PlanSettings:
    """The settings a plan depends on (``chunkzero train``'s, resolved).

    Attributes:
        world_size: W; shard_group_size: S (``None``: W); precision: ``"fp32"``, ``"bf16"``, ``"fp16"``;
        prefetch: chunks gathered ahead; offload_optim_frac / offload_param_frac: the share of chunks whose
        master, gradient and optimizer state / parameter shard live on the host (GPU only); batch_size,
        seq_len, grad_accum: one rank's micro-batch and micro-batches per step; activation_checkpointing;
        ema: an fp32 EMA of the masters; device: ``"cpu"`` or ``"cuda"``; build_copies: whole fp32 copies of the
        model a rank holds while it is built (2: the byte-level GPT and its numpy initial values; 1: a
        module built on CPU; 0: built on the meta device and materialized chunk by chunk); checkpoints: the
        run saves or loads checkpoints (``--save-interval``, ``--resume``): the save phase.
    """

    world_size: int
    precision: str = "fp32"
    shard_group_size: int | None = None
    prefetch: int = 1
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    activation_checkpointing: bool = False
    ema: bool = False
    device: str = "cpu"
    build_copies: int = 2
    checkpoints: bool = False

    def __post_init__(self):
        if self.precision not in PRECISION_BYTES:
            raise ConfigError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {self.precision!r}")
        for name in ("offload_optim_frac", "offload_param_frac"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's predicted peak, term by term (bytes).

    Attributes:
        settings: what was planned.
        host: ``{term: bytes}`` on the host at the host's peak phase; device: the same on the GPU
            (``None`` on CPU).
        host_phase, device_phase: ``"build"``, ``"step"`` or (host) ``"save"``, the phase of each peak.
        num_chunks, chunk_size, param_numel: the layout planned.
    """

    settings: PlanSettings
    host: dict[str, int]
    device: dict[str, int] | None
    host_phase: str
    device_phase: str | None
    num_chunks: int
    chunk_size: int
    param_numel: int

    @property
    def host_peak_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def device_peak_bytes(self) -> int | None:
        return None if self.device is None else sum(self.device.values())

    @property
    def peak_bytes_per_rank(self) -> int:
        """The peak of the memory that training runs in: the GPU's on CUDA, the host's on CPU."""
        return self.host_peak_bytes if self.device is None else self.device_peak_bytes

    def without(self, *terms: str) -> MemoryPlan:
        """This plan with ``terms`` set to 0 (what a plan that forgot them would say; tests use it)."""
        def drop(per):
            return None if per is None else {k: 0 if k in terms else v for k, v in per.items()}

        return replace(self, host=drop(self.host), device=drop(self.device))

    def as_dict(self) -> dict:
        """Plain data for ``--json`` and ``summary.json``."""
        return {"peak_bytes_per_rank": self.peak_bytes_per_rank, "host_peak_bytes": self.host_peak_bytes,
                "device_peak_bytes": self.device_peak_bytes, "host_phase": self.host_phase,
                "device_phase": self.device_phase, "host": dict(self.host), "device": self.device,
                "num_chunks": self.num_chunks, "chunk_size": self.chunk_size, "param_numel": self.param_numel,
                "settings": vars(self.settings).copy()}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _gradient_buffers(layout: ChunkLayout, trace: ActivationTrace, in_flight: int, b_grad: int,
                      overlap: bool) -> tuple[list[int], list[int], list[int]]:
    """After each traced op, the bytes of full-chunk gradient buffers held and of their reductions' receive
    buffers, and the trainable chunks not yet complete: a chunk's buffer from its first gradient's arrival;
    once all its tensors' gradients arrived it is reduced (and its gathered buffer released), up to
    ``in_flight`` reductions at once (the oldest completes, freeing its buffers, when another starts) where
    they ``overlap`` the next chunk's gradients (NCCL), else (gloo on CPU) before the next chunk's buffer is
    taken; the last complete at the end of the backward."""
    remaining = {c.index: len(layout.chunk_tensors(c.index)) for c in layout.chunks if c.requires_grad}
    size = {c.index: c.size * b_grad for c in layout.chunks}
    held, reducing, out_held, out_ex, out_open = 0, [], [], [], []
    events = iter(trace.grad_events)
    nxt = next(events, None)
    for i in range(len(trace.live_bytes)):
        while nxt is not None and nxt[0] <= i:
            c = layout.tensor(nxt[1]).chunk
            if remaining[c] == len(layout.chunk_tensors(c)):
                if not overlap:  # the round that starts this chunk waits for the reductions in flight
                    held -= sum(size[r] for r in reducing)
                    reducing.clear()
                held += size[c]
            remaining[c] -= 1
            if remaining[c] == 0:
                reducing.append(c)
                if len(reducing) > in_flight:
                    held -= size[reducing.pop(0)]
            nxt = next(events, None)
        out_held.append(held)
        out_ex.append(sum(size[c] for c in reducing))
        out_open.append(sum(1 for n in remaining.values() if n))
    return out_held, out_ex, out_open


def _allocator_overhead(per: dict[str, int], kind: str) -> int:
    """:data:`ALLOCATOR_OVERHEAD`'s share (``kind``: ``"host"`` or ``"device"``) of what ``per`` allocates."""
    return int(ALLOCATOR_OVERHEAD[kind] * sum(v for k, v in per.items() if k not in ("baseline", "allocator_overhead")))


def plan_memory(layout: ChunkLayout, trace: ActivationTrace, settings: PlanSettings, *,
                baseline_bytes: int | None = None, device_baseline_bytes: int | None = None) -> MemoryPlan:
    """Each rank's predicted peak of a ZeroDDP run of ``layout`` (at the shard group's world size) whose
    micro-batch's forward and backward is ``trace``.

    Args:
        layout: the chunk layout at the shard group size (S, or W).
        trace: the activations of one micro-batch on one rank.
        settings: the run's settings.
        baseline_bytes: the host baseline (default :data:`CPU_BASELINE_BYTES` or
            :data:`CUDA_HOST_BASELINE_BYTES`); device_baseline_bytes: the GPU's (default
            :data:`CUDA_DEVICE_BASELINE_BYTES`).

    Raises:
        ConfigError: a trace of another micro-batch than ``settings``', or bad settings.
    """
    s = settings
    if (trace.batch_size, trace.seq_len, trace.activation_checkpointing) != (s.batch_size, s.seq_len,
                                                                              s.activation_checkpointing):
        raise ConfigError(f"the activation trace is of batch {trace.batch_size} x {trace.seq_len} (checkpointing "
                          f"{trace.activation_checkpointing}), the settings' {s.batch_size} x {s.seq_len} "
                          f"({s.activation_checkpointing})")
    b_param, b_grad, _ = PRECISION_BYTES[s.precision]
    mixed = s.precision != "fp32"
    cuda = s.device == "cuda"
    w = layout.world_size
    trainable = [c for c in layout.chunks if c.requires_grad]
    n_trainable = max(1, len(trainable))
    n_optim_off = round(s.offload_optim_frac * len(trainable)) if cuda else 0
    n_param_off = round(s.offload_param_frac * len(layout.chunks)) if cuda else 0
    dev: dict[str, int] = dict.fromkeys(TERMS, 0)
    host: dict[str, int] = dict.fromkeys(TERMS, 0)
    # persistent shards: the last chunks are offloaded first (the static placement's order)
    for i, c in enumerate(layout.chunks):
        shard = layout.shard_numel(c.index)
        optim_on_host = c.requires_grad and trainable.index(c) >= len(trainable) - n_optim_off
        param_on_host = i >= len(layout.chunks) - n_param_off
        where_param = host if param_on_host or not cuda else dev
        where_state = host if optim_on_host or not cuda else dev
        if not c.requires_grad:
            where_param["parameters"] += shard * b_param
            continue
        # fp32: the master is the parameter; mixed: no low-precision copy while the master is on the device
        if not mixed:
            where_state["parameters"] += shard * FP32_BYTES
        else:
            where_state["fp32_master"] += shard * FP32_BYTES
            if optim_on_host or param_on_host or c.keep_gathered:
                where_param["parameters"] += shard * b_param
        where_state["optimizer_states"] += 2 * shard * FP32_BYTES
        where_state["ema"] += shard * FP32_BYTES if s.ema else 0
    sharded = [c.size for c in layout.chunks if not c.keep_gathered]
    gathered_max = min(len(sharded), s.prefetch + GATHERED_EXTRA_CHUNKS)
    full_grads = sum(c.size for c in trainable) * b_grad
    buffers, exchanges, still_open = _gradient_buffers(layout, trace, max(1, s.prefetch), b_grad, overlap=cuda)
    exchanges = exchanges if not cuda and w > 1 else [0] * len(exchanges)  # gloo's all-to-all receive buffer
    # the fp32 gradient shards of the parameters whose gradients arrived, moment by moment
    shard_fraction = sum(layout.shard_numel(c.index) for c in trainable) / max(1, sum(c.utilized for c in trainable))
    offloaded_grads = n_optim_off / n_trainable
    all_grads = sum(layout.shard_numel(c.index) for c in trainable) * FP32_BYTES
    # gathered: in backward only the chunks whose gradients are still to come (a complete chunk is released)
    moments = [(act, arrived * shard_fraction * FP32_BYTES, buf, ex,
                min(gathered_max, n_open) * max(sharded, default=0) * b_param)
               for act, arrived, buf, ex, n_open in zip(trace.live_bytes, trace.grad_arrived_numel, buffers, exchanges,
                                                         still_open)]
    if s.grad_accum > 1:  # no_sync keeps every chunk's full gradient until the last micro-batch's reduction
        moments = [(act, grads, full_grads, ex, gathered) for act, grads, _, ex, gathered in moments]
    moments.append((0, all_grads, 0, 0, 0))  # the optimizer step: every gradient shard, no activations
    best, best_terms = -1, {}
    for act, grads, buf, ex, gathered in moments:
        terms = {"activations": int(act), "gradients": int(grads * (1 - offloaded_grads)),
                 "gathered_chunks": gathered, "gradient_buffers": buf, "communication_buffers": ex}
        if sum(terms.values()) > best:
            best, best_terms = sum(terms.values()), terms
    step = dev if cuda else host
    step.update(best_terms)
    host["gradients"] += int(all_grads * offloaded_grads) if cuda else 0
    base_host = baseline_bytes if baseline_bytes is not None else (CUDA_HOST_BASELINE_BYTES if cuda
                                                                     else CPU_BASELINE_BYTES)
    host["baseline"] = base_host
    host["checkpoint_io"] = CHECKPOINT_LIBRARY_BYTES if s.checkpoints else 0
    if cuda:
        dev["baseline"] = device_baseline_bytes if device_baseline_bytes is not None else CUDA_DEVICE_BASELINE_BYTES
    for name, per in (("host", host), ("device", dev)):
        per["allocator_overhead"] = _allocator_overhead(per, name)
    # the build phase (host): the whole model's fp32 copies beside the shards
    whole = layout.utilized_numel * FP32_BYTES * s.build_copies
    shards = sum(host[k] for k in ("parameters", "fp32_master")) if not cuda else 0
    build = {**dict.fromkeys(TERMS, 0), "baseline": base_host, "build": whole + shards}
    phases = [("step", host), ("build", build)]
    if s.checkpoints:  # an asynchronous save: its staged copy of the shards lives on into the next step's peak
        saved = sum(per[k] for per in (host, dev) for k in PERSISTENT_TERMS)
        save = {**host, "checkpoint_io": CHECKPOINT_LIBRARY_BYTES + saved}
        save["allocator_overhead"] = _allocator_overhead(save, "host")
        phases.append(("save", save))
    host_phase, host = max(phases, key=lambda phase: sum(phase[1].values()))
    return MemoryPlan(s, host, dev if cuda else None, host_phase, "step" if cuda else None,
                      len(layout.chunks), layout.chunk_size, layout.utilized_numel)


def format_plan(plan: MemoryPlan, title: str = "") -> str:
    """The plan as a table: one row per term, MiB on the host (and the GPU), the peak last."""
    mib = 2**20
    cols = [("host", plan.host)] + ([("gpu", plan.device)] if plan.device is not None else [])
    lines = [title] if title else []
    lines += ["| term | " + " | ".join(f"{name} (MiB)" for name, _ in cols) + " |",
              "|---|" + "---:|" * len(cols)]
    names = list(TERMS) + (["build"] if "build" in plan.host else [])
    for term in names:
        if any(per.get(term, 0) for _, per in cols):
            lines.append(f"| {term.replace('_', ' ')} | " + " | ".join(f"{per.get(term, 0) / mib:,.1f}"
                                                                     for _, per in cols) + " |")
    lines.append("| **peak per rank** | " + " | ".join(f"**{sum(per.values()) / mib:,.1f}**" for _, per in cols)
                 + " |")
    phases = f"host peak in the {plan.host_phase} phase" + (f", GPU peak in the {plan.device_phase} phase"
                                                             if plan.device is not None else "")
    lines.append(f"\n{plan.num_chunks} chunks of {plan.chunk_size:,} elements, {plan.param_numel:,} parameters; "
                 f"{phases}")
    return "\n".join(lines)


# ================================================================================ fitting a budget

@dataclass(frozen=True)
class Candidate:
    """A setting the fit search tried: its plan and predicted step time (seconds)."""

    settings: PlanSettings
    plan: MemoryPlan
    step_time_s: float

    def zero_ddp_kwargs(self) -> dict:
        """The ``ZeroDDP`` keyword arguments of this setting."""
        s = self.settings
        kw = {"mixed_precision": s.precision, "prefetch": s.prefetch, "chunk_size": self.plan.chunk_size}
        if s.shard_group_size not in (None, s.world_size):
            kw["shard_group_size"] = s.shard_group_size
        if s.offload_optim_frac or s.offload_param_frac:
            kw.update(placement="static", offload_optim_frac=s.offload_optim_frac,
                      offload_param_frac=s.offload_param_frac)
        return kw

    def describe(self, base: PlanSettings) -> str:
        """What differs from ``base``, as ``chunkzero train`` flags."""
        s, parts = self.settings, []
        if (s.batch_size, s.grad_accum) != (base.batch_size, base.grad_accum):
            parts.append(f"--batch-size {s.batch_size} --grad-accum {s.grad_accum}")
        if s.activation_checkpointing and not base.activation_checkpointing:
            parts.append("--activation-checkpointing")
        if s.offload_optim_frac != base.offload_optim_frac:
            parts.append(f"--offload-optim-frac {s.offload_optim_frac:g}")
        if s.offload_param_frac != base.offload_param_frac:
            parts.append(f"--offload-param-frac {s.offload_param_frac:g}")
        if s.world_size != base.world_size:
            parts.append(f"--nproc {s.world_size}")
        return " ".join(parts) or "(as given)"


HOST_LINK_BYTES_PER_S = 25e9
"""Host <-> GPU bandwidth the offload's copies run at (PCIe 4.0 x16, one direction), bytes/s."""


def step_time_s(plan: MemoryPlan, comm_s: float, flops_per_s: float) -> float:
    """A step's predicted seconds: compute (``6·Ψ·tokens`` FLOPs per rank, ``8·Ψ·tokens`` with activation
    checkpointing's second forward, at ``flops_per_s``) or communication (``comm_s`` for one micro-batch's
    gathers and the step's reduce-scatter, the gathers again for each further micro-batch), whichever is
    longer (overlapped), plus the offloaded shards' copies over the host link (no overlap)."""
    s = plan.settings
    tokens = s.batch_size * s.seq_len * s.grad_accum
    compute = (8 if s.activation_checkpointing else 6) * plan.param_numel * tokens / flops_per_s
    comm = comm_s * (1 + 2 / 3 * (s.grad_accum - 1))  # a micro-batch's gathers are 2/3 of ZeRO-3's bytes
    moved = (s.offload_optim_frac * plan.param_numel / (s.shard_group_size or s.world_size) * 2 * 4
             + s.offload_param_frac * plan.param_numel * PRECISION_BYTES[s.precision][0] * 2 * s.grad_accum)
    return max(compute, comm) + moved / HOST_LINK_BYTES_PER_S


def candidates(base: PlanSettings, *, max_world_size: int | None = None) -> list[list[PlanSettings]]:
    """The settings the fit search tries around ``base``, keeping the tokens per step, as ladders: each
    ladder one choice of world size (doubled up to ``max_world_size``, the tokens per rank halved with it),
    activation checkpointing (as given, and on) and offload fractions (GPU only: 0, 0.25, 0.5, 0.75, 1 of
    the optimizer, the parameters' too at full optimizer offload), its rungs the batch per rank halved
    (gradient accumulation raised) down to 1."""
    worlds = [base.world_size]
    while max_world_size and worlds[-1] * 2 <= max_world_size:
        worlds.append(worlds[-1] * 2)
    fracs = [(f, 0.0) for f in (0.0, 0.25, 0.5, 0.75, 1.0)] + [(1.0, 1.0)] if base.device == "cuda" else [(0.0, 0.0)]
    group = base.shard_group_size if base.shard_group_size not in (None, base.world_size) else None
    ladders = []
    for w in worlds:
        tokens_rank = base.batch_size * base.grad_accum * base.world_size / w
        for ac in dict.fromkeys((base.activation_checkpointing, True)):
            for optim_frac, param_frac in fracs:
                ladder, b = [], base.batch_size
                while b >= 1:
                    ladder.append(replace(base, world_size=w, shard_group_size=group, batch_size=b,
                                          grad_accum=max(1, math.ceil(tokens_rank / b)), activation_checkpointing=ac,
                                          offload_optim_frac=max(base.offload_optim_frac, optim_frac),
                                          offload_param_frac=max(base.offload_param_frac, param_frac)))
                    b //= 2
                ladders.append(ladder)
    return ladders


def fit(base: PlanSettings, plan_of: Callable[[PlanSettings], MemoryPlan], fits: Callable[[MemoryPlan], bool],
        comm_s_of: Callable[[PlanSettings], float], flops_per_s: float, *,
        max_world_size: int | None = None) -> tuple[Candidate | None, list[Candidate]]:
    """The fastest predicted setting (:func:`step_time_s`) among :func:`candidates` whose plan ``fits``
    (e.g. ``lambda p: p.peak_bytes_per_rank <= budget``), and the fitting candidates found, fastest first.
    Of each ladder only its largest batch that fits is a candidate (a smaller one holds fewer activations
    but runs more micro-batches), found by bisection: the peak grows with the batch. ``plan_of`` plans a
    setting, ``comm_s_of`` prices its communication (seconds per step)."""
    found = []
    for ladder in candidates(base, max_world_size=max_world_size):
        lo, hi = 0, len(ladder)  # the first rung that fits lies in [lo, hi]; hi: none does
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(plan_of(ladder[mid])):
                hi = mid
            else:
                lo = mid + 1
        if hi < len(ladder):
            p = plan_of(ladder[hi])
            found.append(Candidate(ladder[hi], p, step_time_s(p, comm_s_of(ladder[hi]), flops_per_s)))
    found.sort(key=lambda c: (c.step_time_s, c.plan.peak_bytes_per_rank))
    return (found[0] if found else None), found


def nearest(base: PlanSettings, fitting: list[Candidate], count: int = 3) -> list[Candidate]:
    """Of the ``fitting`` candidates, the ``count`` that change fewest of ``base``'s settings (batch and
    accumulation, checkpointing, offload, world size), fastest first among equals, one per description."""
    def changes(c: Candidate) -> int:
        s = c.settings
        return sum(((s.batch_size, s.grad_accum) != (base.batch_size, base.grad_accum),
                    s.activation_checkpointing != base.activation_checkpointing,
                    (s.offload_optim_frac, s.offload_param_frac) != (base.offload_optim_frac, base.offload_param_frac),
                    s.world_size != base.world_size))
    out, seen = [], set()
    for c in sorted(fitting, key=lambda c: (changes(c), c.step_time_s)):
        kinds = (c.settings.world_size != base.world_size, c.settings.activation_checkpointing,
                 c.settings.offload_optim_frac > 0)
        if kinds not in seen:
            seen.add(kinds)
            out.append(c)
    return out[:count]


def refusal(plan: MemoryPlan, needed_bytes: int, available_bytes: int, where: str, fitting: list[Candidate]) -> str:
    """The one line ``chunkzero train`` refuses a run with: the predicted peak per rank, what the run needs
    of ``where`` (``needed_bytes``: all local ranks on a CPU), what it has, and the ``fitting`` settings
    (at most three) or that none does."""
    fits = "; ".join(f"{c.describe(plan.settings)} ({_gib(c.plan.peak_bytes_per_rank)} per rank)"
                     for c in fitting[:3])
    return (f"predicted peak {_gib(plan.peak_bytes_per_rank)} per rank ({_gib(needed_bytes)} needed) does not fit the "
            f"{_gib(available_bytes)} {where}; "
            + (f"nearest settings that fit: {fits}" if fits else "no setting tried fits")
            + "; --force starts it anyway")


__all__ = ["ALLOCATOR_OVERHEAD", "CPU_BASELINE_BYTES", "TERMS", "ActivationTrace", "Candidate", "MemoryPlan",
           "PlanSettings", "candidates", "fit", "format_plan", "nearest", "parse_bytes", "plan_memory", "refusal",
           "step_time_s"]
