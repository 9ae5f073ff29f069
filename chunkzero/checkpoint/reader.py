"""Read slices of a step's ``state`` arrays with TensorStore, into numpy (no JAX computation, no torch).

The storage library Orbax writes with, opened through Orbax's own read spec
(:func:`~chunkzero.checkpoint.orbax_files.array_read_spec`). A load of a model reads only what the rank
now owns (:func:`~chunkzero.checkpoint.plan.read_plan`), in whole storage blocks: each saved shard is
stored in blocks of about 1 MiB, each with its own checksum (:mod:`chunkzero.checkpoint.checksums`), so
of every saved shard a rank's new ranges overlap it reads only the blocks holding elements it needs —
exactly its own shard when nothing changed, and at most one partial block too many at each end of a
range otherwise — verifies each (:meth:`~chunkzero.checkpoint.meta.CheckpointMeta.verify_blocks`) and
places its pieces; a read that maps whole onto a writable destination buffer is copied there by
TensorStore directly. (A checkpoint written before storage blocks has one checksum per saved shard:
its overlapping shards are read whole.)

Why slices rather than a restore with a target sharding over a mesh of the current processes: a
``NamedSharding`` can only say "my 1/W of this array", which fits when only the world size changes but
not when the chunk size changes (a new shard is then pieces of several saved chunks at arbitrary
offsets, which would need a restore followed by an all-to-all between ranks). Slices express both cases,
need no ``jax.distributed`` (a load is not a JAX collective) and never gather a full chunk. TensorStore
decodes whole storage chunks, so what a slice costs on disk is the storage blocks it touches.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import numpy_dtype
from ..errors import CheckpointError, CheckpointFormatError, ShapeMismatchError
from ..layout import ChunkLayout
from . import orbax_files
from .meta import (
    EMA_KEY,
    OPTIM_KEY,
    PARAMS_KEY,
    STATE_ITEM,
    ArrayPath,
    CheckpointMeta,
    array_name,
    chunk_index,
    chunk_key,
    param_array_dtype,
)
from .plan import ReadPiece, check_compatible, compare_layouts, read_plan


class Target:
    """An output buffer of ``size`` elements of ``dtype``, zero where nothing is written.

    With ``into`` (a writable 1-D array of that size and dtype — e.g. a live shard) reads land there
    directly; otherwise the buffer is allocated on the first partial write, or adopted without a copy
    when one read covers all of it.
    """

    def __init__(self, size: int, dtype, into: np.ndarray | None = None):
        self.size, self.dtype = int(size), np.dtype(dtype)
        if into is not None and (into.shape != (self.size,) or into.dtype != self.dtype or not into.flags.writeable
                                 or not into.flags.c_contiguous):
            into = None
        self._array: np.ndarray | None = into
        self.in_place = into is not None

    def put(self, offset: int, data: np.ndarray) -> None:
        if (
            self._array is None
            and offset == 0
            and data.size == self.size
            and data.dtype == self.dtype
            and data.flags.writeable
        ):
            self._array = data
            return
        if self._array is None:
            self._array = np.zeros(self.size, dtype=self.dtype)
        self._array[offset : offset + data.size] = data

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.zeros(self.size, dtype=self.dtype)
        return self._array


class ChunkReader:
    """Reads slices of a step's ``state`` arrays with TensorStore (read-only; no JAX needed).

    Args:
        step_dir: one step's directory.
        meta: its validated metadata (gives each array's expected shape and dtype, and the checksums).

    Raises:
        CheckpointError: the ``state`` item's array metadata is missing.
        CheckpointFormatError: it is malformed, or lacks an array the metadata lists.
    """

    def __init__(self, step_dir: str | os.PathLike, meta: CheckpointMeta):
        self.step_dir = Path(step_dir).absolute()  # Orbax and TensorStore want absolute paths
        self.item_dir = self.step_dir / STATE_ITEM
        self.meta = meta
        self.expected = meta.expected_arrays()
        self._stores: dict[ArrayPath, Any] = {}
        self._context = None
        self.reads_started = False
        """Whether :meth:`read_into` began reading array data (after every open succeeded)."""
        self.bytes_read = 0
        """Bytes of array data :meth:`read_into` asked TensorStore for (whole storage blocks), in total."""
        self._index = orbax_files.array_index(self.item_dir)
        meta.check_saved_arrays(dict.fromkeys(self._index.paths), source=str(self.item_dir / "_METADATA"))
        meta.warn_if_unverified(self.step_dir)

    def _where(self, path: ArrayPath) -> str:
        return f"array {array_name(path)!r} in {str(self.item_dir)!r}"

    def _check(self, path: ArrayPath, store) -> None:
        shape, dtype = self.expected[path]
        if tuple(store.shape) != tuple(shape):
            raise ShapeMismatchError(array_name(path), shape, store.shape, f"saved array in {self.item_dir}")
        if np.dtype(store.dtype.numpy_dtype) != numpy_dtype(dtype):
            raise CheckpointFormatError(f"{self._where(path)} is {store.dtype.name}, metadata says {dtype}")

    def open(self, path: ArrayPath):
        """The TensorStore of saved array ``path`` (read-only; checked against the expected shape and dtype)."""
        self.open_all([path])
        return self._stores[path]

    def open_all(self, paths) -> None:
        """Open the TensorStores of ``paths`` concurrently (each open reads the OCDBT manifest).

        Raises:
            CheckpointError: a path is not an array of this format, or cannot be opened.
            ShapeMismatchError / CheckpointFormatError: an array's shape or dtype differs from the metadata.
        """
        import tensorstore as ts

        todo = [p for p in dict.fromkeys(paths) if p not in self._stores]
        if not todo:
            return
        if self._context is None:
            self._context = orbax_files.ts_context(self._index)
        pending = []
        for path in todo:
            if path not in self.expected:
                raise CheckpointError(f"{self._where(path)} is not part of this checkpoint's format")
            spec = orbax_files.array_read_spec(self._index, path, self._context)
            pending.append((path, ts.open(spec, read=True, open=True, context=self._context)))
        for path, fut in pending:
            try:
                store = fut.result()
            except Exception as e:  # noqa: BLE001 - re-raised as CheckpointError
                raise CheckpointError(f"cannot open {self._where(path)}: {e}") from None
            self._check(path, store)
            self._stores[path] = store

    def read_into(self, needs: list[tuple[ReadPiece, Target]], *, budget_bytes: int = 256 << 20) -> None:
        """Fill each target's elements ``[p.dst_offset, p.dst_offset + p.numel)`` from piece ``p``.

        Reads go by saved shard and checksum unit (:meth:`CheckpointMeta.verification_unit`): of each
        saved shard a piece overlaps, only the storage blocks that hold elements some piece needs are
        read — consecutive ones in one read — each verified against its own checksum and scattered to
        the pieces. A checkpoint with checksums of whole shards only (written before blocks) reads
        each such shard whole, one without checksums exactly the pieces. A read that is exactly one
        whole target becomes that target's buffer (no copy), and one that lands whole in a writable
        destination (``Target(into=...)``) is copied there by TensorStore directly. Reads are issued
        concurrently, up to ``budget_bytes`` in flight; :attr:`bytes_read` counts what was requested.

        Raises:
            CheckpointError: a read failed (truncated or missing data) or a checksum does not match;
                the message names the array, the saving rank and the element range.
        """
        import tensorstore as ts

        runs = self._runs(needs)
        self.open_all(key[0] for key in runs)
        batch: list = []
        in_flight = 0
        self.reads_started = True

        def flush():
            nonlocal batch, in_flight
            for (path, q, a, b), users, fut, direct in batch:
                try:
                    data = fut.result()
                except Exception as e:  # noqa: BLE001 - re-raised as CheckpointError
                    raise CheckpointError(f"cannot read elements [{a}, {b}) of {self._where(path)}: {e}") from None
                self.meta.verify_blocks(path, q, a, data if direct is None else direct, step_dir=self.step_dir)
                if direct is not None:  # already in place
                    continue
                for p, out in users:
                    lo, hi = max(a, p.src_start), min(b, p.src_stop)
                    if lo < hi:
                        out.put(p.dst_offset + lo - p.src_start, data[lo - a : hi - a])
                del data
            batch, in_flight = [], 0

        for (path, q, a, b), users in runs.items():
            store = self._stores[path]
            nbytes = (b - a) * store.dtype.numpy_dtype.itemsize
            if batch and in_flight + nbytes > budget_bytes:
                flush()
            p, out = users[0]
            if (len(users) == 1 and out.in_place and p.src_start <= a and b <= p.src_stop
                    and np.dtype(store.dtype.numpy_dtype) == out.dtype):
                # the whole read lands in one live buffer: TensorStore copies it there directly
                d = p.dst_offset + a - p.src_start
                view = out.array[d : d + b - a]
                batch.append(((path, q, a, b), users, ts.array(view).write(store[a:b]), view))
            else:
                batch.append(((path, q, a, b), users, store[a:b].read(), None))
            in_flight += nbytes
            self.bytes_read += nbytes
        flush()

    def _runs(
        self, needs: list[tuple[ReadPiece, Target]]
    ) -> dict[tuple[ArrayPath, int, int, int], list[tuple[ReadPiece, Target]]]:
        """The reads that serve ``needs``: ``(array, saving rank, start, stop) -> the pieces it feeds``.

        Per saved shard ``[a, e)`` that pieces overlap, the checksum units holding a needed element
        are rounded out to whole units and consecutive ones merged into one read.
        """
        wanted: dict[tuple[ArrayPath, int], list[tuple[int, int]]] = {}
        users: dict[tuple[ArrayPath, int], list[tuple[ReadPiece, Target]]] = {}
        for p, out in needs:
            if p.numel <= 0:
                continue
            for q, a, e in self.meta.saved_shards(p.array):
                lo, hi = max(a, p.src_start), min(e, p.src_stop)
                if lo < hi:
                    wanted.setdefault((p.array, q), []).append((lo, hi))
                    users.setdefault((p.array, q), []).append((p, out))
        runs: dict[tuple[ArrayPath, int, int, int], list[tuple[ReadPiece, Target]]] = {}
        for (path, q), ranges in wanted.items():
            _, a, e = self.meta.saved_shards(path)[q]
            unit = self.meta.verification_unit(path)
            if unit == 0:  # whole-shard checksums: the shard is read whole
                ranges = [(a, e)]
            elif unit is not None:  # whole checksum units
                ranges = [(a + (lo - a) // unit * unit, min(e, a + -(-(hi - a) // unit) * unit)) for lo, hi in ranges]
            merged: list[list[int]] = []
            for lo, hi in sorted(ranges):
                if merged and lo <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            for lo, hi in merged:
                runs[(path, q, lo, hi)] = [
                    (p, out) for p, out in users[(path, q)] if p.src_start < hi and lo < p.src_stop
                ]
        return runs

    def read(self, path: ArrayPath, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of saved array ``path`` as numpy (checksums verified)."""
        store = self.open(path)
        stop = store.shape[0] if stop is None else stop
        out = Target(stop - start, numpy_dtype(self.expected[path][1]))
        self.read_into([(ReadPiece(path, start, stop, 0), out)])
        return out.array


def file_bytes_read() -> int:
    """Bytes this process has read from files through TensorStore so far (its
    ``/tensorstore/kvstore/file/bytes_read`` counter: array data and OCDBT metadata, page cache or not)."""
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return int(found[0]["values"][0]["value"]) if found else 0


def read_shards(
    step_dir: str | os.PathLike,
    meta: CheckpointMeta,
    target: ChunkLayout,
    rank: int,
    *,
    optim_keys: list[str] | None = None,
    reader: ChunkReader | None = None,
    into: Mapping[ArrayPath, np.ndarray] | None = None,
    missing_ok: bool = False,
) -> tuple[dict[int, np.ndarray], dict[str, dict[int, np.ndarray]]]:
    """This rank's shards of ``target``'s chunks, read from a checkpoint of any world or chunk size.

    Args:
        step_dir: the step's directory; ``meta`` its metadata (:func:`~chunkzero.checkpoint.read_meta`).
        target: the layout to load into (the model's); tensors matched by name (see
            :func:`~chunkzero.checkpoint.plan.check_compatible`).
        rank: rank in ``target``'s world.
        optim_keys: optimizer-state keys to read (default: all the checkpoint holds; ``[]``: none).
        into: optional destination buffers by ``(kind..., chunk_key)`` (``("params", "chunk_0003")``,
            ``("optim", "exp_avg", "chunk_0003")``): writable 1-D arrays of the shard's size and dtype
            (views of live shards) that are overwritten in place — their padding is zeroed — and
            returned; a read error then leaves them partly written.
        missing_ok: tensors of ``target`` that the checkpoint lacks, and saved tensors ``target``
            lacks, are allowed (:func:`~chunkzero.checkpoint.plan.compare_layouts`): the former are
            not read (zero in new buffers, untouched in ``into``).

    Returns:
        ``(params, optim)``: chunk index -> shard (``target.shard_numel(i)`` elements, padding zero;
        fp32 for trainable chunks, the chunk's dtype for frozen ones), and state key -> chunk index ->
        fp32 shard for trainable chunks.

    Raises:
        CheckpointError / CheckpointFormatError / ShapeMismatchError: see :func:`check_compatible`
            and :class:`ChunkReader`; an optimizer key the checkpoint lacks; a tensor trainable in
            ``target`` but frozen (without optimizer state) in the checkpoint.
    """
    if missing_ok:
        compare_layouts(meta.layout, target, source=str(step_dir))  # shapes still checked
    else:
        check_compatible(meta.layout, target, source=str(step_dir))
    saved_keys = list(meta.optimizer.state_keys) if meta.optimizer else []
    optim_keys = saved_keys if optim_keys is None else list(optim_keys)
    for k in optim_keys:
        if k not in saved_keys:
            raise CheckpointError(
                f"optimizer state {k!r} is not in the checkpoint {str(step_dir)!r} (it holds {saved_keys})"
            )
    reader = reader or ChunkReader(step_dir, meta)
    into = into or {}
    param_targets: dict[int, Target] = {}
    optim_targets: dict[str, dict[int, Target]] = {k: {} for k in optim_keys}
    plan: list[tuple[ReadPiece, Target]] = []
    for c in target.chunks:
        n = target.shard_numel(c.index)
        pieces = read_plan(meta.layout, target, c.index, rank, (PARAMS_KEY,), missing_ok=missing_ok)
        dtype = param_array_dtype(c)
        if pieces and not c.requires_grad:
            dtype = reader.expected[pieces[0].array][1]  # a frozen chunk as saved; cast below
        param_targets[c.index] = Target(n, numpy_dtype(dtype), into.get((PARAMS_KEY, chunk_key(c.index))))
        plan += [(p, param_targets[c.index]) for p in pieces]
        if c.requires_grad:
            for k in optim_keys:
                optim_targets[k][c.index] = Target(n, np.float32, into.get((OPTIM_KEY, k, chunk_key(c.index))))
                optim_pieces = read_plan(meta.layout, target, c.index, rank, (OPTIM_KEY, k), missing_ok=missing_ok)
                for p in optim_pieces:
                    _check_trainable(meta, p, step_dir)
                plan += [(p, optim_targets[k][c.index]) for p in optim_pieces]
    reader.read_into(plan)
    for c in target.chunks:  # live buffers: the padding beyond the valid elements becomes zero
        valid = target.valid_length(c.index, rank)
        for t in [param_targets[c.index], *(optim_targets[k][c.index] for k in optim_keys if c.requires_grad)]:
            if t.in_place:
                t.array[valid:] = 0
    params: dict[int, np.ndarray] = {}
    for c in target.chunks:
        a = param_targets[c.index].array
        want = numpy_dtype(param_array_dtype(c))
        params[c.index] = a if a.dtype == want else a.astype(want)
    optim = {k: {i: t.array for i, t in per.items()} for k, per in optim_targets.items()}
    return params, optim


def read_ema_shards(
    step_dir: str | os.PathLike,
    meta: CheckpointMeta,
    target: ChunkLayout,
    rank: int,
    *,
    reader: ChunkReader | None = None,
) -> dict[int, np.ndarray]:
    """This rank's EMA shards of ``target``'s trainable chunks, read from a checkpoint of any world or
    chunk size (as :func:`read_shards` reads the masters).

    Returns:
        chunk index -> fp32 shard (``target.shard_numel(i)`` elements, padding zero), trainable chunks.

    Raises:
        CheckpointError: the checkpoint holds no EMA, or a tensor trainable in ``target`` was frozen
            in it; and as :func:`read_shards`.
    """
    if meta.ema is None:
        raise CheckpointError(f"checkpoint {str(step_dir)!r} holds no EMA (it was saved without one)")
    check_compatible(meta.layout, target, source=str(step_dir))
    reader = reader or ChunkReader(step_dir, meta)
    targets: dict[int, Target] = {}
    plan: list[tuple[ReadPiece, Target]] = []
    for c in target.chunks:
        if not c.requires_grad:
            continue
        targets[c.index] = Target(target.shard_numel(c.index), np.float32)
        pieces = read_plan(meta.layout, target, c.index, rank, (EMA_KEY,))
        for p in pieces:
            _check_trainable(meta, p, step_dir)
        plan += [(p, targets[c.index]) for p in pieces]
    reader.read_into(plan)
    return {i: t.array for i, t in targets.items()}


def _check_trainable(meta: CheckpointMeta, piece: ReadPiece, step_dir) -> None:
    saved_chunk = chunk_index(piece.array[-1])
    if not meta.layout.chunks[saved_chunk].requires_grad:
        frozen = [t.name for t in meta.layout.chunk_tensors(saved_chunk)]
        raise CheckpointError(
            f"tensor(s) {', '.join(map(repr, frozen[:3]))} are trainable in the model but were frozen "
            f"in the checkpoint {str(step_dir)!r}, which holds no optimizer state for them "
            "(load with optimizer=None)"
        )
