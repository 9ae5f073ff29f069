"""The torch side of the one checkpoint format (``chunkzero.checkpoint``, docs/DESIGN.md §5):
:func:`save_checkpoint` / :func:`load_checkpoint` of a ``ZeroDDP`` and its ``ZeroOptimizer``
(:mod:`.sharded`), each rank writing and reading only its own shards, in three load modes (:mod:`.load_modes`);
weights import (:mod:`.pretrained`) and export (:mod:`.export`)."""

from .load_modes import WeightsLoad
from .sharded import load_checkpoint, save_checkpoint

__all__ = ["WeightsLoad", "load_checkpoint", "save_checkpoint"]
