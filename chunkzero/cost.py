"""Memory and communication cost model: chunk ZeRO-3 vs per-parameter FSDP vs DDP.

All figures are **per rank** (every rank holds equal shards) and **per training step** (one forward,
one backward, one optimizer step, no gradient accumulation). Bytes are bytes; element counts end in
``_numel``.

Model-state memory follows the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", §3 and §5): with ``Ψ`` parameters, mixed-precision Adam
holds ``2Ψ`` (fp16/bf16 parameters) ``+ 2Ψ`` (fp16/bf16 gradients) ``+ KΨ`` (fp32 master copy,
momentum and variance: ``K = 12``), i.e. ``16Ψ`` bytes replicated by DDP, and ``16Ψ/N_d`` per rank
with ZeRO stage 3 over ``N_d`` ranks. Here the per-element bytes are

- parameter ``b_param``: 4 (fp32) or 2 (bf16/fp16); gradient ``b_grad`` the same;
- fp32 master: 4 for bf16/fp16, 0 for fp32 (the parameter is its own master);
- optimizer states: 4 per fp32 state — Adam/AdamW 2 states (8 bytes), SGD with momentum 1 (4 bytes).

So fp32 and mixed-precision Adam are both ``16`` bytes per element; the layouts differ in how
many elements each rank stores (shards, padding) and in what they communicate.

Communication uses ring collectives over ``n = W`` ranks (Patarasuk & Yuan 2009; the ZeRO paper's
accounting): an all-gather or a reduce-scatter of an ``S``-element buffer moves ``(n−1)/n·S·b`` bytes
per rank, an all-reduce ``2(n−1)/n·S·b``. ZeRO-3 per step: all-gather parameters in forward and again in
backward, reduce-scatter gradients: ``(n−1)/n·Ψ·(2·b_param + b_grad)`` bytes — ``3Ψ`` elements'
worth vs DDP's all-reduce ``2Ψ`` (ZeRO paper §7.2.2: 1.5× DDP).

Precision accounting is the same for all three strategies, so differences come from the layout
only. (PyTorch FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)`` actually keeps the fp32 shard
as the parameter and casts it for the all-gather; its fp32 parameter + fp32 gradient shard are the
same 8 bytes per element as bf16 parameter + bf16 gradient + fp32 master here.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from .errors import ConfigError
from .layout import ChunkLayout, TensorSpec

PRECISION_BYTES: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 0),
    "bf16": (2, 2, 4),
    "fp16": (2, 2, 4),
}
"""``precision -> (b_param, b_grad, b_master)`` bytes per element."""

OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 1}
"""fp32 optimizer states per element: Adam/AdamW (momentum, variance) 2; SGD with momentum 1."""

FP32_BYTES = 4
DDP_BUCKET_CAP_BYTES = 25 * 2**20
"""``torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)``: 25 MiB gradient buckets."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""torch DDP's first bucket cap (``dist._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB)."""


def _precision(precision: str) -> tuple[int, int, int]:
    try:
        return PRECISION_BYTES[precision]
    except (KeyError, TypeError):
        raise ConfigError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}") from None


def _num_states(optimizer: str | int) -> int:
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer
    try:
        return OPTIMIZER_STATES[str(optimizer).lower()]
    except KeyError:
        raise ConfigError(
            f"optimizer must be one of {sorted(OPTIMIZER_STATES)} or a state count >= 0, got {optimizer!r}"
        ) from None


