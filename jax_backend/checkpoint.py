"""chunkzero checkpoints in JAX: restore on any device count, save back for torch.

The JAX adapter of :mod:`chunkzero.checkpoint`, which owns the format and all Orbax I/O
(:mod:`chunkzero.checkpoint.orbax_store`): here the chunk arrays get their shardings. A checkpoint saved
at world size ``W`` holds each chunk padded to a multiple of ``W``; restoring on a mesh whose data axis
has ``n`` devices uses ``meta.layout.relayout(n)``: every tensor keeps its chunk and offset, only the
padding changes, so each chunk is read with ``global_shape=(new_size,)`` and ``strict=False`` (Orbax
appends zeros or drops trailing padding) and a target sharding ``NamedSharding(mesh, P(axis))``, under
which each device reads only the slice it owns. Keep-gathered chunks are restored replicated (``P()``).

``item="ema"`` restores the EMA weights a torch ``ZeroEMA`` saved (the ``ema`` arrays) in place of the
trainable chunks' masters, the frozen chunks as saved, so ``unflatten`` gives the EMA parameter tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from chunkzero.checkpoint import (
    EMA_KEY,
    MIXED_PRECISIONS,
    OPTIM_KEY,
    PARAMS_KEY,
    CheckpointMeta,
    EmaMeta,
    OptimizerMeta,
    checksum_key,
    chunk_key,
    combine_checksums,
    flat_arrays,
    orbax_store,
    param_array_dtype,
    read_meta,
    shard_checksum,
    state_tree,
)
from chunkzero.checkpoint.meta import META_ITEM, array_name
from chunkzero.errors import CheckpointError, CheckpointFormatError, ConfigError
from chunkzero.layout import ChunkLayout

from .layout import Chunks, OptimizerChunks, check_chunks
from .mesh import DEFAULT_AXIS, chunk_sharding, mesh_world_size


@dataclass
class RestoredCheckpoint:
    """What :func:`restore_checkpoint` returns.

    Attributes:
        chunks: ``{chunk_key: Array[size]}`` parameter chunk arrays at the mesh's world size
            (fp32 masters for trainable chunks — their EMA with ``item="ema"``), ``NamedSharding(mesh, P(axis))``
            (keep-gathered: ``P()``).
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
                   state_keys: tuple[str, ...] | list[str] = (), ema: bool = False) -> tuple[dict, dict]:
    """Restore targets for :func:`chunkzero.checkpoint.orbax_store.restore_arrays`: ``(item, restore_args)`` trees.

    ``item`` holds ``jax.ShapeDtypeStruct((size,), dtype, sharding=...)`` per chunk of ``layout``
    (sizes at the layout's world size), ``restore_args`` the matching ``ocp.ArrayRestoreArgs`` with
    ``strict=False`` so a checkpoint saved at another world size is re-padded. ``state_keys`` adds
    the optimizer-state subtrees (float32, trainable chunks); ``ema`` reads the trainable chunks from
    the ``ema`` subtree instead of ``params``.
    """
    item: dict[tuple[str, ...], jax.ShapeDtypeStruct] = {}
    for c in layout.chunks:
        kind = EMA_KEY if ema and c.requires_grad else PARAMS_KEY
        item[(kind, chunk_key(c.index))] = jax.ShapeDtypeStruct(
            (c.size,), jnp.dtype(param_array_dtype(c)), sharding=chunk_sharding(mesh, c, axis))
    for key in state_keys:
        for c in layout.chunks:
            if c.requires_grad:
                item[(OPTIM_KEY, key, chunk_key(c.index))] = jax.ShapeDtypeStruct(
                    (c.size,), jnp.float32, sharding=chunk_sharding(mesh, c, axis))
    tree = state_tree(item)
    return tree, orbax_store.array_restore_args(tree)


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


def _owned_pieces(a: Any) -> list[tuple[int, np.ndarray]]:
    """``(first element, 1-D data)`` of each piece of 1-D array ``a`` this process writes or checks: its
    addressable shards of replica 0 (every element of a global array is in one of them on exactly one
    process), adjacent ones joined; a numpy or single-process array whole."""
    if not isinstance(a, jax.Array):
        return [(0, np.asarray(a).reshape(-1))]
    pieces: list[tuple[int, np.ndarray]] = []
    for start, data in sorted((s.index[0].start or 0, np.asarray(s.data).reshape(-1))
                              for s in a.addressable_shards if s.replica_id == 0):
        if pieces and pieces[-1][0] + pieces[-1][1].size == start:
            pieces[-1] = (pieces[-1][0], np.concatenate([pieces[-1][1], data]))
        else:
            pieces.append((start, data))
    return pieces


