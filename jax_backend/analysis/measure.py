"""What one trainer's training step costs per device, measured on the compiled program.

:func:`measure_trainer` lowers and compiles a :class:`jax_backend.schedule.ShardedTrainer` 's step
for **abstract** inputs (``ShapeDtypeStruct`` s: nothing is allocated or run, so GPT-2 medium or a
1B Llama compile on a laptop) and reads, per device:

- **memory** from ``compiled.memory_analysis()`` (:class:`MemoryStats`): argument bytes (the training
  state's shards and the batch), temp bytes (gathered buffers, gradients, activations), output/alias
  bytes;
- **resident shard bytes**: the state's per-device bytes from its shardings (exact, :func:`resident_bytes`);
- **collectives** counted in the compiled HLO text (:func:`jax_backend.analysis.hlo.count_collectives`);
- **padding** (zeros stored) and **replication** (extra copies of unsharded tensors), in elements;
- optionally **step time** (:func:`time_step`: real arrays, small models only).

Counting notes: XLA removes a backward gather whose values the backward does not need (a unit holding
only position embeddings or output biases: ``x + b`` needs no ``b`` to differentiate), so measured
all-gathers can be below two per unit; simulated CPU devices share one host, so step times show
compute and copy costs, not network time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..blocks import random_batch
from .hlo import CollectiveCounts, count_collectives


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
    for u in trainer.units.values():
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



__all__ = ["LayoutMeasurement", "MemoryStats", "measure_trainer", "memory_stats", "resident_bytes", "time_step"]
