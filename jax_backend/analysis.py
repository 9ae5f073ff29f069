"""Measure sharding layouts: chunk ZeRO-3 vs per-parameter FSDP vs DDP, next to the cost model.

For one model, world size ``W`` and precision, :func:`compare_layouts` builds the three trainers
(:class:`jax_backend.zero.ZeroTrainer`, :class:`jax_backend.baselines.FSDPTrainer`,
:class:`jax_backend.baselines.DDPTrainer`) on a ``W``-device mesh, lowers and compiles their training
step for **abstract** inputs (``ShapeDtypeStruct`` s; nothing is allocated or run, so GPT-2 medium or a
1B Llama compile on a laptop) and reads, per device:

- **memory** from ``compiled.memory_analysis()``: argument bytes (the training state's shards and
  the batch), temp bytes (gathered buffers, gradients, activations), output/alias bytes;
- **resident shard bytes**: the state's per-device bytes from its shardings (exact);
- **collectives** counted in the compiled HLO text (``compiled.as_text()``, :func:`count_collectives`):
  number of all-gather / reduce-scatter / all-reduce instructions and of buffers they move (XLA's
  combiners may merge several buffers into one instruction), their buffer bytes, and the bytes each
  device sends under the ring model (all-gather and reduce-scatter ``(W−1)/W·S``, all-reduce
  ``2(W−1)/W·S``, the accounting of :mod:`chunkzero.cost`);
- **padding** (zeros stored) and **replication** (extra copies of unsharded tensors), in elements;
- optionally **step time** on the simulated devices (real arrays: small models only).

Each is set next to the core cost model's prediction (:func:`chunkzero.chunk_zero3_cost`,
:func:`chunkzero.fsdp_cost` with one unit per parameter, :func:`chunkzero.ddp_cost`) with the
prediction error. The state bytes a step takes as arguments are the cost model's *resident* model
states — parameters, fp32 master, optimizer states (:attr:`LayoutRow.predicted_state_bytes`); the
gradients exist only inside the step (in temp), as the gathered buffers do.

Counting notes: XLA removes a backward gather whose values the backward does not need (a unit holding
only position embeddings or output biases: ``x + b`` needs no ``b`` to differentiate), so measured
all-gathers can be below two per unit; simulated CPU devices share one host, so step times show
compute and copy costs, not network time.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax

from chunkzero.cost import StrategyCost, chunk_zero3_cost, ddp_cost, fsdp_cost
from chunkzero.errors import ConfigError
from chunkzero.layout import ChunkLayout
from chunkzero.search import build_layout, packing_stats

from .blocks import Program, model_program, random_batch
from .mesh import make_mesh

MIB = 2**20
COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
"""Collective kinds counted in HLO (``-start`` async forms count as their kind; ``-done`` is not counted)."""

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_OP_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s+(?P<op>all-gather-start|all-gather|reduce-scatter|"
    r"all-reduce-start|all-reduce|all-to-all|collective-permute-start|collective-permute)\("
)
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST_RE = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


# ================================================================================================ HLO
@dataclass(frozen=True)
class Collective:
    """One collective instruction of compiled HLO.

    Attributes:
        kind: one of :data:`COLLECTIVE_KINDS`.
        result_bytes: bytes of each buffer it produces (per device), one entry per buffer.
        group_size: devices per replica group (``W`` for the data axis).
    """

    kind: str
    result_bytes: tuple[int, ...]
    group_size: int

    @property
    def buffers(self) -> int:
        """Buffers it moves (several when XLA combined collectives into one instruction)."""
        return len(self.result_bytes)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the full buffers: all-gather output, reduce-scatter input, all-reduce operand."""
        total = sum(self.result_bytes)
        return total * self.group_size if self.kind == "reduce-scatter" else total

    @property
    def wire_bytes(self) -> int:
        """Bytes each device sends under the ring model (:mod:`chunkzero.cost`'s accounting)."""
        n = self.group_size
        if n <= 1:
            return 0
        factor = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return round(factor * self.buffer_bytes)


