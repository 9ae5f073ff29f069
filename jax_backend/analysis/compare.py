"""Chunk ZeRO-3 vs per-parameter FSDP vs DDP on one model, next to the cost model.

For one model, world size ``W`` and precision, :func:`compare_layouts` predicts each strategy with the
core cost model (:func:`chunkzero.chunk_zero3_cost`, :func:`chunkzero.fsdp_cost` with one unit per
parameter, :func:`chunkzero.ddp_cost`) and, with ``measure=True``, builds the three trainers
(:class:`jax_backend.zero.ZeroTrainer`, :class:`jax_backend.baselines.FSDPTrainer`,
:class:`jax_backend.baselines.DDPTrainer`) on a ``W``-device mesh and measures their compiled steps
(:func:`jax_backend.analysis.measure.measure_trainer`), with the prediction error of each figure
(:class:`LayoutRow`). The state bytes a step takes as arguments are the cost model's *resident*
model states — parameters, fp32 master, optimizer states (:attr:`LayoutRow.predicted_state_bytes`);
the gradients exist only inside the step (in temp), as the gathered buffers do.

:func:`format_comparison` writes a :class:`LayoutComparison` as a markdown table;
:func:`chunk_size_sweep` (cost model) and :func:`measured_sweep` (compiled) vary the chunk size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax

from chunkzero.cost import StrategyCost, chunk_zero3_cost, ddp_cost, fsdp_cost
from chunkzero.errors import ConfigError
from chunkzero.layout import ChunkLayout
from chunkzero.search import build_layout, packing_stats, search_chunk_size

from ..baselines import DDPTrainer, FSDPTrainer
from ..blocks import Program, model_program
from ..mesh import make_mesh
from ..zero import ZeroTrainer
from .measure import LayoutMeasurement, measure_trainer

MIB = 2**20

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
        """Chunk map and per-device memory bars (:func:`jax_backend.analysis.plots.plot_comparison`);
        saved to ``path`` if given."""
        from .plots import plot_comparison  # matplotlib only when plotting

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
        "| strategy | state MiB pred / meas (args) | err | resident MiB | temp MiB pred* / meas | all-gathers pred / "
        "meas | "
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
        model: a :mod:`chunkzero.configs` name (``"hf-gpt2"``, ``"hf-gpt2-medium"``, ``"llama-1b"``, or
            ``chunkzero train``'s byte-level ``"gpt-tiny"`` … ``"gpt2-medium"``) or a
            :class:`jax_backend.blocks.Program`.
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
    program = model if isinstance(model, Program) else model_program(model)
    mesh = make_mesh(world_size)
    rows = []
    for c in chunk_sizes:
        layout = build_layout(list(program.specs), world_size, int(c))
        trainer = ZeroTrainer(program, layout, mesh, optax.sgd(0.1), mixed_precision=precision)
        m = measure_trainer(trainer, batch_size or world_size, min(seq_len, program.max_seq_len or seq_len))
        cost = chunk_zero3_cost(layout, precision, "sgd")
        rows.append(
            dict(
                chunk_size=int(c),
                num_chunks=len(layout.chunks),
                pred_allgathers=cost.num_allgathers,
                meas_allgathers=m.collectives.buffers["all-gather"],
                pred_reduce_scatters=cost.num_reduce_scatters,
                meas_reduce_scatters=m.collectives.buffers["reduce-scatter"],
                meas_temp_bytes=m.memory.temp_bytes,
            )
        )
    return rows



__all__ = ["MIB", "LayoutComparison", "LayoutRow", "chunk_size_sweep", "compare_layouts", "format_comparison",
           "make_trainers", "measured_sweep", "predict"]