def _units(meta: CheckpointMeta, path: tuple[str, ...], unit: int) -> list[tuple[int, int, int, int]]:
    """``(saving rank, block, lo, hi)`` of every checksum unit of array ``path``: blocks of ``unit``
    elements of each saved shard, or (``unit == 0``) each saved shard whole."""
    out = []
    for q, a, e in meta.saved_shards(path):
        u = unit or max(1, e - a)
        out += [(q, k, lo, min(lo + u, e)) for k, lo in enumerate(range(a, e, u))]
    return out


def block_checksums_everywhere(state: Mapping[str, Any], meta: CheckpointMeta,
                               units: Mapping[tuple[str, ...], int]) -> dict[str, dict[int, dict[int, str]]]:
    """``{checksum_key: {saving rank: {block: checksum}}}`` of the arrays of ``state`` (any sharding, on
    one process or many), the same on every process.

    Each process checksums the blocks (``units[path]`` elements; ``0``: whole saved shards) that lie
    within one of its pieces (:func:`_owned_pieces`); the pieces of a block that straddles pieces
    (another world size than the saving one) travel as bytes. One JSON all-gather when there are
    several processes (:func:`jax_backend.processes.all_gather_json`; never pickled): a collective,
    every process must call it with the same arrays.
    """
    import base64

    from .processes import all_gather_json

    whole: dict[str, str] = {}
    parts: list[list] = []  # [key, q, k, offset in the block, base64 bytes]
    for path, a in flat_arrays(state).items():
        key, units_of = checksum_key(path), _units(meta, path, units[path])
        for start, data in _owned_pieces(a):
            stop = start + data.size
            for q, k, lo, hi in units_of:
                if hi <= start or lo >= stop:
                    continue
                if start <= lo and hi <= stop:
                    whole[f"{key}|{q}|{k}"] = shard_checksum(data[lo - start:hi - start])
                else:
                    piece = np.ascontiguousarray(data[max(lo, start) - start:min(hi, stop) - start])
                    parts.append([key, q, k, max(lo, start) - lo, base64.b64encode(piece.tobytes()).decode("ascii")])
    out: dict[str, dict[int, dict[int, str]]] = {}
    straddling: dict[tuple[str, int, int], list[tuple[int, bytes]]] = {}
    for sums, pieces in all_gather_json([whole, parts]):
        for name, value in sums.items():
            key, q, k = name.split("|")
            out.setdefault(key, {}).setdefault(int(q), {}).setdefault(int(k), value)
        for key, q, k, offset, data in pieces:
            straddling.setdefault((key, q, k), []).append((offset, base64.b64decode(data)))
    for (key, q, k), pieces in straddling.items():
        joined = b"".join(data for _, data in sorted(pieces))  # contiguous, disjoint: replica 0's pieces only
        out.setdefault(key, {}).setdefault(q, {})[k] = shard_checksum(np.frombuffer(joined, np.uint8))
    return out


def compute_checksums(state: Mapping[str, Any], layout: ChunkLayout) -> dict[str, Any]:
    """The ``meta.checksums`` record of a ``state`` tree saved with ``layout``: the checksum of every
    storage block of every saved shard, and each shard's combined (as
    :meth:`CheckpointMeta.checksums_of_arrays`), at any number of processes — a collective
    (:func:`block_checksums_everywhere`)."""
    meta = CheckpointMeta(step=0, layout=layout)
    paths = flat_arrays(state)
    units = {p: meta.storage_block_numel(p) for p in paths}
    sums = block_checksums_everywhere(state, meta, units)
    blocks: dict[str, list[list[str]]] = {}
    for p in paths:
        key, per_rank = checksum_key(p), {}
        for q, k, _, _ in _units(meta, p, units[p]):
            per_rank.setdefault(q, []).append(sums[key][q][k])
        blocks[key] = [per_rank[q] for q in sorted(per_rank)]
    return meta.record_of_blocks(blocks)


