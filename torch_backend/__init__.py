"""chunkzero's PyTorch backend: chunks as torch storage, ZeroDDP, ZeroOptimizer, checkpoints, train loop."""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import AutoPlacementPolicy, MixedPrecision, PrefetchPolicy, StaticPlacement
from .ddp import MemoryReport, ZeroDDP
from .optim import DynamicLossScaler, ZeroOptimizer

__all__ = ["AutoPlacementPolicy", "DynamicLossScaler", "MemoryReport", "MixedPrecision", "PrefetchPolicy",
           "StaticPlacement", "ZeroDDP", "ZeroOptimizer", "load_checkpoint", "save_checkpoint"]
