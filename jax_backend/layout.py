"""The chunk layout as JAX arrays: chunk arrays <-> full-shaped tensors.

A *chunk array* is the 1-D array of one chunk of a :class:`chunkzero.ChunkLayout`: ``size``
elements (the layout's padded size at its world size), tensors back to back at their offsets,
zeros after ``utilized``. Chunk arrays travel as a dict keyed by the checkpoint's chunk keys
(``{"chunk_0000": Array[size], ...}``, :func:`chunkzero.checkpoint.chunk_key`), which is exactly the
``params`` subtree of a chunkzero checkpoint; optimizer-state chunks are
``{state_key: {chunk_key: f32[size]}}`` over trainable chunks only, the ``optim`` subtree.

:func:`unflatten` slices tensors out of chunk arrays and :func:`flatten` packs them back; both are
plain jnp code, so they trace under ``jax.jit`` and ``jax.grad`` (a loss of ``unflatten(chunks)``
has gradients shaped like the chunks, zeros in the padding).

Tensor names are the torch parameter names of the layout (``"transformer.h.0.attn.c_attn.weight"``);
nested dicts split them on ``"."``, so that tensor is
``params["transformer"]["h"]["0"]["attn"]["c_attn"]["weight"]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from chunkzero.checkpoint import chunk_index, chunk_key, param_array_dtype
from chunkzero.errors import CheckpointFormatError, ConfigError, LayoutError, ShapeMismatchError
from chunkzero.layout import ChunkInfo, ChunkLayout

from .mesh import DEFAULT_AXIS, chunk_sharding, mesh_world_size

Chunks = dict[str, jax.Array]
"""Chunk arrays keyed by chunk key (``"chunk_0000"`` …), each 1-D of the chunk's padded size."""

OptimizerChunks = dict[str, Chunks]
"""Optimizer-state chunk arrays: ``{state_key: {chunk_key: f32[size]}}``, trainable chunks only."""


