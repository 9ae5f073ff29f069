"""The ZeRO engine: chunk-based ZeRO-3 data parallelism for any ``nn.Module``.

One step's data goes through four files, in this order: :mod:`.runtime` (torch's events become
chunk calls), :mod:`.schedule` (which collective runs when, the same on every rank), :mod:`.chunks`
(one chunk's storage and life on a rank) and :mod:`.collectives` (every torch collective); the
optimizer step is :mod:`.optim`'s, on the chunks' fp32 master shards. :mod:`.ddp` is the public face
and builds the rest; ``docs/ARCHITECTURE.md`` walks through a step.
"""

from .config import AutoPlacementPolicy, MixedPrecision, PrefetchPolicy, StaticPlacement
from .ddp import MemoryReport, ZeroDDP
from .ema import ZeroEMA
from .optim import DynamicLossScaler, ZeroOptimizer

__all__ = ["AutoPlacementPolicy", "DynamicLossScaler", "MemoryReport", "MixedPrecision", "PrefetchPolicy",
           "StaticPlacement", "ZeroDDP", "ZeroEMA", "ZeroOptimizer"]