def parse_collectives(hlo_text: str, default_group_size: int = 1) -> list[Collective]:
    """Every collective instruction of an HLO module's text (``compiled.as_text()``), in text order.

    Args:
        hlo_text: optimized HLO as text.
        default_group_size: group size when an instruction lists no replica groups (all devices).
    """
    out = []
    for line in hlo_text.splitlines():
        if "all-" not in line and "reduce-scatter" not in line and "collective-permute" not in line:
            continue
        clean = re.sub(r"/\*.*?\*/", "", line)
        m = _OP_RE.match(clean)
        if not m:
            continue
        op = m.group("op")
        kind = op.removesuffix("-start")
        shapes = [(_DTYPE_BYTES.get(dt, 4), [int(x) for x in dims.split(",") if x]) for dt, dims in _SHAPE_RE.findall(m.group("type"))]
        if op in ("all-gather-start", "collective-permute-start") and len(shapes) >= 2:
            shapes = shapes[len(shapes) // 2 :]  # (operands, results): keep the results
        sizes = tuple(b * math.prod(d) for b, d in shapes)
        g = _GROUPS_LIST_RE.search(clean)
        if g:
            group = len([x for x in g.group(1).split(",") if x])
        else:
            iota = _GROUPS_IOTA_RE.search(clean)
            group = int(iota.group(2)) if iota else default_group_size
        out.append(Collective(kind, sizes, group))
    return out


@dataclass(frozen=True)
class CollectiveCounts:
    """Collectives of one compiled program, by kind (every kind of :data:`COLLECTIVE_KINDS` present).

    Attributes:
        ops: instructions.
        buffers: buffers moved (``>= ops``; more when XLA combined collectives).
        buffer_bytes: bytes of the full buffers (per device).
        wire_bytes: bytes each device sends, ring model.
    """

    ops: dict[str, int]
    buffers: dict[str, int]
    buffer_bytes: dict[str, int]
    wire_bytes: dict[str, int]

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())


def count_collectives(hlo_text: str, default_group_size: int = 1) -> CollectiveCounts:
    """Count all-gather / reduce-scatter / all-reduce / … in compiled HLO text (see :func:`parse_collectives`)."""
    ops = dict.fromkeys(COLLECTIVE_KINDS, 0)
    buffers, bbytes, wire = dict(ops), dict(ops), dict(ops)
    for c in parse_collectives(hlo_text, default_group_size):
        ops[c.kind] += 1
        buffers[c.kind] += c.buffers
        bbytes[c.kind] += c.buffer_bytes
        wire[c.kind] += c.wire_bytes
    return CollectiveCounts(ops, buffers, bbytes, wire)


# ================================================================================================ memory
@dataclass(frozen=True)
class MemoryStats:
    """``compiled.memory_analysis()`` per device, in bytes.

    Attributes:
        argument_bytes: inputs (state shards, batch).
        output_bytes: outputs (new state, loss).
        alias_bytes: outputs written into donated inputs.
        temp_bytes: everything else live during the step (gathered buffers, gradients, activations).
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def peak_bytes(self) -> int:
        """An upper bound of the step's device memory: arguments + outputs not aliased + temp."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def memory_stats(compiled: jax.stages.Compiled) -> MemoryStats:
    """:class:`MemoryStats` of a compiled program (per device for an SPMD program)."""
    m = compiled.memory_analysis()
    return MemoryStats(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                       int(m.temp_size_in_bytes))


def resident_bytes(abstract_tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded ``ShapeDtypeStruct`` s / arrays (device 0's shard;
    every device holds the same amount here)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


# ================================================================================================ one layout
@dataclass
class LayoutMeasurement:
    """What one trainer's compiled step measures (per device).

    Attributes:
        strategy: ``"chunk-zero3"``, ``"fsdp"`` or ``"ddp"``.
        resident_bytes: the training state's shard bytes (:func:`resident_bytes` of the abstract state).
        memory: :class:`MemoryStats` of the compiled step.
        collectives: :class:`CollectiveCounts` of the compiled HLO.
        padding_numel: zeros stored, summed over devices.
        replicated_numel: extra copies of unsharded tensors, summed over devices (``(W−1)·numel``).
        compile_s: lowering + compilation wall-clock seconds.
        compile_cpu_s: lowering + compilation CPU seconds of this process (all threads; steadier than
            wall time on a shared machine).
        step_time_s: median seconds of a real step, or ``None`` when not timed.
    """

    strategy: str
    resident_bytes: int
    memory: MemoryStats
    collectives: CollectiveCounts
    padding_numel: int
    replicated_numel: int
    compile_s: float
    compile_cpu_s: float = 0.0
    step_time_s: float | None = None


def _padding_and_replication(trainer) -> tuple[int, int]:
    padding = replicated = 0
    w = trainer.world_size
    for k, u in trainer.units.items():
        numel = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(u.abstract("float32")))
        used = sum(s.numel for s in trainer.program.specs if s.name in u.tensors)
        padding += (numel - used) if u.sharded else 0
        replicated += 0 if u.sharded else (w - 1) * numel
    return padding, replicated


