"""chunkzero checkpoints in JAX: restore on any device count, save back for torch.

The format is :mod:`chunkzero.checkpoint`'s (DESIGN.md §5); the Orbax plumbing is in
:mod:`jax_backend.orbax_io`. A checkpoint saved at world size ``W`` holds each chunk padded to a
multiple of ``W``; restoring on a mesh whose data axis has ``n`` devices uses
``meta.layout.relayout(n)``: every tensor keeps its chunk and offset, only the padding changes, so
each chunk is read with ``global_shape=(new_size,)`` and ``strict=False`` (Orbax appends zeros or
drops trailing padding) and a target sharding ``NamedSharding(mesh, P(axis))``, under which each
device reads only the slice it owns. Keep-gathered chunks are restored replicated (``P()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from chunkzero.checkpoint import (
    CHECKSUM_ALGORITHM,
    META_ITEM,
    MIXED_PRECISIONS,
    OPTIM_KEY,
    PARAMS_KEY,
    STATE_ITEM,
    CheckpointMeta,
    OptimizerMeta,
    checksum_key,
    chunk_index,
    chunk_key,
    param_array_dtype,
    shard_checksum,
)
from chunkzero.errors import CheckpointError, CheckpointFormatError, ConfigError
from chunkzero.layout import ChunkLayout

from . import orbax_io
from .layout import Chunks, OptimizerChunks, check_chunks
from .mesh import DEFAULT_AXIS, chunk_sharding, mesh_world_size


@dataclass
class RestoredCheckpoint:
    """What :func:`restore_checkpoint` returns.

    Attributes:
        chunks: ``{chunk_key: Array[size]}`` parameter chunk arrays at the mesh's world size
            (fp32 masters for trainable chunks), ``NamedSharding(mesh, P(axis))`` (keep-gathered: ``P()``).
        layout: ``meta.layout.relayout(n)``, the layout of ``chunks`` (``n`` devices on ``axis``).
        meta: the checkpoint's :class:`CheckpointMeta` as saved (``meta.layout`` is at the saving world size).
        opt_state_chunks: ``{state_key: {chunk_key: f32[size]}}`` over trainable chunks, or ``None``
            when not requested.
        path: the step directory read.
    """

    chunks: Chunks
    layout: ChunkLayout
    meta: CheckpointMeta
    opt_state_chunks: OptimizerChunks | None
    path: Path


def abstract_state(layout: ChunkLayout, mesh: Mesh, *, axis: str = DEFAULT_AXIS,
                   state_keys: tuple[str, ...] | list[str] = ()) -> tuple[dict, dict]:
    """Restore targets for :func:`orbax_io.restore_state`: ``(item, restore_args)`` trees.

    ``item`` holds ``jax.ShapeDtypeStruct((size,), dtype, sharding=...)`` per chunk of ``layout``
    (sizes at the layout's world size), ``restore_args`` the matching ``ocp.ArrayRestoreArgs`` with
    ``strict=False`` so a checkpoint saved at another world size is re-padded. ``state_keys`` adds
    the optimizer-state subtrees (float32, trainable chunks).
    """
    item: dict[str, Any] = {PARAMS_KEY: {}}
    args: dict[str, Any] = {PARAMS_KEY: {}}

    def add(item_node: dict, args_node: dict, c, dtype) -> None:
        sharding = chunk_sharding(mesh, c, axis)
        dt = jnp.dtype(dtype)
        item_node[chunk_key(c.index)] = jax.ShapeDtypeStruct((c.size,), dt, sharding=sharding)
        args_node[chunk_key(c.index)] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=(c.size,), dtype=dt, strict=False)

    for c in layout.chunks:
        add(item[PARAMS_KEY], args[PARAMS_KEY], c, param_array_dtype(c))
    if state_keys:
        item[OPTIM_KEY], args[OPTIM_KEY] = {}, {}
        for key in state_keys:
            item[OPTIM_KEY][key], args[OPTIM_KEY][key] = {}, {}
            for c in layout.chunks:
                if c.requires_grad:
                    add(item[OPTIM_KEY][key], args[OPTIM_KEY][key], c, jnp.float32)
    return item, args


@jax.jit
def _tail_abs_max(x: jax.Array, start: jax.Array) -> jax.Array:
    mask = jnp.arange(x.shape[0]) >= start
    return jnp.max(jnp.where(mask, jnp.abs(x.astype(jnp.float32)), 0.0))


def _check_padding(chunks: Mapping[str, jax.Array], layout: ChunkLayout, where: str, what: str) -> None:
    for c in layout.chunks:
        key = chunk_key(c.index)
        if key in chunks and c.padding:
            worst = float(_tail_abs_max(chunks[key], c.utilized))
            if worst != 0.0:
                raise CheckpointError(
                    f"{where}: {what} {key} has non-zero padding (max |x| = {worst:g} after element {c.utilized}); "
                    "chunk padding must be zeros"
                )


def _saved_shards(layout: ChunkLayout, chunk: int) -> list[tuple[int, int, int]]:
    """``(saving rank, start, stop)``: the valid element range of each saved shard (one for a
    keep-gathered chunk), the unit a checksum covers."""
    c = layout.chunks[chunk]
    if c.keep_gathered:
        return [(0, 0, c.utilized)]
    return [(q, layout.shard_range(chunk, q)[0], layout.shard_range(chunk, q)[0] + layout.valid_length(chunk, q))
            for q in range(layout.world_size)]


def _host(array: Any) -> np.ndarray | None:
    """The whole array on this host, or ``None`` when part of it lives on another process."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return None
    return np.asarray(array)


def _flat_arrays(state: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    out = {}
    for k, v in state.get(PARAMS_KEY, {}).items():
        out[(PARAMS_KEY, k)] = v
    for key, sub in state.get(OPTIM_KEY, {}).items():
        for k, v in sub.items():
            out[(OPTIM_KEY, key, k)] = v
    return out


def compute_checksums(state: Mapping[str, Any], layout: ChunkLayout) -> dict[str, Any] | None:
    """The ``meta.checksums`` record of a ``state`` tree saved with ``layout`` (see
    :func:`chunkzero.checkpoint.shard_checksum`): per array, one checksum per saving rank's shard over
    its valid elements. ``None`` when an array is not fully addressable from this process (multi-host);
    readers then skip verification."""
    arrays = {}
    for path, value in _flat_arrays(state).items():
        host = _host(value)
        if host is None:
            return None
        arrays[checksum_key(path)] = [shard_checksum(host[a:b]) for _, a, b in _saved_shards(layout, chunk_index(path[-1]))]
    return {"algorithm": CHECKSUM_ALGORITHM, "arrays": arrays}


def verify_checksums(state: Mapping[str, Any], meta: CheckpointMeta, where: str) -> bool:
    """Check restored arrays against ``meta.checksums`` (written at ``meta.layout``'s world size).

    The saved shards' element ranges are the same in the restored arrays (only padding changes with
    the world size), so each saved shard's checksum is recomputed from the restored data.

    Returns:
        ``False`` when nothing could be verified (no checksums, or arrays not fully addressable).

    Raises:
        CheckpointError: a shard's checksum differs (names the array, the saving rank and the range).
        CheckpointFormatError: an array has no checksum in a checkpoint that has them.
    """
    if not meta.checksums:
        return False
    sums = meta.checksums["arrays"]
    for path, value in _flat_arrays(state).items():
        key = checksum_key(path)
        if key not in sums:
            raise CheckpointFormatError(f"{where}/{META_ITEM}: no checksum for array {key!r}")
        host = _host(value)
        if host is None:
            return False
        for q, a, b in _saved_shards(meta.layout, chunk_index(path[-1])):
            got = shard_checksum(host[a:b])
            if got != sums[key][q]:
                raise CheckpointError(
                    f"{where}/{STATE_ITEM}: array {key!r} is corrupted: elements [{a}, {b}) saved by rank {q} have "
                    f"checksum {got}, the metadata recorded {sums[key][q]}"
                )
    return True


def restore_checkpoint(path: str | Path, mesh: Mesh, *, axis: str = DEFAULT_AXIS, step: int | None = None,
                       with_optimizer: bool = False, check_padding: bool = True, verify: bool = True) -> RestoredCheckpoint:
    """Restore a chunkzero checkpoint's chunk arrays onto ``mesh``, re-padded for its device count.

    Args:
        path: a step directory ``<root>/<step>`` or a root ``<root>`` (then ``step``, default the latest).
        mesh: any mesh with an axis ``axis``; its size ``n`` there is the new world size (1, 2, 3 …).
        axis: the data-parallel axis name.
        step: with a root, the step to restore.
        with_optimizer: also restore the optimizer-state chunks (``meta.optimizer.state_keys``).
        check_padding: verify the padding of every restored chunk is zeros (one reduction per chunk).
        verify: check the restored data against ``meta.checksums`` when the checkpoint has them (the
            torch backend writes them; costs one host copy of the restored arrays).

    Returns:
        A :class:`RestoredCheckpoint`.

    Raises:
        ConfigError: ``mesh`` has no axis ``axis`` (names the axes it has).
        CheckpointError: missing path/step, unreadable or corrupt items (names the path), a checksum
            mismatch, a requested optimizer state the checkpoint does not have, non-zero padding.
        CheckpointFormatError: metadata fails validation, or an array it lists is missing or
            mis-shaped on disk (names the array and both shapes).
    """
    n = mesh_world_size(mesh, axis)
    root, s = orbax_io.resolve_checkpoint(path, step)
    where = orbax_io.step_dir(root, s)
    meta = orbax_io.read_meta(root, s)
    if with_optimizer and meta.optimizer is None:
        raise CheckpointError(f"{where}: checkpoint has no optimizer state (saved parameters only)")
    orbax_io.check_arrays(meta, orbax_io.read_array_metadata(root, s), source=str(where), with_optimizer=with_optimizer)
    layout = meta.layout.relayout(n)
    keys = tuple(meta.optimizer.state_keys) if with_optimizer else ()
    item, args = abstract_state(layout, mesh, axis=axis, state_keys=keys)
    state = orbax_io.restore_state(root, s, item, args)
    chunks = dict(state[PARAMS_KEY])
    opt = {k: dict(v) for k, v in state[OPTIM_KEY].items()} if keys else None
    if verify:
        verify_checksums(state, meta, str(where))
    if check_padding:
        _check_padding(chunks, layout, str(where), "params")
        for k, v in (opt or {}).items():
            _check_padding(v, layout, str(where), f"optimizer state {k!r}")
    return RestoredCheckpoint(chunks, layout, meta, opt, where)


def restore_chunks(path: str | Path, mesh: Mesh, *, axis: str = DEFAULT_AXIS, step: int | None = None,
                   with_optimizer: bool = False):
    """A checkpoint's parameter chunk arrays on ``mesh`` and their layout.

    ``chunks, layout = restore_chunks("runs/ckpt/100", mesh)``; with ``with_optimizer=True``,
    ``chunks, layout, opt_state_chunks = ...``. See :func:`restore_checkpoint` (which also returns
    the metadata) for arguments and errors.

    Returns:
        ``chunks``: ``{chunk_key: Array[size]}``, 1-D, padded to ``layout``'s sizes, float32 for
        trainable chunks, sharded ``P(axis)`` (keep-gathered: replicated); ``layout``: the
        checkpoint's layout relaid out for ``mesh.shape[axis]`` devices; ``opt_state_chunks``:
        ``{state_key: {chunk_key: f32[size]}}`` over trainable chunks.
    """
    r = restore_checkpoint(path, mesh, axis=axis, step=step, with_optimizer=with_optimizer)
    return (r.chunks, r.layout, r.opt_state_chunks) if with_optimizer else (r.chunks, r.layout)


def restore_optimizer_chunks(path: str | Path, mesh: Mesh, *, axis: str = DEFAULT_AXIS, step: int | None = None
                             ) -> tuple[OptimizerChunks, ChunkLayout, OptimizerMeta]:
    """Only the optimizer-state chunk arrays: ``(opt_state_chunks, layout, optimizer_meta)``.

    Parameter arrays are not read. Errors as :func:`restore_checkpoint`.
    """
    n = mesh_world_size(mesh, axis)
    root, s = orbax_io.resolve_checkpoint(path, step)
    where = orbax_io.step_dir(root, s)
    meta = orbax_io.read_meta(root, s)
    if meta.optimizer is None:
        raise CheckpointError(f"{where}: checkpoint has no optimizer state (saved parameters only)")
    orbax_io.check_arrays(meta, orbax_io.read_array_metadata(root, s), source=str(where))
    layout = meta.layout.relayout(n)
    item, args = abstract_state(layout, mesh, axis=axis, state_keys=tuple(meta.optimizer.state_keys))
    del item[PARAMS_KEY], args[PARAMS_KEY]
    state = orbax_io.restore_state(root, s, item, args)
    verify_checksums(state, meta, str(where))
    opt = {k: dict(v) for k, v in state[OPTIM_KEY].items()}
    for k, v in opt.items():
        _check_padding(v, layout, str(where), f"optimizer state {k!r}")
    return opt, layout, meta.optimizer


def _as_jax(x: Any) -> jax.Array:
    return x if isinstance(x, jax.Array) else jnp.asarray(np.asarray(x))


def save_checkpoint(directory: str | Path, chunks: Mapping[str, Any], layout: ChunkLayout, *, step: int,
                    opt_state_chunks: Mapping[str, Mapping[str, Any]] | None = None,
                    optimizer_meta: OptimizerMeta | Mapping[str, Any] | None = None,
                    mixed_precision: str = "fp32", loss_scaler: dict | None = None, model_config: dict | None = None,
                    data_position: dict | None = None, rng_states: list[dict] | None = None, extra: dict | None = None,
                    checksums: bool = True, options: ocp.CheckpointManagerOptions | None = None) -> Path:
    """Write chunk arrays as a chunkzero checkpoint step ``<directory>/<step>/`` that torch can resume.

    Args:
        directory: the checkpoint root (created if missing).
        chunks: ``{chunk_key: Array[size]}`` for every chunk of ``layout``, in ``param_array_dtype``
            (float32 masters for trainable chunks); ``jax.Array`` s keep their sharding (each device's
            shard is written once), numpy arrays are written whole.
        layout: the layout of the arrays; its ``world_size`` is recorded as the saving world size.
        step: training step; must not exist under ``directory`` yet.
        opt_state_chunks: ``{state_key: {chunk_key: f32[size]}}`` over trainable chunks, or ``None``.
        optimizer_meta: :class:`OptimizerMeta` (or its dict: ``class_name``, ``hyperparameters``,
            ``state_keys``, ``step``); its ``state_keys`` must be the keys of ``opt_state_chunks``.
        mixed_precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (the compute precision torch resumes with).
        loss_scaler, model_config, data_position, rng_states, extra: JSON-able, stored in ``meta``.
        checksums: record ``meta.checksums`` per saved shard (as the torch backend does, so its loader
            verifies what it reads); skipped when an array is not fully addressable (multi-host).
        options: ``ocp.CheckpointManagerOptions`` passed through.

    Returns:
        The step directory.

    Raises:
        LayoutError / ShapeMismatchError: a chunk is missing, extra or mis-sized (names it and both shapes).
        CheckpointError: a chunk has the wrong dtype, the optimizer arguments disagree, or the step
            exists (nothing is overwritten).
        ConfigError: bad ``mixed_precision`` or ``step``.
    """
    if mixed_precision not in MIXED_PRECISIONS:
        raise ConfigError(f"mixed_precision must be one of {MIXED_PRECISIONS}, got {mixed_precision!r}")
    params = check_chunks(chunks, layout, what="chunks")
    state: dict[str, Any] = {PARAMS_KEY: {}}
    for c in layout.chunks:
        arr = _as_jax(params[c.index])
        want = jnp.dtype(param_array_dtype(c))
        if arr.dtype != want:
            raise CheckpointError(f"chunk {chunk_key(c.index)} is {arr.dtype}, the checkpoint stores it as {want}")
        state[PARAMS_KEY][chunk_key(c.index)] = arr
    if isinstance(optimizer_meta, Mapping):
        optimizer_meta = OptimizerMeta(**optimizer_meta)
    if opt_state_chunks is not None:
        if optimizer_meta is None:
            raise CheckpointError("opt_state_chunks given without optimizer_meta (class, hyper-parameters, step)")
        if sorted(opt_state_chunks) != sorted(optimizer_meta.state_keys):
            raise CheckpointError(
                f"optimizer state keys {sorted(opt_state_chunks)} differ from optimizer_meta.state_keys "
                f"{sorted(optimizer_meta.state_keys)}"
            )
        state[OPTIM_KEY] = {}
        for key in optimizer_meta.state_keys:
            arrays = check_chunks(opt_state_chunks[key], layout, trainable_only=True, what=f"optimizer state {key!r}")
            state[OPTIM_KEY][key] = {}
            for i, a in arrays.items():
                a = _as_jax(a)
                if a.dtype != jnp.float32:
                    raise CheckpointError(f"optimizer state {key!r} {chunk_key(i)} is {a.dtype}, expected float32")
                state[OPTIM_KEY][key][chunk_key(i)] = a
    elif optimizer_meta is not None and optimizer_meta.state_keys:
        raise CheckpointError(f"optimizer_meta lists state keys {optimizer_meta.state_keys} but no opt_state_chunks were given")
    meta = CheckpointMeta(
        step=step, layout=layout, mixed_precision=mixed_precision, optimizer=optimizer_meta, loss_scaler=loss_scaler,
        model_config=model_config, data_position=data_position, rng_states=rng_states, extra=extra,
        checksums=compute_checksums(state, layout) if checksums else None,
    )
    return orbax_io.write_checkpoint(directory, step, state, meta, options=options)


__all__ = [
    "RestoredCheckpoint",
    "abstract_state",
    "compute_checksums",
    "restore_checkpoint",
    "restore_chunks",
    "restore_optimizer_chunks",
    "save_checkpoint",
    "verify_checksums",
]
