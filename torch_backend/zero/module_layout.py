"""The chunk layout of a module's parameters: which tensors ``ZeroDDP`` manages, with which names
and dtypes, packed by the core (:class:`chunkzero.ChunkLayout`, the chunk size searched by
:func:`chunkzero.search.search_chunk_size` unless given)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from chunkzero import ChunkLayout, TensorSpec
from chunkzero.errors import ConfigError

from .chunks import TORCH_DTYPES

__all__ = ["ParamGroups", "build_module_layout", "collect_parameters", "default_chunk_size"]


def default_chunk_size(specs: list[TensorSpec], world_size: int) -> tuple[int, int]:
    """``(chunk size, keep_gathered_below_numel)`` in elements used when ``ZeroDDP(chunk_size=None)``:
    the core search, ``chunkzero.search.search_chunk_size``."""
    from chunkzero.search import search_chunk_size

    result = search_chunk_size(specs, world_size)
    return int(result.chunk_size), int(result.keep_gathered_below_numel)


ParamGroups = dict[int, tuple[nn.Parameter, list[str]]]
"""``id(parameter) -> (parameter, its names)``, in registration order."""


def _storage_dtype_name(dtype: torch.dtype) -> str:
    """The dtype a frozen tensor is stored in: its own (float32, bfloat16, float16); float64 is
    narrowed to float32, as trainable tensors' fp32 masters are."""
    name = str(dtype).removeprefix("torch.")
    return name if name in TORCH_DTYPES else "float32"


def collect_parameters(module: nn.Module) -> ParamGroups:
    """The module's parameters, deduplicated by identity (tied weights: one entry, every name).

    Raises:
        ConfigError: no parameters, or a non-floating one (named).
    """
    groups: ParamGroups = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), (p, []))[1].append(name)
    if not groups:
        raise ConfigError(f"{type(module).__name__} has no parameters to shard")
    for p, names in groups.values():
        if not p.is_floating_point():
            raise ConfigError(f"parameter {names[0]!r} has dtype {p.dtype}; only floating parameters can be sharded")
    return groups


def _keep_gathered_predicate(keep_gathered) -> Callable[[str], bool]:
    """``keep_gathered`` (``None``, names, or a predicate) as a predicate over parameter names.

    Raises:
        ConfigError: neither names nor a predicate.
    """
    if keep_gathered is None:
        return lambda name: False
    if callable(keep_gathered):
        return lambda name: bool(keep_gathered(name))
    if isinstance(keep_gathered, str):
        keep_gathered = [keep_gathered]
    try:
        names = set(keep_gathered)
    except TypeError:
        raise ConfigError(f"keep_gathered must be names or a predicate, got {type(keep_gathered).__name__}") from None
    return lambda name: name in names


def build_module_layout(groups: ParamGroups, dtype_name: str, world_size: int, chunk_size: int | None,
                 keep_gathered) -> ChunkLayout:
    """The core layout over ``groups`` (one spec per parameter object, its other names as aliases).

    A trainable tensor's chunk is in the compute dtype ``dtype_name`` (its fp32 master is kept
    apart); a frozen one's in its storage dtype, so frozen tensors of different dtypes never share a
    chunk. ``chunk_size=None`` (elements) searches it.

    Raises:
        ConfigError: ``keep_gathered`` is neither names nor a predicate.
    """
    is_kg = _keep_gathered_predicate(keep_gathered)
    specs = [TensorSpec(names[0], tuple(p.shape), dtype_name if p.requires_grad else _storage_dtype_name(p.dtype),
                        tuple(names[1:]), bool(p.requires_grad), any(is_kg(n) for n in names))
             for p, names in groups.values()]
    keep_below = 0
    if chunk_size is None:
        chunk_size, keep_below = default_chunk_size(specs, world_size)
    return ChunkLayout.build(specs, chunk_size, world_size, keep_gathered_below_numel=keep_below)