def measure_trainer(trainer, batch_size: int, seq_len: int, *, time_steps: int = 0, fast_compile: bool = True,
                    seed: int = 0) -> LayoutMeasurement:
    """Compile ``trainer``'s step for abstract inputs and measure it (see the module docstring).

    Args:
        batch_size, seq_len: the global batch ``int32[batch_size, seq_len]`` (``batch_size`` divisible by ``W``).
        time_steps: if > 0, also run that many real steps (after one warm-up) on random parameters and
            tokens and record the median step time — allocates the whole model: small models only.
        fast_compile: compile with XLA's backend (LLVM) optimizations off for the measurement; memory
            and HLO are decided before code generation and do not change, compilation is ~2-3x faster.
            Step timing always uses a normally optimized compile.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = trainer.lower(batch_size, seq_len)
    opts = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True} if fast_compile else {}
    compiled = lowered.compile(compiler_options=opts)
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    counts = count_collectives(compiled.as_text(), trainer.world_size)
    padding, replicated = _padding_and_replication(trainer)
    m = LayoutMeasurement(trainer.name, resident_bytes(trainer.abstract_state()), memory_stats(compiled), counts,
                          padding, replicated, compile_s, compile_cpu_s)
    if time_steps > 0:
        m.step_time_s = time_step(trainer, batch_size, seq_len, steps=time_steps, seed=seed)
    return m


def time_step(trainer, batch_size: int, seq_len: int, *, steps: int = 3, seed: int = 0) -> float:
    """Median wall-clock seconds of ``steps`` real training steps (after one warm-up step)."""
    state = trainer.init(trainer.program.init(seed))
    batch = trainer.shard_batch(random_batch(trainer.program, batch_size, seq_len, seed))
    step = trainer.step_fn
    state, loss = step(state, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ================================================================================================ comparison
@dataclass
class LayoutRow:
    """One strategy: the cost model's prediction and (optionally) the measurement."""

    predicted: StrategyCost
    measured: LayoutMeasurement | None = None

    @property
    def strategy(self) -> str:
        return self.predicted.strategy

    @property
    def predicted_state_bytes(self) -> int:
        """Parameters + fp32 master + optimizer states per device: what the step takes as arguments."""
        p = self.predicted
        return p.param_bytes + p.master_bytes + p.optimizer_state_bytes

    @property
    def predicted_transient_bytes(self) -> int:
        """Gradients + peak gathered buffers per device (inside the step; activations not modelled)."""
        return self.predicted.grad_bytes + self.predicted.peak_gathered_bytes

    @property
    def state_error(self) -> float | None:
        """``predicted_state_bytes / memory.argument_bytes − 1``."""
        if self.measured is None:
            return None
        return self.predicted_state_bytes / self.measured.memory.argument_bytes - 1

    @property
    def comm_error(self) -> float | None:
        """``predicted comm bytes / measured wire bytes − 1`` (``None`` when nothing is measured or both are 0)."""
        if self.measured is None:
            return None
        meas = self.measured.collectives.total_wire_bytes
        if meas == 0:
            return None if self.predicted.comm_bytes == 0 else math.inf
        return self.predicted.comm_bytes / meas - 1

    def as_dict(self) -> dict:
        """A flat dict of predicted (``pred_*``) and measured (``meas_*``) figures."""
        p = self.predicted
        d = {"strategy": p.strategy, "world_size": p.world_size, "precision": p.precision,
             "pred_state_bytes": self.predicted_state_bytes, "pred_model_state_bytes": p.model_state_bytes,
             "pred_transient_bytes": self.predicted_transient_bytes, "pred_allgathers": p.num_allgathers,
             "pred_reduce_scatters": p.num_reduce_scatters, "pred_allreduces": p.num_allreduces,
             "pred_comm_bytes": p.comm_bytes, "pred_padding_numel": p.padding_numel}
        m = self.measured
        if m is not None:
            c = m.collectives
            d.update(meas_argument_bytes=m.memory.argument_bytes, meas_temp_bytes=m.memory.temp_bytes,
                     meas_output_bytes=m.memory.output_bytes, meas_alias_bytes=m.memory.alias_bytes,
                     meas_resident_bytes=m.resident_bytes, meas_allgathers=c.buffers["all-gather"],
                     meas_reduce_scatters=c.buffers["reduce-scatter"], meas_allreduces=c.buffers["all-reduce"],
                     meas_collective_ops=sum(c.ops.values()), meas_comm_bytes=c.total_wire_bytes,
                     meas_padding_numel=m.padding_numel, meas_replicated_numel=m.replicated_numel,
                     state_error=self.state_error, comm_error=self.comm_error, compile_s=m.compile_s,
                     compile_cpu_s=m.compile_cpu_s,
                     step_time_s=m.step_time_s)
        return d


