"""The ``state`` item's tree: array paths ↔ the nested dict Orbax saves, and one rank's checked shards."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..dtypes import numpy_dtype
from ..errors import ConfigError, ShapeMismatchError
from .meta import EMA_KEY, OPTIM_KEY, PARAMS_KEY, ArrayPath, CheckpointMeta, array_name, chunk_index


def state_tree(arrays: Mapping[ArrayPath, Any]) -> dict[str, Any]:
    """Nest ``path -> array`` into the saved tree ``{"params": {chunk_key: a}, "optim": {key: {chunk_key: a}},
    "ema": {chunk_key: a}}``."""
    tree: dict[str, Any] = {}
    for path, a in arrays.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = a
    return tree


def flat_arrays(tree: Mapping[str, Any]) -> dict[ArrayPath, Any]:
    """Inverse of :func:`state_tree`: ``path -> array`` of the ``params``, ``optim`` and ``ema`` subtrees."""
    out: dict[ArrayPath, Any] = {(PARAMS_KEY, k): v for k, v in tree.get(PARAMS_KEY, {}).items()}
    out.update({(EMA_KEY, k): v for k, v in (tree.get(EMA_KEY) or {}).items()})
    for key, sub in tree.get(OPTIM_KEY, {}).items():
        out.update({(OPTIM_KEY, key, k): v for k, v in sub.items()})
    return out


def shard_arrays(meta: CheckpointMeta, params: Mapping[int, Any],
                 optim: Mapping[str, Mapping[int, Any]] | None = None,
                 ema: Mapping[int, Any] | None = None) -> dict[ArrayPath, np.ndarray]:
    """One rank's shard of every array ``meta`` promises, checked and in the saved dtype.

    Args:
        meta: the metadata to save (its layout's world size is the number of writing ranks).
        params: chunk index -> this rank's shard of the chunk's ``params`` array (``shard_numel``
            elements, padded), for every chunk; keep-gathered chunks whole.
        optim: state key -> chunk index -> shard, for every trainable chunk and every key of
            ``meta.optimizer.state_keys``.
        ema: chunk index -> this rank's EMA shard, for every trainable chunk when ``meta.ema`` is set.

    Returns:
        ``path -> 1-D numpy array`` in :meth:`CheckpointMeta.expected_arrays` order (cast where the
        dtype differs; otherwise views of the arrays given).

    Raises:
        ConfigError: a shard or an optimizer-state key is missing, ``optim`` holds other keys than
            the metadata lists, or ``ema`` is given without ``meta.ema`` or the other way round.
        ShapeMismatchError: a shard's numel differs from the layout's shard numel (names the array).
    """
    optim = optim or {}
    state_keys = list(meta.optimizer.state_keys) if meta.optimizer else []
    if sorted(optim) != sorted(state_keys):
        raise ConfigError(f"optimizer shards for {sorted(optim)} but meta lists state keys {state_keys}")
    if (ema is None) != (meta.ema is None):
        raise ConfigError("EMA shards and the metadata's ema record go together: give both or neither")
    out: dict[ArrayPath, np.ndarray] = {}
    for path, (_, dtype) in meta.expected_arrays().items():
        chunk = chunk_index(path[-1])
        given = params if path[0] == PARAMS_KEY else ema if path[0] == EMA_KEY else optim[path[1]]
        if chunk not in given:
            what = path[0] if path[0] in (PARAMS_KEY, EMA_KEY) else f"optimizer {path[1]!r}"
            raise ConfigError(f"no {what} shard for chunk {chunk}")
        local = np.ascontiguousarray(given[chunk]).reshape(-1)
        want = meta.layout.shard_numel(chunk)
        if local.size != want:
            raise ShapeMismatchError(array_name(path), (want,), local.shape, "this rank's shard")
        out[path] = local if local.dtype == numpy_dtype(dtype) else local.astype(numpy_dtype(dtype))
    return out


__all__ = ["flat_arrays", "shard_arrays", "state_tree"]