# ---------------------------------------------------------------------------- name trees
def nest(flat: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """``{"a.b.c": x}`` -> ``{"a": {"b": {"c": x}}}``.

    Raises:
        LayoutError: a name is both a leaf and a prefix of another name.
    """
    out: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(sep)
        node = out
        for i, part in enumerate(parents):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise LayoutError(f"name {name!r} nests under {sep.join(parents[: i + 1])!r}, which is a tensor")
            node = nxt
        if leaf in node:
            raise LayoutError(f"name {name!r} is also a prefix of other names")
        node[leaf] = value
    return out


def flatten_names(tree: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """The inverse of :func:`nest`: ``{"a": {"b": x}}`` -> ``{"a.b": x}`` (keys turned to ``str``).

    A mapping whose values are not mappings is returned as a plain dict with ``str`` keys.
    """
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", tree)
    return out


# ---------------------------------------------------------------------------- chunk containers
def _indexed(chunks: Mapping[str, Any] | Sequence[Any], what: str) -> dict[int, Any]:
    if isinstance(chunks, Mapping):
        out = {}
        for k, v in chunks.items():
            try:
                out[chunk_index(k)] = v
            except CheckpointFormatError:
                raise LayoutError(f"{what}: key {k!r} is not a chunk key (expected chunk_NNNN)") from None
        return out
    if isinstance(chunks, Sequence) and not isinstance(chunks, (str, bytes)):
        return dict(enumerate(chunks))
    raise ConfigError(
        f"{what} must be a dict keyed by chunk key or a sequence by chunk index, got {type(chunks).__name__}"
    )


def check_chunks(chunks: Mapping[str, Any] | Sequence[Any], layout: ChunkLayout, *, trainable_only: bool = False,
                 what: str = "chunks") -> dict[int, Any]:
    """Validate chunk arrays against ``layout``; return them by chunk index.

    Args:
        chunks: ``{chunk_key: array}`` or a sequence indexed by chunk index.
        layout: the layout whose sizes the arrays must have (sizes depend on its world size).
        trainable_only: expect exactly the trainable (``requires_grad``) chunks, as optimizer state has.
        what: how to call ``chunks`` in error messages.

    Raises:
        LayoutError: a chunk is missing or an extra one is present (names its key).
        ShapeMismatchError: an array is not 1-D of the chunk's size (names its key and both shapes).
    """
    by_index = _indexed(chunks, what)
    wanted = [c for c in layout.chunks if c.requires_grad or not trainable_only]
    wanted_idx = {c.index for c in wanted}
    for c in wanted:
        if c.index not in by_index:
            raise LayoutError(f"{what}: missing {chunk_key(c.index)} (chunk {c.index} of {len(layout.chunks)})")
        shape = tuple(np.shape(by_index[c.index]))
        if shape != (c.size,):
            raise ShapeMismatchError(
                chunk_key(c.index), (c.size,), shape,
                f"{what}: chunk {c.index} of a layout at world size {layout.world_size}",
            )
    extra = sorted(set(by_index) - wanted_idx)
    if extra:
        kind = "trainable chunk" if trainable_only else "chunk"
        raise LayoutError(f"{what}: {chunk_key(extra[0])} is not a {kind} of the layout ({len(wanted)} expected)")
    return {i: by_index[i] for i in sorted(wanted_idx)}


def _tensor_views(arrays: dict[int, Any], layout: ChunkLayout, include_aliases: bool) -> dict[str, jax.Array]:
    views: dict[str, jax.Array] = {}
    for index, array in arrays.items():  # one chunk whole at a time (Note [one gather per chunk])
        whole = _whole_on_each_device(array)
        for t in layout.chunk_tensors(index):
            views[t.name] = jnp.reshape(whole[t.offset : t.end], t.shape)
    out: dict[str, jax.Array] = {}
    for t in layout.tensors:  # in parameter order
        if t.name in views:
            for name in t.names if include_aliases else (t.name,):
                out[name] = views[t.name]
    return out


# Note [one gather per chunk]. Outside ``jit``, slicing a tensor out of a chunk array sharded over several
# devices runs one program per slice, each with its own all-gather (a rendezvous of every device). Gathered
# once per chunk, the slices are local. The tensors come out replicated on the mesh either way; under
# ``jit`` nothing changes (XLA places the gathers itself).
def _whole_on_each_device(array):
    """A concrete chunk array sharded over a mesh, replicated on it (one all-gather); else ``array``."""
    sharding = getattr(array, "sharding", None)
    if isinstance(array, jax.core.Tracer) or not isinstance(sharding, NamedSharding) or sharding.is_fully_replicated:
        return array
    return jax.device_put(array, NamedSharding(sharding.mesh, PartitionSpec()))


def unflatten(chunks: Mapping[str, Any] | Sequence[Any], layout: ChunkLayout, *, nested: bool = True,
              include_aliases: bool = False) -> dict[str, Any]:
    """Full-shaped tensors sliced out of chunk arrays.

    Args:
        chunks: ``{chunk_key: Array[size]}`` (as :func:`jax_backend.restore_chunks` returns) or a
            sequence by chunk index; sizes must be ``layout``'s.
        layout: the layout at the arrays' world size.
        nested: return ``{"transformer": {"h": {"0": {...}}}}`` (names split on ``"."``); ``False``
            returns ``{"transformer.h.0.attn.c_attn.weight": Array, ...}`` in parameter order.
        include_aliases: also return tied aliases (``"lm_head.weight"``), the same array as the primary.

    Returns:
        Arrays of each tensor's shape, in the chunk arrays' dtype (fp32 masters for trainable
        chunks of a checkpoint). Traceable under ``jit``/``grad``.

    Raises:
        LayoutError, ShapeMismatchError: see :func:`check_chunks`.
    """
    flat = _tensor_views(check_chunks(chunks, layout), layout, include_aliases)
    return nest(flat) if nested else flat


def unflatten_optimizer(
    opt_state_chunks: Mapping[str, Any], layout: ChunkLayout, *, nested: bool = True
) -> dict[str, dict]:
    """:func:`unflatten` for optimizer state: ``{state_key: {chunk_key: f32[size]}}`` over trainable
    chunks -> ``{state_key: tensors}`` (frozen tensors have no optimizer state and are absent).

    Raises:
        LayoutError, ShapeMismatchError: see :func:`check_chunks`.
    """
    out = {}
    for key, chunks in opt_state_chunks.items():
        arrays = check_chunks(chunks, layout, trainable_only=True, what=f"optimizer state {key!r}")
        flat = _tensor_views(arrays, layout, include_aliases=False)
        out[key] = nest(flat) if nested else flat
    return out


def _pack(tensors: Mapping[str, Any], layout: ChunkLayout, chunk: ChunkInfo, dtype: str, what: str) -> jax.Array:
    parts = []
    for t in layout.chunk_tensors(chunk.index):
        value = None
        for name in t.names:
            if name in tensors:
                value = tensors[name]
                break
        if value is None:
            raise LayoutError(f"{what}: no tensor {t.name!r} (chunk {chunk.index}, shape {t.shape})")
        shape = tuple(np.shape(value))
        if shape != t.shape:
            raise ShapeMismatchError(t.name, t.shape, shape, f"{what} vs the layout")
        parts.append(jnp.ravel(jnp.asarray(value)).astype(dtype))
    if chunk.padding:
        parts.append(jnp.zeros((chunk.padding,), dtype))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _place(array: jax.Array, mesh: Mesh | None, chunk: ChunkInfo, axis: str) -> jax.Array:
    return array if mesh is None else jax.device_put(array, chunk_sharding(mesh, chunk, axis))


def _check_mesh(layout: ChunkLayout, mesh: Mesh | None, axis: str) -> None:
    if mesh is not None:
        n = mesh_world_size(mesh, axis)
        if n != layout.world_size:
            raise ConfigError(
                f"mesh axis {axis!r} has {n} devices but the layout is for world size {layout.world_size}; "
                f"use layout.relayout({n})"
            )


def flatten(params: Mapping[str, Any], layout: ChunkLayout, *, mesh: Mesh | None = None, axis: str = DEFAULT_AXIS,
            dtype: Any = None) -> Chunks:
    """Pack full-shaped tensors into padded chunk arrays (the reverse of :func:`unflatten`).

    Args:
        params: nested (``params["transformer"]["wte"]["weight"]``) or flat (``"transformer.wte.weight"``)
            tensors by the layout's names; a tied tensor may be given under any of its names. Extra
            entries are ignored.
        layout: gives each chunk's size (its world size's padding), offsets and dtype.
        mesh: if given, place each chunk with :func:`jax_backend.mesh.chunk_sharding` (``P(axis)``, or
            replicated when keep-gathered); the mesh's ``axis`` size must equal ``layout.world_size``.
        dtype: dtype of every chunk array; default the checkpoint's, ``param_array_dtype(chunk)``
            (float32 masters for trainable chunks, the chunk's own dtype for frozen ones).

    Returns:
        ``{chunk_key: Array[size]}``, zeros in the padding.

    Raises:
        LayoutError: a tensor of the layout is missing from ``params`` (names it).
        ShapeMismatchError: a tensor's shape differs from the layout's (names it and both shapes).
        ConfigError: the mesh lacks ``axis`` or its size is not the layout's world size.
    """
    _check_mesh(layout, mesh, axis)
    flat = flatten_names(params)
    out = {}
    for c in layout.chunks:
        dt = jnp.dtype(dtype if dtype is not None else param_array_dtype(c))
        out[chunk_key(c.index)] = _place(_pack(flat, layout, c, dt, "params"), mesh, c, axis)
    return out


def flatten_optimizer(opt_state: Mapping[str, Mapping[str, Any]], layout: ChunkLayout, *, mesh: Mesh | None = None,
                      axis: str = DEFAULT_AXIS) -> OptimizerChunks:
    """Pack per-tensor optimizer state ``{state_key: tensors}`` into float32 chunk arrays of the
    trainable chunks: ``{state_key: {chunk_key: f32[size]}}`` (the reverse of :func:`unflatten_optimizer`).

    Raises:
        LayoutError, ShapeMismatchError, ConfigError: as :func:`flatten`.
    """
    _check_mesh(layout, mesh, axis)
    out: OptimizerChunks = {}
    for key, tensors in opt_state.items():
        flat = flatten_names(tensors)
        out[key] = {
            chunk_key(c.index): _place(_pack(flat, layout, c, jnp.float32, f"optimizer state {key!r}"), mesh, c, axis)
            for c in layout.chunks
            if c.requires_grad
        }
    return out


def shard_chunks(chunks: Mapping[str, Any], layout: ChunkLayout, mesh: Mesh, *, axis: str = DEFAULT_AXIS) -> Chunks:
    """Place chunk arrays (numpy or jax) on ``mesh``: ``P(axis)`` per sharded chunk, replicated
    per keep-gathered chunk. Accepts a subset of the layout's chunks (e.g. trainable only).

    Raises:
        ConfigError: the mesh lacks ``axis`` or its size is not the layout's world size.
        ShapeMismatchError: an array is not 1-D of its chunk's size.
    """
    _check_mesh(layout, mesh, axis)
    out = {}
    for k, v in _indexed(chunks, "chunks").items():
        if not 0 <= k < len(layout.chunks):
            raise LayoutError(f"chunks: {chunk_key(k)} is not a chunk of the layout ({len(layout.chunks)} chunks)")
        c = layout.chunks[k]
        if tuple(np.shape(v)) != (c.size,):
            raise ShapeMismatchError(
                chunk_key(k), (c.size,), np.shape(v), f"chunk {k} at world size {layout.world_size}"
            )
        out[chunk_key(k)] = jax.device_put(v, chunk_sharding(mesh, c, axis))
    return out
