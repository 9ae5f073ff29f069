"""Per-step communication of flat ZeRO-3, hybrid sharding, hpZ and DDP on a two-level network.

The strategies, over ``W = N·G`` ranks (``N`` nodes of ``G`` GPUs, ranks node after node):

- **flat ZeRO-3** (``"zero3"``): every chunk sharded over all ``W`` ranks; per step each sharded chunk
  is all-gathered in forward and again in backward, and its gradient reduce-scattered, over the world.
- **hybrid** (``"hybrid"``, ``shard_group_size=S``, ``R = W/S`` replicas; FSDP2's HSDP, DeepSpeed MiCS,
  Gemini's ``extra_dp_size`` with the groups the other way round): chunks sharded over the ``S``
  contiguous ranks of a **shard group** and replicated over the ``R`` groups. Per chunk the gathers
  and the reduce-scatter run within the shard group (intra-node while ``S ≤ G``), then the gradient
  shard (``size/S`` elements) is all-reduced across the ``R`` **replica group** members holding it
  (inter-node). ``S = W`` is flat ZeRO-3; ``S = 1`` is DDP over chunk buckets.
- **hpZ** (``"hpz"``, ZeRO++, Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication
  for Giant Model Training", §3.2): flat ZeRO-3 whose forward all-gather also keeps a secondary
  partition of ``size/G`` per rank, so the backward all-gather runs within the node.
- **DDP** (``"ddp"``): every rank holds everything; one all-reduce per torch DDP gradient bucket.

Per call, :func:`chunkzero.collective_cost.collective_cost` prices bytes per rank on each level and
time (ring, or hierarchical all-gather / reduce-scatter); a step's time is the sum of its collectives'
(one communication stream; overlap with compute is :func:`hiding_tokens`'s question). Bytes use the
layout's padded chunk sizes: parameters in ``b_param`` bytes for the gathers, gradients in ``b_grad``
for the reductions (:data:`chunkzero.cost.PRECISION_BYTES`). The gradient-norm scalar all-reduce
(4 bytes) is left out.

Compute (``hiding_tokens``): a dense transformer step costs ``6Ψ`` FLOPs per token (forward ``2Ψ``,
backward ``4Ψ``; Kaplan et al. 2020), without activation recomputation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .collective_cost import ALGORITHMS, CollectiveCost, collective_cost
from .cost import _precision, chunk_zero3_cost, ddp_buckets, ddp_cost
from .errors import ConfigError
from .layout import ChunkLayout, TensorSpec

STRATEGIES = ("zero3", "hybrid", "hpz", "ddp")

H200_BF16_FLOPS = 989e12
"""NVIDIA H200 (and H100 SXM) dense bf16 tensor-core peak, FLOP/s."""
H200_HBM_BYTES = 141e9
"""NVIDIA H200 memory, bytes."""


@dataclass(frozen=True)
class Topology:
    """``nodes`` × ``gpus_per_node`` GPUs; per GPU and direction, link bandwidth (bytes/s) and latency (s)
    inside a node (NVLink) and between nodes (the GPU's NIC).

    Raises:
        ConfigError: a count not a positive int, a bandwidth not positive, a latency negative.
    """

    nodes: int
    gpus_per_node: int
    intra_bytes_per_s: float = 450e9
    inter_bytes_per_s: float = 50e9
    intra_latency_s: float = 1e-6
    inter_latency_s: float = 5e-6

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        for name in ("intra_bytes_per_s", "inter_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("intra_latency_s", "inter_latency_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @classmethod
    def from_gbps(cls, nodes: int, gpus_per_node: int, intra_gbps: float = 3600.0, inter_gbps: float = 400.0,
                  intra_latency_us: float = 1.0, inter_latency_us: float = 5.0) -> Topology:
        """Bandwidths in gigabits per second per direction (NVLink 4: 450 GB/s = 3600 Gbit/s), latencies in µs."""
        return cls(nodes, gpus_per_node, intra_gbps * 1e9 / 8, inter_gbps * 1e9 / 8,
                   intra_latency_us * 1e-6, inter_latency_us * 1e-6)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class CollectiveCall:
    """``count`` identical collectives of one step.

    Attributes:
        kind: ``"all-gather"``, ``"reduce-scatter"`` or ``"all-reduce"``.
        group: ``"shard"`` (contiguous ranks) or ``"replica"`` (strided ranks) — the geometry.
        group_size: ranks per group.
        buffer_bytes: the full buffer of one call (all-gather output, reduce-scatter input, all-reduce operand).
        count: how many such calls a step makes.
        label: what the group is (``"world"``, ``"shard"``, ``"node"``, ``"replica"``).
    """

    kind: str
    group: str
    group_size: int
    buffer_bytes: int
    count: int = 1
    label: str = ""


@dataclass(frozen=True)
class StepComm:
    """One strategy's communication per step and rank, on one topology.

    Attributes:
        strategy: one of :data:`STRATEGIES`; ``shard_group_size`` ``S`` and ``replicas`` ``R`` (``S = W``,
            ``R = 1`` for zero3 and hpz; ``S = 1``, ``R = W`` for ddp).
        algorithm: ``"ring"`` or ``"hierarchical"``.
        calls: the step's collectives.
        intra_bytes, inter_bytes: bytes sent per rank per step on each level.
        time_s: communication seconds per step (collectives one after the other).
        model_state_bytes: per-rank parameters, gradients, fp32 master and optimizer states (hpZ: plus
            its secondary partition).
    """

    strategy: str
    world_size: int
    shard_group_size: int
    replicas: int
    algorithm: str
    calls: tuple[CollectiveCall, ...]
    intra_bytes: float
    inter_bytes: float
    time_s: float
    model_state_bytes: int

    @property
    def name(self) -> str:
        return f"hybrid S={self.shard_group_size}" if self.strategy == "hybrid" else self.strategy

    def counts(self) -> dict[tuple[str, int], int]:
        """``{(kind, group_size): collectives per step}``."""
        out: dict[tuple[str, int], int] = {}
        for c in self.calls:
            out[(c.kind, c.group_size)] = out.get((c.kind, c.group_size), 0) + c.count
        return out


# ---------------------------------------------------------------------------- the step's collectives
def hybrid_calls(layout: ChunkLayout, replicas: int, precision: str = "bf16") -> list[CollectiveCall]:
    """The collectives of one hybrid step over ``W = layout.world_size · replicas`` ranks.

    Per sharded chunk of ``size`` elements: 2 all-gathers (forward, backward) of ``size·b_param`` bytes
    over the shard group; if trainable, 1 reduce-scatter of ``size·b_grad`` over it and, when
    ``replicas > 1``, 1 all-reduce of the ``size/S·b_grad`` shard over the replica group. A trainable
    keep-gathered chunk: 1 all-reduce of ``size·b_grad`` over the shard group, then (``replicas > 1``)
    1 over the replica group, as ``ZeroDDP(shard_group_size=S)`` reduces it. Groups of one rank make no call.

    Raises:
        ConfigError: unknown precision, ``replicas`` not a positive int.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be a positive int, got {replicas!r}")
    b_param, b_grad, _ = _precision(precision)
    s = layout.world_size
    calls = []
    for c in layout.chunks:
        if c.keep_gathered:  # the whole chunk, all-reduced within the shard group, then across replicas
            if c.requires_grad and s > 1:
                calls.append(CollectiveCall("all-reduce", "shard", s, c.size * b_grad, 1,
                                            "world" if replicas == 1 else "shard"))
            if c.requires_grad and replicas > 1:
                calls.append(CollectiveCall("all-reduce", "replica", replicas, c.size * b_grad, 1,
                                            "world" if s == 1 else "replica"))
            continue
        label = "world" if replicas == 1 else "shard"
        if s > 1:
            calls.append(CollectiveCall("all-gather", "shard", s, c.size * b_param, 2, label))
            if c.requires_grad:
                calls.append(CollectiveCall("reduce-scatter", "shard", s, c.size * b_grad, 1, label))
        if c.requires_grad and replicas > 1:
            calls.append(CollectiveCall("all-reduce", "replica", replicas, c.size // s * b_grad, 1,
                                        "world" if s == 1 else "replica"))
    return calls


def hpz_calls(layout: ChunkLayout, gpus_per_node: int, precision: str = "bf16") -> list[CollectiveCall]:
    """The collectives of one hpZ step: per sharded chunk the forward all-gather over the world, the
    backward all-gather over the node (the secondary partition, ``min(G, W)`` ranks), the reduce-scatter
    over the world; a keep-gathered chunk all-reduced over the world."""
    b_param, b_grad, _ = _precision(precision)
    w = layout.world_size
    g = min(gpus_per_node, w)
    calls = []
    for c in layout.chunks:
        if c.keep_gathered:  # the whole chunk, all-reduced over the world (flat ZeRO-3)
            if c.requires_grad and w > 1:
                calls.append(CollectiveCall("all-reduce", "shard", w, c.size * b_grad, 1, "world"))
            continue
        if w > 1:
            calls.append(CollectiveCall("all-gather", "shard", w, c.size * b_param, 1, "world"))
            if g > 1:
                calls.append(CollectiveCall("all-gather", "shard", g, c.size * b_param, 1, "node"))
            if c.requires_grad:
                calls.append(CollectiveCall("reduce-scatter", "shard", w, c.size * b_grad, 1, "world"))
    return calls


def ddp_calls(specs: Iterable[TensorSpec], world_size: int, precision: str = "bf16") -> list[CollectiveCall]:
    """One all-reduce over the world per torch DDP gradient bucket (:func:`chunkzero.cost.ddp_buckets`)."""
    _, b_grad, _ = _precision(precision)
    specs = list(specs)
    numel = {s.name: s.numel for s in specs}
    if world_size == 1:
        return []
    return [CollectiveCall("all-reduce", "shard", world_size, sum(numel[n] for n in b) * b_grad, 1, "world")
            for b in ddp_buckets(specs, b_grad)]


# ---------------------------------------------------------------------------- pricing
def price_calls(
    calls: Iterable[CollectiveCall], topology: Topology, algorithm: str = "ring"
) -> tuple[float, float, float]:
    """``(intra_bytes, inter_bytes, time_s)`` per rank of ``calls`` on ``topology`` (summed, one after another).

    Raises:
        ConfigError: an unknown algorithm, or a hierarchical collective over part of several nodes.
    """
    intra = inter = t = 0.0
    w, g = topology.world_size, topology.gpus_per_node
    for c in calls:
        cost: CollectiveCost = collective_cost(c.kind, c.buffer_bytes, c.group, c.group_size, w, g, algorithm)
        intra += c.count * cost.intra_bytes
        inter += c.count * cost.inter_bytes
        t += c.count * cost.time_s(topology.intra_bytes_per_s, topology.inter_bytes_per_s,
                                   topology.intra_latency_s, topology.inter_latency_s)
    return intra, inter, t


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def step_comm(strategy: str, layout: ChunkLayout, topology: Topology, *, specs: Sequence[TensorSpec] | None = None,
              shard_group_size: int | None = None, precision: str = "bf16", optimizer: str = "adam",
              algorithm: str = "ring") -> StepComm:
    """One strategy's :class:`StepComm` on ``topology``.

    Args:
        strategy: one of :data:`STRATEGIES`.
        layout: the chunk packing (any world size: it is relaid out for the shard group, or the world).
        specs: the tensors (needed for ``"ddp"``'s buckets).
        shard_group_size: ``S`` for ``"hybrid"``, dividing the world size.
        precision, optimizer: as :func:`chunkzero.chunk_zero3_cost`.
        algorithm: ``"ring"`` or ``"hierarchical"`` (:mod:`chunkzero.collective_cost`).

    Raises:
        ConfigError: unknown strategy or algorithm; ``S`` missing or not dividing ``W``; ``specs``
            missing for ``"ddp"``.
    """
    w, g = topology.world_size, topology.gpus_per_node
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if strategy == "hybrid":
        s = shard_group_size
        if isinstance(s, bool) or not isinstance(s, int) or s < 1 or w % s:
            raise ConfigError(f"shard_group_size must be a positive divisor of the world size {w}, got {s!r}")
        at_s = layout.relayout(s)
        calls = hybrid_calls(at_s, w // s, precision)
        states = chunk_zero3_cost(at_s, precision, optimizer).model_state_bytes
    elif strategy in ("zero3", "hpz"):
        s = w
        at_w = layout.relayout(w)
        calls = hybrid_calls(at_w, 1, precision) if strategy == "zero3" else hpz_calls(at_w, g, precision)
        states = chunk_zero3_cost(at_w, precision, optimizer).model_state_bytes
        if strategy == "hpz":
            b_param = _precision(precision)[0]
            gg = min(g, w)
            states += sum(c.size // gg * b_param for c in at_w.chunks if not c.keep_gathered)
    elif strategy == "ddp":
        if specs is None:
            raise ConfigError("strategy 'ddp' needs specs= (its gradient buckets)")
        s = 1
        calls = ddp_calls(specs, w, precision)
        states = ddp_cost(specs, w, precision, optimizer).model_state_bytes
    else:
        raise ConfigError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    intra, inter, t = price_calls(calls, topology, algorithm)
    return StepComm(strategy, w, s, w // s, algorithm, tuple(calls), intra, inter, t, states)


def compare_network(specs: Sequence[TensorSpec], topology: Topology, *, layout: ChunkLayout | None = None,
                    precision: str = "bf16", optimizer: str = "adam", algorithm: str = "ring",
                    shard_group_sizes: Sequence[int] | None = None) -> list[StepComm]:
    """Flat ZeRO-3, hybrid at each ``S`` (default: every divisor of ``W`` strictly between 1 and ``W``),
    hpZ and DDP for one model on ``topology``. The chunk layout is searched
    (:func:`chunkzero.search.build_layout` at ``W``) unless given.

    Raises:
        ConfigError: as :func:`step_comm`.
    """
    from .search import build_layout

    specs = list(specs)
    w = topology.world_size
    if layout is None:
        layout = build_layout(specs, w)
    sizes = [d for d in divisors(w) if 1 < d < w] if shard_group_sizes is None else list(shard_group_sizes)
    rows = [step_comm("zero3", layout, topology, precision=precision, optimizer=optimizer, algorithm=algorithm)]
    rows += [step_comm("hybrid", layout, topology, shard_group_size=s, precision=precision, optimizer=optimizer,
                       algorithm=algorithm) for s in sizes]
    rows.append(step_comm("hpz", layout, topology, precision=precision, optimizer=optimizer, algorithm=algorithm))
    rows.append(step_comm("ddp", layout, topology, specs=specs, precision=precision, optimizer=optimizer,
                          algorithm=algorithm))
    return rows


# ---------------------------------------------------------------------------- compute
def compute_time_s(param_numel: int, tokens: float, peak_flops: float = H200_BF16_FLOPS, mfu: float = 0.4) -> float:
    """Seconds of one step's compute: ``6·Ψ·tokens / (peak_flops·mfu)`` (``tokens`` per GPU per step).

    Raises:
        ConfigError: ``mfu`` not in (0, 1], a non-positive ``peak_flops``.
    """
    if not 0 < mfu <= 1 or not peak_flops > 0:
        raise ConfigError(f"need 0 < mfu <= 1 and peak_flops > 0, got mfu={mfu!r}, peak_flops={peak_flops!r}")
    return 6 * param_numel * tokens / (peak_flops * mfu)


def hiding_tokens(comm_s: float, param_numel: int, peak_flops: float = H200_BF16_FLOPS, mfu: float = 0.4) -> float:
    """Tokens per GPU per step whose compute takes as long as ``comm_s``: with fewer, communication
    cannot hide behind compute even with perfect overlap (the inverse of :func:`compute_time_s`)."""
    return comm_s * peak_flops * mfu / (6 * param_numel)


# ---------------------------------------------------------------------------- table
def format_network_table(rows: Iterable[StepComm], param_numel: int | None = None,
                         *, tokens_per_gpu: float | None = None, peak_flops: float = H200_BF16_FLOPS,
                         mfu: float = 0.4, hbm_bytes: float | None = None) -> str:
    """A markdown table: per strategy ``S``, ``R``, collectives per step, MB per rank on each level, the
    communication time, model states per rank, and (``param_numel`` given) the tokens per GPU per step
    that hide it; with ``tokens_per_gpu`` also whether the step is communication-bound there.
    ``hbm_bytes`` marks the model states that do not fit (✗)."""
    head = ["strategy", "S", "R", "collectives", "intra-node MB", "inter-node MB", "comm ms", "model states GB"]
    if param_numel is not None:
        head.append("tokens/GPU to hide")
        if tokens_per_gpu is not None:
            head.append(f"bound at {tokens_per_gpu:,.0f} tok/GPU")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        fits = "" if hbm_bytes is None or r.model_state_bytes <= hbm_bytes else " ✗"
        cells = [r.name, str(r.shard_group_size), str(r.replicas), str(sum(c.count for c in r.calls)),
                 f"{r.intra_bytes / 1e6:,.1f}", f"{r.inter_bytes / 1e6:,.1f}", f"{r.time_s * 1e3:,.2f}",
                 f"{r.model_state_bytes / 1e9:,.2f}{fits}"]
        if param_numel is not None:
            cells.append(f"{hiding_tokens(r.time_s, param_numel, peak_flops, mfu):,.0f}")
            if tokens_per_gpu is not None:
                bound = r.time_s > compute_time_s(param_numel, tokens_per_gpu, peak_flops, mfu)
                cells.append("communication" if bound else "compute")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["CollectiveCall", "H200_BF16_FLOPS", "H200_HBM_BYTES", "STRATEGIES", "StepComm", "Topology",
           "compare_network", "compute_time_s", "ddp_calls", "divisors", "format_network_table", "hiding_tokens",
           "hpz_calls", "hybrid_calls", "price_calls", "step_comm"]
