"""Export a chunk checkpoint to a parameter tree (Orbax or safetensors), import full weights into
ZeroDDP, and read single tensors as torch tensors.

The export streams one chunk at a time and needs no torch: it is
:func:`chunkzero.checkpoint.export.export_checkpoint` (``chunkzero export``), re-exported here with
:func:`iter_tensors`. The import is :func:`.pretrained.load_pretrained`.
"""

from __future__ import annotations

import os

import torch

from chunkzero.checkpoint import PARAMS_KEY, chunk_key, orbax_store, read_meta
from chunkzero.checkpoint.export import (
    DEFAULT_MAX_SHARD_SIZE,
    EXPORT_DTYPES,
    FORMATS,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    ExportReport,
    export_checkpoint,
    iter_tensors,
    param_tree,
    parse_size,
)
from chunkzero.checkpoint.reader import ChunkReader
from chunkzero.errors import CheckpointError

from .numpy_bridge import to_torch
from .pretrained import ImportReport, load_pretrained

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "EXPORT_DTYPES",
    "FORMATS",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "ExportReport",
    "ImportReport",
    "export_checkpoint",
    "iter_tensors",
    "load_pretrained",
    "param_tree",
    "parse_size",
    "read_tensor",
]


def read_tensor(path: str | os.PathLike, name: str, step: int | None = None) -> torch.Tensor:
    """One full-shaped parameter of a checkpoint, by name or alias, as saved (reads only its chunk's range).

    Raises:
        CheckpointError: no such checkpoint, step or tensor.
    """
    step_dir = orbax_store.committed_step_dir(path, step)
    meta = read_meta(step_dir)
    if name not in meta.layout:
        raise CheckpointError(f"no tensor {name!r} in {str(step_dir)!r}")
    t = meta.layout.tensor(name)
    reader = ChunkReader(step_dir, meta)
    return to_torch(reader.read((PARAMS_KEY, chunk_key(t.chunk)), t.offset, t.end)).reshape(t.shape)