def verify_checksums(state: Mapping[str, Any], meta: CheckpointMeta, where: str) -> bool:
    """Check restored arrays (any sharding, one process or many) against ``meta.checksums`` (written at
    ``meta.layout``'s world size): each storage block of each saved shard (whole shards for a checkpoint
    written before blocks) is checksummed from the restored data — its element ranges are the same at
    every world size, only the padding differs. A collective when there are several processes, and every
    process reaches the same verdict.

    Returns:
        ``False`` when the checkpoint has no checksums (nothing verified; the restore warned).

    Raises:
        CheckpointError: a block's checksum differs (names the array, the step directory, the saving
            rank and the element range).
        CheckpointFormatError: an array has no checksum in a checkpoint that has them.
    """
    if not meta.checksums:
        return False
    paths = flat_arrays(state)
    for p in paths:
        if checksum_key(p) not in meta.checksums["arrays"]:
            raise CheckpointFormatError(f"{Path(where) / META_ITEM}: no checksum for array {array_name(p)!r}")
    units = {p: meta.verification_unit(p) for p in paths}
    got = block_checksums_everywhere(state, meta, units)
    for p in paths:
        key = checksum_key(p)
        blocks = (meta.checksums.get("blocks") or {}).get(key)
        for q, k, lo, hi in _units(meta, p, units[p]):
            want = blocks["sums"][q][k] if blocks is not None else meta.checksums["arrays"][key][q]
            if got[key][q][k] != want:
                meta.raise_corrupted(p, q, lo, hi, got[key][q][k], want, where)
        for q, a, e in meta.saved_shards(p):  # and each whole shard's (what readers before blocks verify)
            whole = combine_checksums([got[key][q][k] for k in sorted(got[key][q])])
            if whole != meta.checksums["arrays"][key][q]:
                meta.raise_corrupted(p, q, a, e, whole, meta.checksums["arrays"][key][q], where)
    return True


ITEMS = ("params", "ema")
"""What :func:`restore_checkpoint` restores as ``chunks``: the masters, or the EMA of the trainable chunks."""


def _restore(path, mesh: Mesh, axis: str, step: int | None, *, params: bool, optimizer: bool, item: str = "params"
             ) -> tuple[RestoredCheckpoint, dict]:
    """Restore the parameter (masters or EMA) and/or optimizer-state chunks of a checkpoint onto
    ``mesh``; also the raw restored ``state`` tree."""
    if item not in ITEMS:
        raise ConfigError(f"item must be one of {', '.join(map(repr, ITEMS))}, got {item!r}")
    ema = params and item == "ema"
    n = mesh_world_size(mesh, axis)
    step_dir = orbax_store.committed_step_dir(path, step)
    meta = read_meta(step_dir)
    if optimizer and meta.optimizer is None:
        raise CheckpointError(f"{step_dir}: checkpoint has no optimizer state (saved parameters only)")
    if ema and meta.ema is None:
        raise CheckpointError(f"{step_dir}: checkpoint has no EMA (saved without a ZeroEMA)")
    meta.check_saved_arrays(orbax_store.read_array_metadata(step_dir), source=str(step_dir), with_optimizer=optimizer,
                            with_ema=ema)
    meta.warn_if_unverified(step_dir)
    layout = meta.layout.relayout(n)
    tree, args = abstract_state(
        layout, mesh, axis=axis, state_keys=tuple(meta.optimizer.state_keys) if optimizer else (), ema=ema
    )
    if not params:
        del tree[PARAMS_KEY], args[PARAMS_KEY]
    state = orbax_store.restore_arrays(step_dir, tree, args)
    saved = {**state.get(PARAMS_KEY, {}), **state.get(EMA_KEY, {})}  # (item="ema": frozen chunks from params)
    chunks = {chunk_key(c.index): saved[chunk_key(c.index)] for c in layout.chunks} if params else {}
    opt = {k: dict(v) for k, v in state[OPTIM_KEY].items()} if optimizer else None
    return RestoredCheckpoint(chunks, layout, meta, opt, step_dir), state