@dataclass
class LayoutComparison:
    """Chunk ZeRO-3 vs FSDP vs DDP for one model, world size and precision (:func:`compare_layouts`)."""

    model: str
    world_size: int
    precision: str
    layout: ChunkLayout
    rows: list[LayoutRow]
    batch_size: int
    seq_len: int
    program: Program | None = field(default=None, repr=False)

    @property
    def measured(self) -> bool:
        return any(r.measured is not None for r in self.rows)

    def row(self, strategy: str) -> LayoutRow:
        """The row of ``strategy`` (``"chunk-zero3"``, ``"fsdp"``, ``"ddp"``).

        Raises:
            KeyError: naming the strategy.
        """
        for r in self.rows:
            if r.strategy == strategy:
                return r
        raise KeyError(f"no strategy {strategy!r} (have {[r.strategy for r in self.rows]})")

    def table(self) -> str:
        """The comparison as a markdown table (:func:`format_comparison`)."""
        return format_comparison(self)

    def plot(self, path: str | None = None):
        """Chunk map and per-device memory bars (:func:`plot_comparison`); saved to ``path`` if given."""
        return plot_comparison(self, path)


def _fmt_pct(x: float | None) -> str:
    if x is None:
        return "–"
    if math.isinf(x):
        return "∞"
    return f"{100 * x:+.1f}%"


def _pm(pred: int, meas: int | None, ops: int | None = None) -> str:
    if meas is None:
        return f"{pred}"
    s = f"{pred} / {meas}"
    if ops is not None and ops != meas:
        s += f" ({ops} op{'s' if ops != 1 else ''})"
    return s


