"""chunkzero's PyTorch backend, in three rooms: the ZeRO engine (:mod:`torch_backend.zero`), the
checkpoint adapters (:mod:`torch_backend.checkpoint`) and the training job
(:mod:`torch_backend.train`)."""

from .checkpoint import load_checkpoint, save_checkpoint
from .zero import (
    AutoPlacementPolicy,
    DynamicLossScaler,
    MemoryReport,
    MixedPrecision,
    PrefetchPolicy,
    StaticPlacement,
    ZeroDDP,
    ZeroEMA,
    ZeroOptimizer,
)

__all__ = ["AutoPlacementPolicy", "DynamicLossScaler", "MemoryReport", "MixedPrecision", "PrefetchPolicy",
           "StaticPlacement", "ZeroDDP", "ZeroEMA", "ZeroOptimizer", "load_checkpoint", "save_checkpoint"]
