"""Measure sharding layouts: chunk ZeRO-3 vs per-parameter FSDP vs DDP, next to the cost model.

```python
from jax_backend.analysis import compare_layouts
cmp = compare_layouts("hf-gpt2", 8, measure=True)  # needs 8 devices (simulated: XLA_FLAGS)
print(cmp.table())                               # markdown: predicted / measured, with errors
cmp.plot("layouts.png")                          # chunk map + per-device memory bars
```

One concern per module:

- :mod:`.hlo` — collectives counted in compiled HLO text (:func:`count_collectives`);
- :mod:`.measure` — one trainer's compiled step: memory, resident shards, collectives, padding,
  step time (:func:`measure_trainer`);
- :mod:`.compare` — the three strategies next to the cost model, tables and chunk-size sweeps
  (:func:`compare_layouts`);
- :mod:`.plots` — the figures (the only module that imports matplotlib).
"""

from .compare import (
    MIB,  # noqa: F401 - re-exported: MiB, the unit of the comparison tables
    LayoutComparison,
    LayoutRow,
    chunk_size_sweep,
    compare_layouts,
    format_comparison,
    make_trainers,
    measured_sweep,
    predict,
)
from .hlo import COLLECTIVE_KINDS, Collective, CollectiveCounts, count_collectives, parse_collectives
from .measure import LayoutMeasurement, MemoryStats, measure_trainer, memory_stats, resident_bytes, time_step
from .plots import plot_chunk_map, plot_comparison, plot_memory_bars, plot_sweep

__all__ = [
    "COLLECTIVE_KINDS", "Collective", "CollectiveCounts", "LayoutComparison", "LayoutMeasurement", "LayoutRow",
    "MemoryStats", "chunk_size_sweep", "compare_layouts", "count_collectives", "format_comparison", "make_trainers",
    "measure_trainer", "measured_sweep", "memory_stats", "parse_collectives", "plot_chunk_map", "plot_comparison",
    "plot_memory_bars", "plot_sweep", "predict", "resident_bytes", "time_step",
]