def _world(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _ring(world_size: int) -> float:
    """``(n−1)/n``: the fraction of a buffer each rank sends in a ring all-gather / reduce-scatter."""
    return (world_size - 1) / world_size


def _allreduce_bytes(buffer_bytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``buffer_bytes``: ``2(n−1)/n·buffer``, rounded."""
    return round(2 * (world_size - 1) * buffer_bytes / world_size)


@dataclass(frozen=True)
class StrategyCost:
    """Per-rank memory and per-step communication of one strategy.

    Attributes:
        strategy: ``"chunk-zero3"``, ``"fsdp"`` or ``"ddp"``.
        world_size, precision, optimizer: the setting.
        param_numel: model parameters ``Ψ`` (tied once).
        stored_numel: parameter elements this rank stores (its shards, padding included; ``Ψ`` for DDP).
        padding_numel: padding elements summed over all ranks (``W·stored − Ψ`` for sharded strategies).
        param_bytes: persistent parameters (low-precision shards; fp32 for ``"fp32"``).
        grad_bytes: persistent gradients (shards after reduce-scatter; full for DDP / keep-gathered).
        master_bytes: fp32 master shards (0 for ``"fp32"``).
        optimizer_state_bytes: fp32 optimizer states.
        peak_gathered_bytes: transient gathered buffers at their peak — the largest ``1 + prefetch``
            gather units' parameters plus one full-size gradient buffer of the largest unit before its
            reduce-scatter (an upper bound; all units when not resharding after forward).
        allgather_bytes, reduce_scatter_bytes, allreduce_bytes: bytes each rank sends per step.
        num_allgathers, num_reduce_scatters, num_allreduces: collectives issued per step.
        num_units: gather units (chunks, FSDP groups, DDP buckets).
    """

    strategy: str
    world_size: int
    precision: str
    optimizer: str
    param_numel: int
    stored_numel: int
    padding_numel: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    peak_gathered_bytes: int
    allgather_bytes: int
    reduce_scatter_bytes: int
    allreduce_bytes: int
    num_allgathers: int
    num_reduce_scatters: int
    num_allreduces: int
    num_units: int

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + master + optimizer states (the ZeRO paper's model states)."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_state_bytes

    @property
    def peak_bytes(self) -> int:
        """``model_state_bytes + peak_gathered_bytes`` (activations not included)."""
        return self.model_state_bytes + self.peak_gathered_bytes

    @property
    def comm_bytes(self) -> int:
        """All bytes a rank sends per step."""
        return self.allgather_bytes + self.reduce_scatter_bytes + self.allreduce_bytes

    @property
    def num_collectives(self) -> int:
        return self.num_allgathers + self.num_reduce_scatters + self.num_allreduces

    def as_row(self) -> dict:
        """A flat dict of every field and derived figure (for tables / JSON)."""
        row = asdict(self)
        row.update(model_state_bytes=self.model_state_bytes, peak_bytes=self.peak_bytes,
                   comm_bytes=self.comm_bytes, num_collectives=self.num_collectives)
        return row


def _peak_gathered(
    unit_numels: Sequence[int], b_param: int, b_grad: int, prefetch: int, reshard_after_forward: bool
) -> int:
    if not unit_numels:
        return 0
    ordered = sorted(unit_numels, reverse=True)
    held = sum(ordered) if not reshard_after_forward else sum(ordered[: 1 + prefetch])
    return held * b_param + ordered[0] * b_grad


def _check_prefetch(prefetch) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError(f"prefetch must be an int >= 0, got {prefetch!r}")
    return prefetch


def chunk_zero3_cost(
    layout: ChunkLayout,
    precision: str = "bf16",
    optimizer: str | int = "adam",
    *,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
) -> StrategyCost:
    """Cost of chunk-based ZeRO-3 (Gemini/ZeroDDP) on ``layout`` over ``layout.world_size`` ranks.

    Per rank: every chunk's shard (``size/W`` elements; keep-gathered chunks whole) in the parameter
    dtype; gradient, fp32 master and optimizer-state shards of the same size for chunks that require
    grad. Per step: one all-gather per sharded chunk in forward and one more in backward if
    ``reshard_after_forward``; one reduce-scatter per sharded trainable chunk; one all-reduce per
    keep-gathered trainable chunk. With no padding and no keep-gathered chunks this is the ZeRO
    paper's ``16Ψ/N_d`` model-state bytes (mixed-precision Adam) and
    ``(n−1)/n·Ψ·(2·b_param + b_grad)`` bytes on the wire.

    Raises:
        ConfigError: unknown precision or optimizer, or a bad ``prefetch``.
    """
    b_param, b_grad, b_master = _precision(precision)
    n_states = _num_states(optimizer)
    prefetch = _check_prefetch(prefetch)
    w = layout.world_size
    stored = trainable = 0
    ag = rs = ar = 0
    n_ag = n_rs = n_ar = 0
    sharded_sizes = []
    for c in layout.chunks:
        shard = layout.shard_numel(c.index)
        stored += shard
        if c.requires_grad:
            trainable += shard
        if c.keep_gathered:
            if c.requires_grad:
                ar += _allreduce_bytes(c.size * b_grad, w)
                n_ar += 1
            continue
        sharded_sizes.append(c.size)
        gathers = 2 if reshard_after_forward else 1
        ag += gathers * (w - 1) * shard * b_param  # ring: each rank sends its shard to W-1 peers' rings
        n_ag += gathers
        if c.requires_grad:
            rs += (w - 1) * shard * b_grad
            n_rs += 1
    psi = layout.utilized_numel
    padding = sum(c.padding for c in layout.chunks)
    return StrategyCost(
        "chunk-zero3", w, precision, str(optimizer), psi, stored, padding,
        stored * b_param, trainable * b_grad, trainable * b_master, trainable * FP32_BYTES * n_states,
        _peak_gathered(sharded_sizes, b_param, b_grad, prefetch, reshard_after_forward),
        ag, rs, ar, n_ag, n_rs, n_ar, len(layout.chunks),
    )


def fsdp_shard_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements one rank holds of a tensor sharded on dim 0 as FSDP2 does: dim 0 padded up to a
    multiple of ``W`` (``ceil(d0/W)`` rows each); a 0-d tensor counts as shape ``(1,)``.

    Source: PyTorch FSDP2 ``FSDPParam`` (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``),
    which ``torch.chunk``s dim 0 and pads each shard to the largest."""
    shape = tuple(shape) or (1,)
    rows = -(-shape[0] // world_size)
    return rows * math.prod(shape[1:])


def fsdp_cost(
    specs: Iterable[TensorSpec],
    world_size: int,
    precision: str = "bf16",
    optimizer: str | int = "adam",
    *,
    unit_of: Callable[[str], str] | None = None,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
) -> StrategyCost:
    """Cost of per-parameter FSDP (FSDP2, ``fully_shard``) over ``world_size`` ranks.

    Every parameter is sharded on dim 0 with padding (:func:`fsdp_shard_numel`). Parameters are
    grouped into units (``unit_of(name) -> unit``, units ordered by first appearance; default: every
    parameter its own unit — pass :func:`chunkzero.configs.transformer_block_unit` for the usual
    ``fully_shard`` per transformer block plus the root). FSDP2 all-gathers one unit's parameters in a
    single collective: per step one all-gather per unit in forward, one more in backward if
    ``reshard_after_forward``, one reduce-scatter per unit holding trainable parameters. Bytes use
    the padded sizes (``W × shard``).

    Raises:
        ConfigError: bad world size, precision, optimizer or prefetch.
    """
    w = _world(world_size)
    b_param, b_grad, b_master = _precision(precision)
    n_states = _num_states(optimizer)
    prefetch = _check_prefetch(prefetch)
    units: dict[str, list[int]] = {}  # unit -> [padded numel, padded trainable numel]
    psi = stored = trainable = 0
    for s in specs:
        shard = fsdp_shard_numel(s.shape, w)
        psi += s.numel
        stored += shard
        u = units.setdefault(unit_of(s.name) if unit_of else s.name, [0, 0])
        u[0] += shard * w
        if s.requires_grad:
            trainable += shard
            u[1] += shard * w
    gathers = 2 if reshard_after_forward else 1
    sizes = [u[0] for u in units.values()]
    ag = sum(gathers * (w - 1) * (n // w) * b_param for n in sizes)  # padded sizes are multiples of W
    rs = sum((w - 1) * (u[1] // w) * b_grad for u in units.values())
    n_rs = sum(1 for u in units.values() if u[1])
    return StrategyCost(
        "fsdp", w, precision, str(optimizer), psi, stored, stored * w - psi,
        stored * b_param, trainable * b_grad, trainable * b_master, trainable * FP32_BYTES * n_states,
        _peak_gathered(sizes, b_param, b_grad, prefetch, reshard_after_forward),
        ag, rs, 0, gathers * len(units), n_rs, 0, len(units),
    )


def ddp_buckets(specs: Iterable[TensorSpec], grad_bytes_per_element: int, *,
                bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
                first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES) -> list[list[str]]:
    """Gradient buckets as torch DDP forms them: trainable parameters in *reverse* order, appended to
    the open bucket, which closes once it reaches its cap (``first_bucket_bytes`` for the first,
    ``bucket_cap_bytes`` after), so a bucket may exceed its cap by one tensor. Returns the names per
    bucket, in all-reduce order.

    Source: ``torch.distributed._compute_bucket_assignment_by_size`` as used by
    ``DistributedDataParallel`` (``bucket_cap_mb=25``; all parameters here share one dtype)."""
    buckets: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for s in reversed([s for s in specs if s.requires_grad]):
        current.append(s.name)
        filled += s.numel * grad_bytes_per_element
        cap = first_bucket_bytes if not buckets else bucket_cap_bytes
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def ddp_cost(
    specs: Iterable[TensorSpec],
    world_size: int,
    precision: str = "bf16",
    optimizer: str | int = "adam",
    *,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
) -> StrategyCost:
    """Cost of DDP: every rank holds everything (``16Ψ`` bytes for mixed-precision Adam, ZeRO
    paper's baseline); per step one ring all-reduce per gradient bucket (:func:`ddp_buckets`),
    ``2(n−1)/n·Ψ·b_grad`` bytes in all. No gathered buffers.

    Raises:
        ConfigError: bad world size, precision or optimizer.
    """
    w = _world(world_size)
    b_param, b_grad, b_master = _precision(precision)
    n_states = _num_states(optimizer)
    specs = list(specs)
    psi = sum(s.numel for s in specs)
    trainable = sum(s.numel for s in specs if s.requires_grad)
    buckets = ddp_buckets(specs, b_grad, bucket_cap_bytes=bucket_cap_bytes, first_bucket_bytes=first_bucket_bytes)
    return StrategyCost(
        "ddp", w, precision, str(optimizer), psi, psi, 0,
        psi * b_param, trainable * b_grad, trainable * b_master, trainable * FP32_BYTES * n_states, 0,
        0, 0, _allreduce_bytes(trainable * b_grad, w), 0, 0, len(buckets), len(buckets),
    )


def zero_paper_model_state_bytes(
    param_numel: int, world_size: int, *, k: int = 12, b_param: int = 2, b_grad: int = 2
) -> float:
    """ZeRO-3 model-state bytes per rank, ``(b_param + b_grad + K)·Ψ/N_d`` (Rajbhandari et al. 2020,
    §5.1: ``16Ψ/N_d`` for mixed-precision Adam, ``K = 12``)."""
    return (b_param + b_grad + k) * param_numel / world_size


def zero_paper_wire_bytes(param_numel: int, world_size: int, *, b_param: int = 2, b_grad: int = 2) -> float:
    """ZeRO-3 bytes each rank sends per step, ``(n−1)/n·Ψ·(2·b_param + b_grad)`` (Rajbhandari et al.
    2020, §7.2.2: parameter all-gather in forward and backward plus gradient reduce-scatter)."""
    return _ring(world_size) * param_numel * (2 * b_param + b_grad)


def compare_strategies(
    specs: Sequence[TensorSpec],
    world_size: int,
    precision: str = "bf16",
    optimizer: str | int = "adam",
    *,
    layout: ChunkLayout | None = None,
    unit_of: Callable[[str], str] | None = None,
) -> list[StrategyCost]:
    """``[chunk ZeRO-3, FSDP, DDP]`` costs for one model (the chunk layout searched by
    :func:`chunkzero.search.build_layout` unless given; FSDP units from ``unit_of``, default one
    per transformer block plus root)."""
    from .configs import transformer_block_unit
    from .search import build_layout

    specs = list(specs)
    if layout is None:
        layout = build_layout(specs, world_size)
    elif layout.world_size != world_size:
        layout = layout.relayout(world_size)
    return [
        chunk_zero3_cost(layout, precision, optimizer),
        fsdp_cost(specs, world_size, precision, optimizer, unit_of=unit_of or transformer_block_unit),
        ddp_cost(specs, world_size, precision, optimizer),
    ]


def format_cost_table(costs: Iterable[StrategyCost]) -> str:
    """A markdown table (MiB for bytes) of :class:`StrategyCost` rows."""
    mib = 2**20
    lines = [
        "| strategy | W | precision | params MiB | grads MiB | master MiB | optim MiB | model states MiB | "
        "peak gathered MiB | all-gather MiB | reduce-scatter MiB | all-reduce MiB | collectives | padding |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in costs:
        lines.append(
            f"| {c.strategy} | {c.world_size} | {c.precision} | {c.param_bytes / mib:.1f} | {c.grad_bytes / mib:.1f} | "
            f"{c.master_bytes / mib:.1f} | {c.optimizer_state_bytes / mib:.1f} | {c.model_state_bytes / mib:.1f} | "
            f"{c.peak_gathered_bytes / mib:.1f} | {c.allgather_bytes / mib:.1f} | {c.reduce_scatter_bytes / mib:.1f} | "
            f"{c.allreduce_bytes / mib:.1f} | {c.num_collectives} | {c.padding_numel:,} |"
        )
    return "\n".join(lines)


__all__ = [
    "DDP_BUCKET_CAP_BYTES", "OPTIMIZER_STATES", "PRECISION_BYTES", "StrategyCost", "chunk_zero3_cost",
    "compare_strategies", "ddp_buckets", "ddp_cost", "format_cost_table", "fsdp_cost", "fsdp_shard_numel",
    "zero_paper_model_state_bytes", "zero_paper_wire_bytes",
]