def restore_checkpoint(path: str | Path, mesh: Mesh, *, axis: str = DEFAULT_AXIS, step: int | None = None,
                       with_optimizer: bool = False, check_padding: bool = True, verify: bool = True,
                       item: str = "params") -> RestoredCheckpoint:
    """Restore a chunkzero checkpoint's chunk arrays onto ``mesh``, re-padded for its device count.

    Args:
        path: a step directory ``<root>/<step>`` or a root ``<root>`` (then ``step``, default the latest).
        mesh: any mesh with an axis ``axis``; its size ``n`` there is the new world size (1, 2, 3 …).
        axis: the data-parallel axis name.
        step: with a root, the step to restore.
        with_optimizer: also restore the optimizer-state chunks (``meta.optimizer.state_keys``).
        item: ``"params"`` (the fp32 masters) or ``"ema"`` (the trainable chunks' EMA, the frozen
            chunks as saved; ``meta.ema`` has its decay and update count) as ``chunks``.
        check_padding: verify the padding of every restored chunk is zeros (one reduction per chunk).
        verify: check the restored data against ``meta.checksums`` when the checkpoint has them (costs
            one host copy of the restored arrays).

    Returns:
        A :class:`RestoredCheckpoint`.

    Raises:
        ConfigError: ``mesh`` has no axis ``axis`` (names the axes it has); an unknown ``item``.
        CheckpointError: missing path/step, unreadable or corrupt items (names the path), a checksum
            mismatch, a requested optimizer state or EMA the checkpoint does not have, non-zero padding.
        CheckpointFormatError: metadata fails validation, or an array it lists is missing or
            mis-shaped on disk (names the array and both shapes).
    """
    r, state = _restore(path, mesh, axis, step, params=True, optimizer=with_optimizer, item=item)
    if verify:
        verify_checksums(state, r.meta, str(r.path))
    if check_padding:
        _check_padding(r.chunks, r.layout, str(r.path), item)
        for k, v in (r.opt_state_chunks or {}).items():
            _check_padding(v, r.layout, str(r.path), f"optimizer state {k!r}")
    return r


def restore_chunks(path: str | Path, mesh: Mesh, *, axis: str = DEFAULT_AXIS, step: int | None = None,
                   with_optimizer: bool = False, item: str = "params"):
    """A checkpoint's parameter chunk arrays on ``mesh`` and their layout.

    ``chunks, layout = restore_chunks("runs/ckpt/100", mesh)``; ``item="ema"`` gives the EMA weights
    instead (``unflatten(chunks, layout)`` is then the EMA parameter tree); with ``with_optimizer=True``,
    ``chunks, layout, opt_state_chunks = ...``. See :func:`restore_checkpoint` (which also returns
    the metadata) for arguments and errors.

    Returns:
        ``chunks``: ``{chunk_key: Array[size]}``, 1-D, padded to ``layout``'s sizes, float32 for
        trainable chunks, sharded ``P(axis)`` (keep-gathered: replicated); ``layout``: the
        checkpoint's layout relaid out for ``mesh.shape[axis]`` devices; ``opt_state_chunks``:
        ``{state_key: {chunk_key: f32[size]}}`` over trainable chunks.
    """
    r = restore_checkpoint(path, mesh, axis=axis, step=step, with_optimizer=with_optimizer, item=item)
    return (r.chunks, r.layout, r.opt_state_chunks) if with_optimizer else (r.chunks, r.layout)


def restore_optimizer_chunks(path: str | Path, mesh: Mesh, *, axis: str = DEFAULT_AXIS, step: int | None = None
                             ) -> tuple[OptimizerChunks, ChunkLayout, OptimizerMeta]:
    """Only the optimizer-state chunk arrays: ``(opt_state_chunks, layout, optimizer_meta)``.

    Parameter arrays are not read. Errors as :func:`restore_checkpoint`.
    """
    r, state = _restore(path, mesh, axis, step, params=False, optimizer=True)
    verify_checksums(state, r.meta, str(r.path))
    for k, v in r.opt_state_chunks.items():
        _check_padding(v, r.layout, str(r.path), f"optimizer state {k!r}")
    return r.opt_state_chunks, r.layout, r.meta.optimizer


def _as_jax(x: Any) -> jax.Array:
    return x if isinstance(x, jax.Array) else jnp.asarray(np.asarray(x))


