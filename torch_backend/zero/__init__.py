"""The ZeRO engine: chunk-based ZeRO-3 data parallelism for any ``nn.Module``.

A step's Python runs through :mod:`.ddp` (the public face) → :mod:`.runtime` (torch's events become
calls) → :mod:`.schedule` (the step's owner: which collective runs when, the same on every rank) →
:mod:`.chunks` (one chunk's storage, life and gradient on a rank) → :mod:`.collectives` (every torch
collective; one rank runs none) → :mod:`.optim` (the step on the fp32 master shards).
``docs/ARCHITECTURE.md`` walks through a step.
"""

from .config import AutoPlacementPolicy, MixedPrecision, PrefetchPolicy, StaticPlacement
from .ddp import MemoryReport, ZeroDDP
from .ema import ZeroEMA
from .optim import DynamicLossScaler, ZeroOptimizer

__all__ = ["AutoPlacementPolicy", "DynamicLossScaler", "MemoryReport", "MixedPrecision", "PrefetchPolicy",
           "StaticPlacement", "ZeroDDP", "ZeroEMA", "ZeroOptimizer"]