def format_comparison(cmp: LayoutComparison) -> str:
    """Markdown table: per strategy, predicted and (when measured) measured per-device memory,
    collectives, bytes sent, padding, step time, with prediction errors. MiB = 2**20 bytes."""
    lines = [f"Model {cmp.model}, W={cmp.world_size}, {cmp.precision}, chunk size {cmp.layout.chunk_size:,} elements "
             f"({len(cmp.layout.chunks)} chunks); batch {cmp.batch_size}x{cmp.seq_len} tokens; figures per device.", ""]
    if not cmp.measured:
        lines += [
            "| strategy | state MiB (params+master+optim) | grads MiB | peak gathered MiB | all-gathers | "
            "reduce-scatters | all-reduces | sent MiB/step | padding (elements) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in cmp.rows:
            p = r.predicted
            lines.append(f"| {p.strategy} | {r.predicted_state_bytes / MIB:.1f} | {p.grad_bytes / MIB:.1f} | "
                         f"{p.peak_gathered_bytes / MIB:.1f} | {p.num_allgathers} | {p.num_reduce_scatters} | "
                         f"{p.num_allreduces} | {p.comm_bytes / MIB:.1f} | {p.padding_numel:,} |")
        return "\n".join(lines)
    lines += [
        "| strategy | state MiB pred / meas (args) | err | resident MiB | temp MiB pred* / meas | all-gathers pred / meas | "
        "reduce-scatters pred / meas | all-reduces pred / meas | sent MiB pred / meas | err | padding pred / meas | "
        "replicated | step ms | compile CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in cmp.rows:
        p, m = r.predicted, r.measured
        if m is None:
            continue
        c = m.collectives
        step = f"{1e3 * m.step_time_s:.0f}" if m.step_time_s is not None else "–"
        lines.append(
            f"| {p.strategy} | {r.predicted_state_bytes / MIB:.1f} / {m.memory.argument_bytes / MIB:.1f} | "
            f"{_fmt_pct(r.state_error)} | {m.resident_bytes / MIB:.1f} | "
            f"{r.predicted_transient_bytes / MIB:.1f} / {m.memory.temp_bytes / MIB:.1f} | "
            f"{_pm(p.num_allgathers, c.buffers['all-gather'], c.ops['all-gather'])} | "
            f"{_pm(p.num_reduce_scatters, c.buffers['reduce-scatter'], c.ops['reduce-scatter'])} | "
            f"{_pm(p.num_allreduces, c.buffers['all-reduce'], c.ops['all-reduce'])} | "
            f"{p.comm_bytes / MIB:.1f} / {c.total_wire_bytes / MIB:.1f} | {_fmt_pct(r.comm_error)} | "
            f"{p.padding_numel:,} / {m.padding_numel:,} | {m.replicated_numel:,} | {step} | {m.compile_cpu_s:.0f} |"
        )
    lines += ["", "*predicted temp = gradients + peak gathered buffers (activations are not modelled); "
              "state = parameters + fp32 master + optimizer states (the step's arguments also hold the batch); "
              "counts are buffers (XLA may combine several into one op); sent = ring-model bytes per device."]
    if cmp.precision != "fp32" and jax.default_backend() == "cpu":
        lines.append("XLA:CPU widens bf16 collectives to f32, so measured bytes sent are fp32 bytes "
                     "(the program issues bf16).")
    return "\n".join(lines)


def make_trainers(program: Program, mesh, layout: ChunkLayout, *, precision: str = "fp32",
                  tx: optax.GradientTransformation | None = None,
                  strategies: Sequence[str] = ("chunk-zero3", "fsdp", "ddp")) -> dict[str, Any]:
    """The trainers of ``strategies`` for ``program`` on ``mesh`` (AdamW by default)."""
    from .baselines import DDPTrainer, FSDPTrainer
    from .zero import ZeroTrainer

    tx = tx or optax.adamw(1e-4)
    build = {
        "chunk-zero3": lambda: ZeroTrainer(program, layout, mesh, tx, mixed_precision=precision),
        "fsdp": lambda: FSDPTrainer(program, mesh, tx, mixed_precision=precision),
        "ddp": lambda: DDPTrainer(program, mesh, tx, mixed_precision=precision),
    }
    unknown = [s for s in strategies if s not in build]
    if unknown:
        raise ConfigError(f"unknown strategy {unknown[0]!r}; known: {', '.join(build)}")
    return {s: build[s]() for s in strategies}


def predict(program: Program, layout: ChunkLayout, precision: str = "fp32",
            strategies: Sequence[str] = ("chunk-zero3", "fsdp", "ddp")) -> dict[str, StrategyCost]:
    """The cost model's prediction per strategy (FSDP: one unit per parameter, as :class:`FSDPTrainer`)."""
    specs, w = list(program.specs), layout.world_size
    costs = {
        "chunk-zero3": lambda: chunk_zero3_cost(layout, precision, "adamw"),
        "fsdp": lambda: fsdp_cost(specs, w, precision, "adamw"),
        "ddp": lambda: ddp_cost(specs, w, precision, "adamw"),
    }
    return {s: costs[s]() for s in strategies}


def compare_layouts(model: str | Program, world_size: int, *, chunk_size: int | None = None, precision: str = "fp32",
                    measure: bool = False, batch_size: int | None = None, seq_len: int = 128, time_steps: int = 0,
                    fast_compile: bool = True, strategies: Sequence[str] = ("chunk-zero3", "fsdp", "ddp"),
                    mesh=None) -> LayoutComparison:
    """Chunk ZeRO-3 vs per-parameter FSDP vs DDP for ``model`` on ``world_size`` devices.

    Args:
        model: a :mod:`chunkzero.configs` name (``"gpt2"``, ``"gpt2-medium"``, ``"llama-1b"``,
            ``"gpt-tiny"``, ``"gpt-small"``) or a :class:`jax_backend.blocks.Program`.
        chunk_size: chunk capacity in elements (default: :func:`chunkzero.search_chunk_size`).
        precision: ``"fp32"`` or ``"bf16"`` (fp32 masters and AdamW states either way).
        measure: compile each strategy's step for abstract inputs and measure it (needs ``world_size``
            devices: set ``XLA_FLAGS=--xla_force_host_platform_device_count=W`` before importing jax).
        batch_size: global batch (default ``world_size``, one sequence per device); ``seq_len`` tokens each.
        time_steps: with ``measure``, also time that many real steps (allocates the model: small models).
        fast_compile: see :func:`measure_trainer`.
        strategies: which rows to build.
        mesh: the mesh to use (default :func:`jax_backend.make_mesh` ``(world_size)``).

    Raises:
        ConfigError: unknown model or strategy, too few devices, bad batch size.
    """
    program = model if isinstance(model, Program) else model_program(model)
    name = model if isinstance(model, str) else program.name
    layout = build_layout(list(program.specs), world_size, chunk_size)
    batch_size = batch_size or world_size
    if program.max_seq_len:
        seq_len = min(seq_len, program.max_seq_len)
    preds = predict(program, layout, precision, strategies)
    rows = [LayoutRow(preds[s]) for s in strategies]
    if measure:
        if mesh is None:
            if len(jax.devices()) < world_size:
                raise ConfigError(
                    f"measuring at world size {world_size} needs {world_size} devices, jax has {len(jax.devices())}; "
                    f"set XLA_FLAGS=--xla_force_host_platform_device_count={world_size} before jax is imported"
                )
            mesh = make_mesh(world_size)
        trainers = make_trainers(program, mesh, layout, precision=precision, strategies=strategies)
        for r in rows:
            r.measured = measure_trainer(trainers[r.strategy], batch_size, seq_len, time_steps=time_steps,
                                         fast_compile=fast_compile)
    return LayoutComparison(name, world_size, precision, layout, rows, batch_size, seq_len, program)


# ================================================================================================ sweep
def chunk_size_sweep(model: str | Program, world_size: int, chunk_sizes: Iterable[int] | None = None, *,
                     precision: str = "fp32") -> list[dict]:
    """Padding, capacity waste and collective counts vs chunk size (the cost model; no compilation).

    Args:
        chunk_sizes: capacities in elements (default: 24 sizes log-spaced between 1/1024 and 1/4 of
            the model, plus the searched size).

    Returns:
        One dict per size: ``chunk_size``, ``num_chunks``, ``padding_numel``, ``wasted_numel``,
        ``allgathers``, ``reduce_scatters``, ``peak_gathered_bytes``, ``sent_bytes``, ``searched`` (bool).
    """
    from chunkzero.search import search_chunk_size

    program = model if isinstance(model, Program) else model_program(model)
    specs = list(program.specs)
    searched = search_chunk_size(specs, world_size).chunk_size
    if chunk_sizes is None:
        total = sum(s.numel for s in specs)
        lo, hi = max(total // 1024, 1), max(total // 4, total // 1024 + 1)
        chunk_sizes = sorted({int(x) for x in np.geomspace(lo, hi, 24)} | {searched})
    rows = []
    for c in chunk_sizes:
        layout = build_layout(specs, world_size, int(c))
        cost = chunk_zero3_cost(layout, precision, "adamw")
        stats = packing_stats(specs, int(c), world_size)
        rows.append(dict(chunk_size=int(c), num_chunks=len(layout.chunks), padding_numel=layout.padding_numel,
                         wasted_numel=stats.wasted_numel, allgathers=cost.num_allgathers,
                         reduce_scatters=cost.num_reduce_scatters, peak_gathered_bytes=cost.peak_gathered_bytes,
                         sent_bytes=cost.comm_bytes, searched=int(c) == searched))
    return rows


def measured_sweep(model: str | Program, world_size: int, chunk_sizes: Iterable[int], *, batch_size: int | None = None,
                   seq_len: int = 32, precision: str = "fp32") -> list[dict]:
    """Compile the ZeRO-3 step (abstract inputs) at each chunk size and count its collectives.

    Returns:
        One dict per size: ``chunk_size``, ``num_chunks``, ``pred_allgathers``, ``meas_allgathers``,
        ``pred_reduce_scatters``, ``meas_reduce_scatters``, ``meas_temp_bytes``.
    """
    from .zero import ZeroTrainer

    program = model if isinstance(model, Program) else model_program(model)
    mesh = make_mesh(world_size)
    rows = []
    for c in chunk_sizes:
        layout = build_layout(list(program.specs), world_size, int(c))
        trainer = ZeroTrainer(program, layout, mesh, optax.sgd(0.1), mixed_precision=precision)
        m = measure_trainer(trainer, batch_size or world_size, min(seq_len, program.max_seq_len or seq_len))
        cost = chunk_zero3_cost(layout, precision, "sgd")
        rows.append(dict(chunk_size=int(c), num_chunks=len(layout.chunks), pred_allgathers=cost.num_allgathers,
                         meas_allgathers=m.collectives.buffers["all-gather"], pred_reduce_scatters=cost.num_reduce_scatters,
                         meas_reduce_scatters=m.collectives.buffers["reduce-scatter"], meas_temp_bytes=m.memory.temp_bytes))
    return rows


# ================================================================================================ plots
def _tensor_group(name: str) -> str:
    m = re.search(r"\.(?:h|layers)\.(\d+)\.", name)
    return f"block {m.group(1)}" if m else "embeddings / head"


def plot_chunk_map(layout: ChunkLayout, ax=None, *, max_chunks: int | None = None, normalize: bool = True):
    """Chunks as rows of tensors (one color per transformer block, grey for embeddings/head, hatched
    padding), with each rank's shard boundaries as black ticks.

    Args:
        normalize: draw every chunk over its own size (x in ``[0, 1]``, the size written at the right),
            so a huge dedicated chunk (an embedding) does not squash the others; ``False`` draws elements.
        max_chunks: draw only the first chunks.

    Returns:
        The axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    chunks = layout.chunks[:max_chunks] if max_chunks else layout.chunks
    if ax is None:
        _, ax = plt.subplots(figsize=(10, max(2.5, 0.18 * len(chunks) + 1)))
    cmap = plt.get_cmap("tab20")
    blocks: dict[str, int] = {}
    widest = max(c.size for c in chunks)
    for row, c in enumerate(chunks):
        y = len(chunks) - 1 - row
        scale = 1.0 / c.size if normalize else 1.0
        for t in layout.chunk_tensors(c.index):
            grp = _tensor_group(t.name)
            color = "0.6" if grp == "embeddings / head" else cmap(blocks.setdefault(grp, len(blocks)) % 20)
            ax.add_patch(Rectangle((t.offset * scale, y - 0.4), t.numel * scale, 0.8, facecolor=color, edgecolor="white",
                                   linewidth=0.3))
        if c.padding:
            ax.add_patch(Rectangle((c.utilized * scale, y - 0.4), c.padding * scale, 0.8, facecolor="none",
                                   edgecolor="red", hatch="///", linewidth=0.5))
        if not c.keep_gathered:
            shard = c.size // layout.world_size
            for r in range(1, layout.world_size):
                ax.plot([r * shard * scale] * 2, [y - 0.45, y + 0.45], color="black", linewidth=0.6)
        if normalize:
            ax.text(1.01, y, f"{c.size:,}" + (" kept" if c.keep_gathered else ""), va="center", fontsize=6)
    ax.set_xlim(0, 1.12 if normalize else widest * 1.01)
    ax.set_ylim(-0.7, len(chunks) - 0.3)
    step = max(1, len(chunks) // 12)
    ax.set_yticks([len(chunks) - 1 - i for i in range(0, len(chunks), step)])
    ax.set_yticklabels([str(chunks[i].index) for i in range(0, len(chunks), step)])
    ax.set_xlabel("position in chunk (fraction of its size; size in elements at the right)" if normalize
                  else "element offset in chunk")
    ax.set_ylabel("chunk")
    ax.set_title(f"chunk map: {len(layout.chunks)} chunks, capacity {layout.chunk_size:,} elements (larger tensors get a chunk "
                 f"of their own), W={layout.world_size} "
                 f"(ticks: rank shard boundaries; colors: blocks; hatched: padding, {layout.padding_numel:,} elements)",
                 fontsize=9)
    return ax


def plot_memory_bars(cmp: LayoutComparison, ax=None):
    """Per-device memory per strategy: predicted (parameters, gradients, master, optimizer states,
    peak gathered) next to measured (arguments, temp) when measured. MiB. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(cmp.rows))
    width = 0.38 if cmp.measured else 0.6
    parts = [("params", "param_bytes"), ("grads", "grad_bytes"), ("fp32 master", "master_bytes"),
             ("optimizer states", "optimizer_state_bytes"), ("peak gathered", "peak_gathered_bytes")]
    colors = plt.get_cmap("tab10")
    bottom = np.zeros(len(cmp.rows))
    offset = -width / 2 if cmp.measured else 0.0
    for j, (label, attr) in enumerate(parts):
        vals = np.array([getattr(r.predicted, attr) / MIB for r in cmp.rows])
        ax.bar(x + offset, vals, width, bottom=bottom, label=f"pred: {label}", color=colors(j))
        bottom += vals
    if cmp.measured:
        args = np.array([(r.measured.memory.argument_bytes if r.measured else 0) / MIB for r in cmp.rows])
        temp = np.array([(r.measured.memory.temp_bytes if r.measured else 0) / MIB for r in cmp.rows])
        ax.bar(x + width / 2, args, width, label="meas: arguments (state)", color="0.35")
        ax.bar(x + width / 2, temp, width, bottom=args, label="meas: temp", color="0.7")
    ax.set_xticks(x)
    ax.set_xticklabels([r.strategy for r in cmp.rows])
    ax.set_ylabel("MiB per device")
    ax.set_title(f"{cmp.model}, W={cmp.world_size}, {cmp.precision}: per-device memory", fontsize=9)
    ax.legend(fontsize=7)
    return ax


def plot_sweep(rows: Sequence[Mapping[str, Any]], ax=None, *, title: str = ""):
    """Padding + capacity waste (left axis, elements) and all-gathers per step (right axis) vs chunk size."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r["chunk_size"] for r in rows]
    over = [(r["padding_numel"] + r["wasted_numel"]) for r in rows]
    ax.plot(xs, over, "o-", label="padding + capacity waste (elements)")
    ax.set_xscale("log")
    ax.set_xlabel("chunk size (elements)")
    ax.set_ylabel("elements")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["allgathers"] for r in rows], "s--", color="C1", label="all-gathers per step")
    ax2.set_ylabel("all-gathers per step")
    for r in rows:
        if r.get("searched"):
            ax.axvline(r["chunk_size"], color="green", linestyle=":", label="searched size")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=7, frameon=False)
    ax.set_title(title or "chunk-size sweep", fontsize=9)
    return ax


def plot_comparison(cmp: LayoutComparison, path: str | None = None):
    """One figure: the chunk map (top) and the memory bars (bottom); written to ``path`` when given.
    Returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n = len(cmp.layout.chunks)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 0.16 * n + 6.5), gridspec_kw={"height_ratios": [max(3, 0.16 * n), 4]})
    plot_chunk_map(cmp.layout, ax1)
    plot_memory_bars(cmp, ax2)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


__all__ = [
    "COLLECTIVE_KINDS", "Collective", "CollectiveCounts", "LayoutComparison", "LayoutMeasurement", "LayoutRow",
    "MemoryStats", "chunk_size_sweep", "compare_layouts", "count_collectives", "format_comparison", "make_trainers",
    "measure_trainer", "measured_sweep", "memory_stats", "parse_collectives", "plot_chunk_map", "plot_comparison", "plot_memory_bars",
    "plot_sweep", "predict", "resident_bytes", "time_step",
]
