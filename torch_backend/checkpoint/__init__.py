"""The torch side of the one checkpoint format (``chunkzero.checkpoint``, docs/DESIGN.md §5):
:func:`save_checkpoint` / :func:`load_checkpoint` of a ``ZeroDDP`` and its ``ZeroOptimizer``
(:mod:`.sharded`), each rank writing and reading only its own shards; weights import
(:mod:`.pretrained`) and export (:mod:`.export`)."""

from .sharded import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
