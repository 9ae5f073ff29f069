"""chunkzero's PyTorch backend: chunks as torch storage, ZeroDDP, ZeroOptimizer, checkpoints, train loop."""

from .checkpoint import load_checkpoint, save_checkpoint
from .ddp import MemoryReport, ZeroDDP
from .optim import DynamicLossScaler, ZeroOptimizer

__all__ = ["DynamicLossScaler", "MemoryReport", "ZeroDDP", "ZeroOptimizer", "load_checkpoint", "save_checkpoint"]