def save_checkpoint(directory: str | Path, chunks: Mapping[str, Any], layout: ChunkLayout, *, step: int,
                    opt_state_chunks: Mapping[str, Mapping[str, Any]] | None = None,
                    optimizer_meta: OptimizerMeta | Mapping[str, Any] | None = None,
                    mixed_precision: str = "fp32", loss_scaler: dict | None = None, model_config: dict | None = None,
                    data_position: dict | None = None, rng_states: list[dict] | None = None, extra: dict | None = None,
                    ema_chunks: Mapping[str, Any] | None = None, ema_meta: EmaMeta | None = None,
                    checksums: bool = True, options: Any = None,
                    timeout_s: float = orbax_store.DEFAULT_TIMEOUT_S) -> Path:
    """Write chunk arrays as a chunkzero checkpoint step ``<directory>/<step>/`` that torch can resume.

    Args:
        directory: the checkpoint root (created if missing).
        chunks: ``{chunk_key: Array[size]}`` for every chunk of ``layout``, in ``param_array_dtype``
            (float32 masters for trainable chunks); ``jax.Array`` s keep their sharding (each device's
            shard is written once), numpy arrays are written whole.
        layout: the layout of the arrays; its ``world_size`` is recorded as the saving world size.
        step: training step; must not exist under ``directory`` yet, nor be before its latest step.
        opt_state_chunks: ``{state_key: {chunk_key: f32[size]}}`` over trainable chunks, or ``None``.
        optimizer_meta: :class:`OptimizerMeta` (or its dict: ``class_name``, ``hyperparameters``,
            ``state_keys``, ``step``); its ``state_keys`` must be the keys of ``opt_state_chunks``.
        mixed_precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (the compute precision torch resumes with).
        loss_scaler, model_config, data_position, rng_states, extra: JSON-able, stored in ``meta``.
        ema_chunks: ``{chunk_key: f32[size]}`` over the trainable chunks, the EMA of the masters (the ``ema``
            subtree, as a torch ``ZeroEMA`` saves it), or ``None``; ``ema_meta`` (its decay, warm-up and
            update count) is given exactly when it is.
        checksums: record ``meta.checksums`` per storage block of each saved shard (as the torch backend
            does, so every loader verifies what it reads), at any number of processes; each process
            checksums the shards it writes and the sums are gathered as JSON (:func:`compute_checksums`).
        options: ``orbax.checkpoint.CheckpointManagerOptions`` to start from (``max_to_keep``,
            ``multiprocessing_options`` …).
        timeout_s: the longest, in seconds, any wait for the other JAX processes may take (each Orbax
            barrier, and the write plus its commit), so a lost process ends the save with an error.

    Returns:
        The step directory (committed).

    Raises:
        LayoutError / ShapeMismatchError: a chunk is missing, extra or mis-sized (names it and both shapes).
        CheckpointError: a chunk has the wrong dtype, the optimizer (or EMA) arguments disagree, or the step
            exists or is before the latest one (nothing is overwritten).
        ConfigError: bad ``mixed_precision``, ``step`` or ``timeout_s``, or metadata that is not JSON-serializable.
    """
    if mixed_precision not in MIXED_PRECISIONS:
        raise ConfigError(f"mixed_precision must be one of {MIXED_PRECISIONS}, got {mixed_precision!r}")
    arrays: dict[tuple[str, ...], jax.Array] = {}
    for i, a in check_chunks(chunks, layout, what="chunks").items():
        arr, want = _as_jax(a), jnp.dtype(param_array_dtype(layout.chunks[i]))
        if arr.dtype != want:
            raise CheckpointError(f"chunk {chunk_key(i)} is {arr.dtype}, the checkpoint stores it as {want}")
        arrays[(PARAMS_KEY, chunk_key(i))] = arr
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
        for key in optimizer_meta.state_keys:
            for i, a in check_chunks(
                opt_state_chunks[key], layout, trainable_only=True, what=f"optimizer state {key!r}"
            ).items():
                a = _as_jax(a)
                if a.dtype != jnp.float32:
                    raise CheckpointError(f"optimizer state {key!r} {chunk_key(i)} is {a.dtype}, expected float32")
                arrays[(OPTIM_KEY, key, chunk_key(i))] = a
    elif optimizer_meta is not None and optimizer_meta.state_keys:
        raise CheckpointError(
            f"optimizer_meta lists state keys {optimizer_meta.state_keys} but no opt_state_chunks were given"
        )
    if (ema_chunks is None) != (ema_meta is None):
        raise CheckpointError("ema_chunks and ema_meta go together (the EMA arrays and their decay, update count)")
    if ema_chunks is not None:
        for i, a in check_chunks(ema_chunks, layout, trainable_only=True, what="EMA chunks").items():
            a = _as_jax(a)
            if a.dtype != jnp.float32:
                raise CheckpointError(f"EMA {chunk_key(i)} is {a.dtype}, expected float32")
            arrays[(EMA_KEY, chunk_key(i))] = a
    meta = CheckpointMeta(
        step=step, layout=layout, mixed_precision=mixed_precision, optimizer=optimizer_meta, loss_scaler=loss_scaler,
        model_config=model_config, data_position=data_position, rng_states=rng_states, extra=extra, ema=ema_meta,
    )
    state = state_tree(arrays)
    if checksums:
        meta.checksums = compute_checksums(state, layout)
    return orbax_store.save_step(directory, meta, state, options=options, timeout_s=timeout_s)


__all__ = [
    "RestoredCheckpoint",
    "abstract_state",
    "block_checksums_everywhere",
    "compute_checksums",
    "restore_checkpoint",
    "restore_chunks",
    "restore_optimizer_chunks",
    "save_checkpoint",
    "verify_checksums",
]
