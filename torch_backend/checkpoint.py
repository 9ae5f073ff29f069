"""Orbax checkpoints of a ZeroDDP model and its ZeroOptimizer (DESIGN.md §5, issue 5).

One step is one standard Orbax checkpoint directory ``<directory>/<step>/`` in the format of
:mod:`chunkzero.checkpoint`: the item ``state`` holds every fp32 master chunk and every optimizer-state
chunk as a 1-D global array, the item ``meta`` the validated JSON document
(:class:`chunkzero.checkpoint.CheckpointMeta`).

**Save** (all ranks in parallel). Each torch rank is also one JAX process: the first save starts
``jax.distributed`` on CPU (coordinator on ``MASTER_ADDR`` at a free port chosen by rank 0 and broadcast
over the model's process group; ``num_processes`` = world size, ``process_id`` = rank). A sharded chunk
becomes ``jax.make_array_from_single_device_arrays((size,), NamedSharding(mesh, P('dp')), [shard])``
over a mesh of one CPU device per process, so each rank hands Orbax only its own shard and Orbax
writes each shard from the process that holds it (OCDBT, one data sub-tree per process). A
keep-gathered chunk is replicated (``P()``) and written once. Orbax writes into a temporary directory
and renames it on commit, so a save killed midway leaves the previous step as the latest.

**Load** (each rank reads alone; one all-reduce at the end to agree that every rank succeeded). A rank
computes, from the saved layout and its model's layout, which element ranges of which saved arrays make
up each of its shards — by tensor name, so the world size *and* the chunk size may differ
(:func:`read_plan`) — and reads them with TensorStore (the storage library Orbax writes with, opened
through Orbax's own read spec), by saved shard: each saved shard that overlaps the rank's ranges is read
once — exactly its own shard when nothing changed — its checksum verified, and its pieces placed; a
saved shard that maps whole onto a live CPU shard is copied there directly by TensorStore.

Why TensorStore slices rather than ``CheckpointManager.restore`` with a target sharding over a mesh of
the current processes: a ``NamedSharding`` can only say "my 1/W of this array", which fits when only the
world size changes but not when the chunk size changes (a new shard is then pieces of several saved
chunks at arbitrary offsets, which would need a restore followed by an all-to-all between ranks).
Slices express both cases, need no ``jax.distributed`` (a load is not a JAX collective), never gather a
full chunk, and read no more from disk than a sharded restore does: TensorStore decodes whole storage
chunks, and Orbax's storage chunk is the saving rank's shard. Plain Orbax users do use target
shardings — see the snippet in ``README.md``.

**Integrity.** Every saved shard's checksum (:func:`chunkzero.checkpoint.shard_checksum` over its valid
elements) is gathered into the metadata at save time and checked at load and export, so a flipped bit
in an uncompressed array is reported with the array, saving rank and element range.

**Asynchronous saves** return once JAX holds a copy of the shards; the write and commit continue on
Orbax's threads. The next save, a load of the same directory, :func:`wait_until_finished` or the
process's exit (a hook that runs before Python stops its thread pools) waits for them.

Nothing here unpickles: metadata is JSON validated by ``CheckpointMeta.from_dict``, arrays are
TensorStore/zarr, RNG states are JSON (torch's byte states as base64).
"""

from __future__ import annotations

import atexit
import base64
import json
import logging
import os
import random
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chunkzero.checkpoint import (
    CHECKSUM_ALGORITHM,
    META_ITEM,
    OPTIM_KEY,
    PARAMS_KEY,
    STATE_ITEM,
    CheckpointMeta,
    OptimizerMeta,
    checksum_key,
    chunk_index,
    chunk_key,
    is_step_dir,
    latest_step,
    param_array_dtype,
    read_meta,
    resolve_step_dir,
    shard_checksum,
)
from chunkzero.checkpoint import list_steps as checkpoint_steps
from chunkzero.dtypes import canonical_dtype
from chunkzero.errors import (
    CheckpointError,
    CheckpointFormatError,
    ConfigError,
    ShapeMismatchError,
)
from chunkzero.layout import ChunkLayout

logger = logging.getLogger("chunkzero.checkpoint")

COMPRESS = os.environ.get("CHUNKZERO_CHECKPOINT_COMPRESS", "0") == "1"
"""Compress the ``state`` arrays with zstd (off by default: see :func:`_manager`)."""

__all__ = [
    "ChunkReader",
    "ReadPiece",
    "checkpoint_steps",
    "latest_step",
    "load_checkpoint",
    "read_meta",
    "read_plan",
    "read_shards",
    "resolve_step_dir",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "wait_until_finished",
    "write_shards",
]


# ====================================================================== dtypes


def _np_dtype(name: str) -> np.dtype:
    """numpy dtype of a canonical chunkzero dtype name (bfloat16 through ``ml_dtypes``)."""
    name = canonical_dtype(name)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, canonical_dtype(name))


def to_numpy(t: torch.Tensor, *, copy: bool = True) -> np.ndarray:
    """``t`` on the host as numpy (bfloat16 as ``ml_dtypes.bfloat16``): a copy, or with ``copy=False``
    a view of ``t``'s memory when it is already a contiguous CPU tensor."""
    t = t.detach()
    on_cpu = t.device.type == "cpu"
    t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        a = t.view(torch.int16).numpy().view(_np_dtype("bfloat16"))
    else:
        a = t.numpy()
    return a.copy() if (on_cpu and copy) else a


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing ``a``'s memory (bfloat16 handled)."""
    a = np.ascontiguousarray(a)
    if a.dtype == _np_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


# ====================================================================== JAX process mesh


class _ProcessMesh:
    """One CPU device per process on a 1-D mesh ``('dp',)``; device ``r`` belongs to rank ``r``."""

    def __init__(self, rank: int, world_size: int):
        import jax
        from jax.sharding import Mesh

        self.rank, self.world_size = rank, world_size
        if world_size == 1:
            devices = [jax.local_devices(backend="cpu")[0]]
        else:
            by_process: dict[int, Any] = {}
            for d in jax.devices("cpu"):
                by_process.setdefault(d.process_index, d)
            if sorted(by_process) != list(range(world_size)):
                raise CheckpointError(
                    f"jax.distributed sees processes {sorted(by_process)}, expected 0..{world_size - 1}"
                )
            devices = [by_process[p] for p in range(world_size)]
        self.device = devices[rank]
        self.mesh = Mesh(np.array(devices), ("dp",))

    def global_array(self, local: np.ndarray, size: int, replicated: bool):
        """The 1-D global array of ``size`` elements whose only local piece is ``local``.

        ``local`` is this rank's shard (``size / world_size`` elements) or, for a replicated
        (keep-gathered) chunk, the whole chunk.
        """
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        sharding = NamedSharding(self.mesh, P() if replicated else P("dp"))
        # An explicit copy: on CPU, device_put may alias an aligned numpy buffer instead of copying it,
        # and ``local`` is a view of a live shard that training changes while an async save writes.
        piece = jax.device_put(np.array(local, copy=True), self.device)
        piece.block_until_ready()
        return jax.make_array_from_single_device_arrays((size,), sharding, [piece])


_RUNTIME: _ProcessMesh | None = None
_RUNTIME_LOCK = threading.Lock()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]


def _broadcast_int(value: int, process_group) -> int:
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=dist.get_global_rank(process_group, 0) if process_group is not None else 0, group=process_group)
    return int(t.item())


def _use_cpu_jax() -> None:
    """Keep JAX in a torch process on the CPU (it must never grab accelerator memory)."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # backends already initialized: whatever they are, we only use CPU devices
        pass


def process_mesh(rank: int, world_size: int, process_group=None, *, coordinator: str | None = None) -> _ProcessMesh:
    """This process's JAX mesh, starting ``jax.distributed`` on CPU the first time (world size > 1).

    Args:
        rank, world_size: this process's data-parallel rank and the world size.
        process_group: the torch process group over which rank 0 broadcasts the coordinator port;
            ``None`` is the default group. Not needed when ``coordinator`` is given.
        coordinator: ``host:port`` of the JAX coordinator (default: ``MASTER_ADDR`` and a free port).

    Raises:
        CheckpointError: JAX was already started for another world size or rank in this process, or
            JAX computations ran before the first save (``jax.distributed`` must start first).
    """
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is not None:
            if (_RUNTIME.rank, _RUNTIME.world_size) != (rank, world_size):
                raise CheckpointError(
                    f"this process already checkpoints as rank {_RUNTIME.rank} of {_RUNTIME.world_size}; "
                    f"cannot switch to rank {rank} of {world_size} (jax.distributed starts once per process)"
                )
            return _RUNTIME
        import jax

        _use_cpu_jax()
        if world_size > 1:
            if coordinator is None:
                host = os.environ.get("MASTER_ADDR", "127.0.0.1")
                port = _broadcast_int(_free_port(host) if rank == 0 else 0, process_group)
                coordinator = f"{host}:{port}"
            try:
                jax.distributed.initialize(
                    coordinator_address=coordinator,
                    num_processes=world_size,
                    process_id=rank,
                    local_device_ids=None,
                    initialization_timeout=int(os.environ.get("CHUNKZERO_JAX_INIT_TIMEOUT", "300")),
                )
            except RuntimeError as e:
                raise CheckpointError(
                    f"cannot start jax.distributed for rank {rank} of {world_size} at {coordinator}: {e} "
                    "(in a torch training process JAX must not run computations before the first save)"
                ) from e
        _RUNTIME = _ProcessMesh(rank, world_size)
        return _RUNTIME


# ====================================================================== Orbax managers (one per directory)


@dataclass
class _Managed:
    manager: Any
    max_to_keep: int | None


_MANAGERS: dict[str, _Managed] = {}
_MANAGERS_LOCK = threading.Lock()


def _manager(directory: Path, max_to_keep: int | None):
    import orbax.checkpoint as ocp

    key = str(directory)
    with _MANAGERS_LOCK:
        m = _MANAGERS.get(key)
        if m is not None and m.max_to_keep == max_to_keep:
            return m.manager
        if m is not None:
            m.manager.wait_until_finished()
            m.manager.close()
        if not _MANAGERS:
            _register_exit_hook()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True)
        # ``state`` through the PyTree handler (the format ``StandardSave`` writes) without zstd: fp32
        # training state compresses by ~9% at a large CPU cost, and integrity is checked by checksums.
        handlers = {STATE_ITEM: ocp.PyTreeCheckpointHandler(use_compression=COMPRESS), META_ITEM: ocp.JsonCheckpointHandler()}
        manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
        _MANAGERS[key] = _Managed(manager, max_to_keep)
        return manager


def wait_until_finished(directory: str | os.PathLike | None = None) -> None:
    """Block until this process's pending asynchronous saves (to ``directory``, or all) are committed.

    Called automatically before the next save, before a load of the same directory and at exit.
    """
    with _MANAGERS_LOCK:
        items = list(_MANAGERS.items())
    for key, m in items:
        if directory is None or key == str(Path(directory).resolve()):
            m.manager.wait_until_finished()


_EXIT_HOOK_REGISTERED = False


def _register_exit_hook() -> None:
    """Wait for pending saves at exit, before Python stops its thread pools.

    Orbax commits an asynchronous save on worker threads; at interpreter exit
    ``concurrent.futures`` refuses new work as soon as ``threading._shutdown`` runs its exit hooks —
    before ``atexit`` handlers. So the hook goes into the same list (``threading._register_atexit``,
    run last-registered first, i.e. before the thread pools' own hook registered at import); where that
    is unavailable, a plain ``atexit`` handler registered after JAX's and Orbax's.
    """
    global _EXIT_HOOK_REGISTERED
    if _EXIT_HOOK_REGISTERED:
        return
    _EXIT_HOOK_REGISTERED = True
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_finish_at_exit)
            return
        except RuntimeError:  # interpreter already shutting down
            pass
    atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    with _MANAGERS_LOCK:
        items = list(_MANAGERS.values())
        _MANAGERS.clear()
    for m in items:
        try:
            m.manager.wait_until_finished()
            m.manager.close()
        except Exception as e:  # pragma: no cover - exit path
            logger.error("pending checkpoint save failed at exit: %s", e)


# ====================================================================== steps and metadata


# ====================================================================== shard-level write


def _json_ready(value: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} must be JSON-serializable: {e}") from None


def write_shards(
    directory: str | os.PathLike,
    meta: CheckpointMeta,
    rank: int,
    params: Mapping[int, np.ndarray],
    optim: Mapping[str, Mapping[int, np.ndarray]] | None = None,
    *,
    async_save: bool = False,
    max_to_keep: int | None = None,
    process_group=None,
    coordinator: str | None = None,
) -> Path:
    """Write step ``meta.step`` from this rank's shards (collective over the ``meta.world_size`` ranks).

    Args:
        directory: checkpoint root; the step goes to ``directory/<step>/``.
        meta: the metadata document (its layout's world size is the number of writing processes).
        rank: this process's rank.
        params: chunk index -> this rank's shard of the chunk's ``params`` array (``shard_numel``
            elements, padded, dtype :func:`~chunkzero.checkpoint.param_array_dtype`), for every chunk;
            keep-gathered chunks whole.
        optim: state key -> chunk index -> fp32 shard, for every trainable chunk.
        async_save: return once the shards are handed to Orbax; the write completes in the
            background (the next save, a load of ``directory`` or process exit waits for it).
        max_to_keep: keep only the newest ``max_to_keep`` steps (``None``: keep all).

    Returns:
        ``directory/<step>`` (committed unless ``async_save``).

    Raises:
        CheckpointError: the step already exists or is not after the latest step, or the write failed.
        ShapeMismatchError: a shard's numel differs from the layout's shard numel (names the array).
    """
    layout = meta.layout
    W = layout.world_size
    optim = optim or {}
    state_keys = list(meta.optimizer.state_keys) if meta.optimizer else []
    if sorted(optim) != sorted(state_keys):
        raise ConfigError(f"optimizer shards for {sorted(optim)} but meta lists state keys {state_keys}")
    if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1):
        raise ConfigError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
    directory = Path(directory).resolve()
    meta_doc = _json_ready(meta.to_dict(), "checkpoint metadata")
    CheckpointMeta.from_dict(meta_doc, source="metadata to save")  # never write what we cannot read back

    runtime = process_mesh(rank, W, process_group, coordinator=coordinator)

    def arr(path: str, chunk: int, local: np.ndarray, dtype: str):
        c = layout.chunks[chunk]
        want = layout.shard_numel(chunk)
        local = np.ascontiguousarray(local).reshape(-1)
        if local.size != want:
            raise ShapeMismatchError(path, (want,), local.shape, "this rank's shard")
        if local.dtype != _np_dtype(dtype):
            local = local.astype(_np_dtype(dtype))
        return runtime.global_array(local, c.size, c.keep_gathered)

    tree: dict[str, Any] = {PARAMS_KEY: {}}
    for c in layout.chunks:
        if c.index not in params:
            raise ConfigError(f"no params shard for chunk {c.index}")
        k = chunk_key(c.index)
        tree[PARAMS_KEY][k] = arr(f"{PARAMS_KEY}.{k}", c.index, params[c.index], param_array_dtype(c))
    if state_keys:
        tree[OPTIM_KEY] = {}
        for key in state_keys:
            sub = tree[OPTIM_KEY][key] = {}
            for c in layout.chunks:
                if not c.requires_grad:
                    continue
                if c.index not in optim[key]:
                    raise ConfigError(f"no optimizer {key!r} shard for chunk {c.index}")
                k = chunk_key(c.index)
                sub[k] = arr(f"{OPTIM_KEY}.{key}.{k}", c.index, optim[key][c.index], "float32")

    import orbax.checkpoint as ocp

    manager = _manager(directory, max_to_keep)
    manager.wait_until_finished()
    step = meta.step
    existing = checkpoint_steps(directory)
    if step in existing:
        raise CheckpointError(f"step {step} already exists under {str(directory)!r}; refusing to overwrite it")
    if existing and step < existing[-1]:
        raise CheckpointError(f"step {step} is before the latest step {existing[-1]} under {str(directory)!r}")
    try:
        saved = manager.save(
            step,
            args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeSave(tree), META_ITEM: ocp.args.JsonSave(meta_doc)}),
            force=True,
        )
    except Exception as e:
        raise CheckpointError(f"saving step {step} to {str(directory)!r} failed: {e}") from e
    if not saved:
        raise CheckpointError(f"Orbax declined to save step {step} under {str(directory)!r}")
    if not async_save:
        manager.wait_until_finished()
    return directory / str(step)


# ====================================================================== shard-level read


@dataclass(frozen=True)
class ReadPiece:
    """Copy ``array[src_start:src_stop]`` of the saved array ``array`` (a path such as
    ``("params", "chunk_0003")``) to ``dst_offset`` of the target shard."""

    array: tuple[str, ...]
    src_start: int
    src_stop: int
    dst_offset: int

    @property
    def numel(self) -> int:
        return self.src_stop - self.src_start


def _saved_tensor(saved: ChunkLayout, target_name: str, target_aliases: tuple[str, ...], source: str):
    for n in (target_name, *target_aliases):
        if n in saved:
            return saved.tensor(n)
    raise CheckpointError(f"tensor {target_name!r} of the model is not in the checkpoint {source}")


def check_compatible(saved: ChunkLayout, target: ChunkLayout, *, source: str = "checkpoint") -> None:
    """Check that ``target`` (the model's layout) holds exactly the saved tensors with the same shapes.

    Tensors are matched by name or alias; world size, chunk size and packing may differ.

    Raises:
        CheckpointError: a tensor of the model is not saved, or a saved tensor is not in the model.
        ShapeMismatchError: a tensor's shape differs (names it, expected = model's, got = saved).
    """
    matched: set[str] = set()
    for t in target.tensors:
        s = _saved_tensor(saved, t.name, t.aliases, source)
        if s.shape != t.shape:
            raise ShapeMismatchError(t.name, t.shape, s.shape, f"model vs {source}")
        matched.add(s.name)
    extra = [n for n in saved.names if n not in matched]
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(f"{source} holds tensors the model does not have: {', '.join(map(repr, extra[:5]))}{more}")


def read_plan(saved: ChunkLayout, target: ChunkLayout, chunk: int, rank: int, kind: tuple[str, ...] = (PARAMS_KEY,)) -> list[ReadPiece]:
    """The saved-array slices that make up ``rank``'s shard of target chunk ``chunk``.

    ``kind`` is the array path without the chunk key: ``("params",)`` or ``("optim", "exp_avg")``.
    Pieces of one saved array that are contiguous in both source and target are merged, so when only
    the world size changed each shard is one read. Padding is not read (it stays zero).
    """
    pieces: list[ReadPiece] = []
    for t, a, b, shard_offset in target.shard_pieces(chunk, rank):
        s = _saved_tensor(saved, t.name, t.aliases, "checkpoint")
        p = ReadPiece((*kind, chunk_key(s.chunk)), s.offset + a, s.offset + b, shard_offset)
        last = pieces[-1] if pieces else None
        if last and last.array == p.array and last.src_stop == p.src_start and last.dst_offset + last.numel == p.dst_offset:
            pieces[-1] = ReadPiece(p.array, last.src_start, p.src_stop, last.dst_offset)
        else:
            pieces.append(p)
    return pieces


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
        if self._array is None and offset == 0 and data.size == self.size and data.dtype == self.dtype and data.flags.writeable:
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
        meta: its validated metadata (gives each array's expected shape and dtype).
    """

    def __init__(self, step_dir: str | os.PathLike, meta: CheckpointMeta):
        import orbax.checkpoint as ocp

        self.step_dir = Path(step_dir).absolute()  # Orbax and TensorStore want absolute paths
        self.item_dir = self.step_dir / STATE_ITEM
        self.meta = meta
        self.expected = meta.expected_arrays()
        self._ocp = ocp
        self._stores: dict[tuple[str, ...], Any] = {}
        self.reads_started = False
        """Whether :meth:`read_into` began reading array data (after every open succeeded)."""
        self.checksums: dict[str, list[str]] | None = meta.checksums["arrays"] if meta.checksums else None
        self._context = None
        self._use_ocdbt: bool | None = None
        self._use_zarr3 = False
        md = self.item_dir / "_METADATA"
        try:
            doc = json.loads(md.read_bytes())
            self._use_ocdbt = bool(doc.get("use_ocdbt", True))
            self._use_zarr3 = bool(doc.get("use_zarr3", False))
            tree = doc.get("tree_metadata", {})
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint array metadata {str(md)!r} is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointFormatError(f"{md}: not a valid Orbax metadata file ({e})") from None
        self._saved_paths = set()
        for v in tree.values():
            try:
                self._saved_paths.add(tuple(k["key"] for k in v["key_metadata"]))
            except (KeyError, TypeError):
                raise CheckpointFormatError(f"{md}: malformed tree_metadata entry") from None
        missing = [p for p in self.expected if p not in self._saved_paths]
        if missing:
            raise CheckpointFormatError(
                f"{md}: array {'.'.join(missing[0])!r} listed by the checkpoint metadata is not saved"
                + (f" ({len(missing)} missing)" if len(missing) > 1 else "")
            )

    def _where(self, path: tuple[str, ...]) -> str:
        return f"array {'.'.join(path)!r} in {str(self.item_dir)!r}"

    def _spec(self, path: tuple[str, ...]) -> dict:
        from etils import epath

        info = self._ocp.type_handlers.ParamInfo(
            name=".".join(path),
            parent_dir=epath.Path(self.item_dir),
            is_ocdbt_checkpoint=self._use_ocdbt,
            use_zarr3=self._use_zarr3,
            ts_context=self._context,
        )
        return self._ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._use_ocdbt)

    def _check(self, path: tuple[str, ...], store) -> None:
        shape, dtype = self.expected[path]
        if tuple(store.shape) != tuple(shape):
            raise ShapeMismatchError(".".join(path), shape, store.shape, f"saved array in {self.item_dir}")
        if np.dtype(store.dtype.numpy_dtype) != _np_dtype(dtype):
            raise CheckpointFormatError(f"{self._where(path)} is {store.dtype.name}, metadata says {dtype}")

    def open(self, path: tuple[str, ...]):
        """The TensorStore of saved array ``path`` (read-only; checked against the expected shape and dtype)."""
        self.open_all([path])
        return self._stores[path]

    def saved_shards(self, path: tuple[str, ...]) -> list[tuple[int, int, int]]:
        """``(saving rank, start, stop)``: the valid element range of each saved shard of array ``path``
        (one range for a keep-gathered chunk) — the units checksums cover and storage reads decode."""
        layout = self.meta.layout
        c = layout.chunks[chunk_index(path[-1])]
        if c.keep_gathered:
            return [(0, 0, c.utilized)]
        s = c.size // layout.world_size
        return [(q, q * s, max(q * s, min((q + 1) * s, c.utilized))) for q in range(layout.world_size)]

    def _verify(self, path: tuple[str, ...], q: int, start: int, stop: int, data: np.ndarray) -> None:
        if self.checksums is None:
            return
        sums = self.checksums.get(checksum_key(path))
        if sums is None:
            raise CheckpointFormatError(f"{self.step_dir / META_ITEM}: no checksum for array {'.'.join(path)!r}")
        got = shard_checksum(data)
        if got != sums[q]:
            raise CheckpointError(
                f"{self._where(path)} is corrupted: elements [{start}, {stop}) saved by rank {q} have checksum {got}, "
                f"the metadata recorded {sums[q]}"
            )

    def open_all(self, paths) -> None:
        """Open the TensorStores of ``paths`` concurrently (each open reads the OCDBT manifest)."""
        import tensorstore as ts

        todo = [p for p in dict.fromkeys(paths) if p not in self._stores]
        if not todo:
            return
        if self._context is None:
            self._context = self._ocp.type_handlers.get_ts_context(use_ocdbt=self._use_ocdbt)
        pending = []
        for path in todo:
            if path not in self.expected:
                raise CheckpointError(f"{self._where(path)} is not part of this checkpoint's format")
            pending.append((path, ts.open(self._spec(path), read=True, open=True, context=self._context)))
        for path, fut in pending:
            try:
                store = fut.result()
            except Exception as e:
                raise CheckpointError(f"cannot open {self._where(path)}: {e}") from None
            self._check(path, store)
            self._stores[path] = store

    def read_into(self, needs: list[tuple[ReadPiece, Target]], *, budget_bytes: int = 256 << 20) -> None:
        """Fill each target's elements ``[p.dst_offset, p.dst_offset + p.numel)`` from piece ``p``.

        Reads go by saved shard: every saved shard a piece overlaps is read once (its valid range — the
        unit TensorStore decodes anyway, so no extra disk traffic), checked against its checksum, and
        scattered to the pieces; a read that is exactly one whole target becomes that target's buffer
        (no copy). Reads are issued concurrently, up to ``budget_bytes`` in flight.

        Raises:
            CheckpointError: a read failed (truncated or missing data) or a checksum does not match;
                the message names the array, the saving rank and the element range.
        """
        by_shard: dict[tuple[tuple[str, ...], int], list[tuple[ReadPiece, Target]]] = {}
        ranges: dict[tuple[tuple[str, ...], int], tuple[int, int]] = {}
        for p, out in needs:
            if p.numel <= 0:
                continue
            for q, a, b in self.saved_shards(p.array):
                if a < p.src_stop and p.src_start < b:
                    by_shard.setdefault((p.array, q), []).append((p, out))
                    ranges[(p.array, q)] = (a, b)
        self.open_all(k[0] for k in by_shard)
        batch: list = []
        in_flight = 0
        self.reads_started = True

        def flush():
            nonlocal batch, in_flight
            for key, a, b, fut, direct in batch:
                try:
                    data = fut.result()
                except Exception as e:
                    raise CheckpointError(f"cannot read elements [{a}, {b}) of {self._where(key[0])}: {e}") from None
                if direct is not None:  # already in place
                    self._verify(key[0], key[1], a, b, direct)
                    continue
                self._verify(key[0], key[1], a, b, data)
                for p, out in by_shard[key]:
                    lo, hi = max(a, p.src_start), min(b, p.src_stop)
                    d = p.dst_offset + lo - p.src_start
                    out.put(d, data[lo - a : hi - a])
                del data
            batch, in_flight = [], 0

        import tensorstore as ts

        for key in by_shard:
            a, b = ranges[key]
            store = self._stores[key[0]]
            nbytes = (b - a) * store.dtype.numpy_dtype.itemsize
            if batch and in_flight + nbytes > budget_bytes:
                flush()
            users = by_shard[key]
            p, out = users[0]
            if (len(users) == 1 and out.in_place and p.src_start <= a and b <= p.src_stop
                    and np.dtype(store.dtype.numpy_dtype) == out.dtype):
                # the whole saved shard lands in one live buffer: TensorStore copies it there directly
                d = p.dst_offset + a - p.src_start
                view = out.array[d : d + b - a]
                batch.append((key, a, b, ts.array(view).write(store[a:b]), view))
            else:
                batch.append((key, a, b, store[a:b].read(), None))
            in_flight += nbytes
        flush()

    def read(self, path: tuple[str, ...], start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of saved array ``path`` as numpy (checksums verified)."""
        store = self.open(path)
        stop = store.shape[0] if stop is None else stop
        out = Target(stop - start, _np_dtype(self.expected[path][1]))
        self.read_into([(ReadPiece(path, start, stop, 0), out)])
        return out.array


def read_shards(
    step_dir: str | os.PathLike,
    meta: CheckpointMeta,
    target: ChunkLayout,
    rank: int,
    *,
    optim_keys: list[str] | None = None,
    reader: ChunkReader | None = None,
    into: Mapping[tuple[str, ...], np.ndarray] | None = None,
) -> tuple[dict[int, np.ndarray], dict[str, dict[int, np.ndarray]]]:
    """This rank's shards of ``target``'s chunks, read from a checkpoint of any world or chunk size.

    Args:
        step_dir: the step's directory; ``meta`` its metadata (:func:`read_meta`).
        target: the layout to load into (the model's); tensors matched by name (see
            :func:`check_compatible`).
        rank: rank in ``target``'s world.
        optim_keys: optimizer-state keys to read (default: all the checkpoint holds; ``[]``: none).
        into: optional destination buffers by ``(kind..., chunk_key)`` (``("params", "chunk_0003")``,
            ``("optim", "exp_avg", "chunk_0003")``): writable 1-D arrays of the shard's size and dtype
            (views of live shards) that are overwritten in place — their padding is zeroed — and
            returned; a read error then leaves them partly written.

    Returns:
        ``(params, optim)``: chunk index -> shard (``target.shard_numel(i)`` elements, padding zero;
        fp32 for trainable chunks, the chunk's dtype for frozen ones), and state key -> chunk index ->
        fp32 shard for trainable chunks.

    Raises:
        CheckpointError / CheckpointFormatError / ShapeMismatchError: see :func:`check_compatible`
            and :class:`ChunkReader`; an optimizer key the checkpoint lacks.
    """
    check_compatible(meta.layout, target, source=str(step_dir))
    saved_keys = list(meta.optimizer.state_keys) if meta.optimizer else []
    optim_keys = saved_keys if optim_keys is None else list(optim_keys)
    for k in optim_keys:
        if k not in saved_keys:
            raise CheckpointError(f"optimizer state {k!r} is not in the checkpoint {str(step_dir)!r} (it holds {saved_keys})")
    reader = reader or ChunkReader(step_dir, meta)
    into = into or {}
    param_targets: dict[int, Target] = {}
    optim_targets: dict[str, dict[int, Target]] = {k: {} for k in optim_keys}
    plan: list[tuple[ReadPiece, Target]] = []
    for c in target.chunks:
        n = target.shard_numel(c.index)
        pieces = read_plan(meta.layout, target, c.index, rank, (PARAMS_KEY,))
        dtype = param_array_dtype(c)
        if pieces and not c.requires_grad:
            dtype = reader.expected[pieces[0].array][1]  # a frozen chunk as saved; cast below
        param_targets[c.index] = Target(n, _np_dtype(dtype), into.get((PARAMS_KEY, chunk_key(c.index))))
        plan += [(p, param_targets[c.index]) for p in pieces]
        if c.requires_grad:
            for k in optim_keys:
                optim_targets[k][c.index] = Target(n, np.float32, into.get((OPTIM_KEY, k, chunk_key(c.index))))
                optim_pieces = read_plan(meta.layout, target, c.index, rank, (OPTIM_KEY, k))
                for p in optim_pieces:
                    if not meta.layout.chunks[chunk_index(p.array[-1])].requires_grad:
                        frozen = [t.name for t in meta.layout.chunk_tensors(chunk_index(p.array[-1]))]
                        raise CheckpointError(
                            f"tensor(s) {', '.join(map(repr, frozen[:3]))} are trainable in the model but were frozen "
                            f"in the checkpoint {str(step_dir)!r}, which holds no optimizer state for them "
                            "(load with optimizer=None)"
                        )
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
        want = _np_dtype(param_array_dtype(c))
        params[c.index] = a if a.dtype == want else a.astype(want)
    optim = {k: {i: t.array for i, t in per.items()} for k, per in optim_targets.items()}
    return params, optim


# ====================================================================== RNG states (JSON, never pickle)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON: Python, numpy, torch CPU and (if available) CUDA devices."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any], *, source: str = "rng state") -> None:
    """Restore states written by :func:`rng_state`.

    Raises:
        CheckpointFormatError: a field is missing or malformed (names ``source`` and the field).
    """
    try:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        n = state["numpy"]
        np.random.set_state((str(n["kind"]), np.asarray(n["keys"], dtype=np.uint32), int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])))
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"], validate=True)), dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            cuda = [torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8) for s in state["cuda"]]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:
                logger.warning("%s: CUDA RNG states for %d devices, this process sees %d; CUDA RNG not restored", source, len(cuda), torch.cuda.device_count())
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointFormatError(f"{source}: malformed RNG state ({type(e).__name__}: {e})") from None


def reseed(seed: int) -> None:
    """Seed Python, numpy and torch (CPU and CUDA) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _all_gather_json(obj: Any, rank: int, world_size: int, process_group) -> list[Any]:
    """Every rank's ``obj`` (JSON-encoded bytes over torch.distributed; no pickle)."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    data = json.dumps(obj).encode("utf-8")
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n, group=process_group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(buf) for _ in range(world_size)]
    dist.all_gather(out, buf, group=process_group)
    return [json.loads(bytes(o[: int(s.item())].cpu().numpy())) for o, s in zip(out, sizes)]


# ====================================================================== model and optimizer


_IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Optimizer param-group entries that choose a kernel, not the math: recorded, never restored."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _class_name(obj: Any) -> str:
    cls = type(obj)
    module = cls.__module__
    if module.startswith("torch.optim."):  # torch.optim.adamw.AdamW -> torch.optim.AdamW (its public name)
        if getattr(torch.optim, cls.__name__, None) is cls:
            module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def _model_config(model) -> dict | None:
    config = getattr(getattr(model, "module", model), "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        return json.loads(json.dumps(to_dict()))
    except (TypeError, ValueError):
        logger.warning("the model's config is not JSON-serializable; pass model_config= to save it")
        return None


def _optimizer_shards(model, optimizer) -> tuple[OptimizerMeta, dict[str, dict[int, np.ndarray]]]:
    layout: ChunkLayout = model.layout
    per_chunk: dict[int, dict[str, torch.Tensor]] = {}
    keys: list[str] = []
    step: int | None = None
    for c in layout.chunks:
        if not c.requires_grad:
            continue
        state = optimizer.shard_state(c.index)
        per_chunk[c.index] = {}
        for key, value in state.items():
            value = torch.as_tensor(value)
            if value.dim() == 1 and value.numel() == layout.shard_numel(c.index):
                per_chunk[c.index][key] = value
                if key not in keys:
                    keys.append(key)
            elif key == "step" and value.numel() == 1:
                s = int(value.item())
                if step is not None and s != step:
                    logger.warning("optimizer 'step' differs between chunks (%d vs %d); saving %d", step, s, max(step, s))
                step = s if step is None else max(step, s)
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of chunk {c.index} (shape {tuple(value.shape)}) is neither a per-element "
                    f"shard of {layout.shard_numel(c.index)} elements nor the step count; the chunkzero format cannot hold it"
                )
    optim: dict[str, dict[int, np.ndarray]] = {k: {} for k in keys}
    for i, state in per_chunk.items():
        for k in keys:
            if k in state:
                optim[k][i] = to_numpy(state[k].to(torch.float32), copy=False)
            else:
                logger.warning("chunk %d has no optimizer state %r (saved as zeros)", i, k)
                optim[k][i] = np.zeros(layout.shard_numel(i), dtype=np.float32)
    hypers = {k: _jsonable(v) for k, v in optimizer.hyperparameters().items()}
    inner = getattr(optimizer, "optimizer", optimizer)
    meta = OptimizerMeta(
        class_name=_class_name(inner),
        hyperparameters=hypers,
        state_keys=keys,
        step=int(step if step is not None else getattr(optimizer, "step_count", 0)),
    )
    return meta, optim


def save_checkpoint(
    directory: str | os.PathLike,
    model,
    optimizer=None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
    max_to_keep: int | None = None,
    model_config: Mapping[str, Any] | None = None,
    data_position: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``model`` (a :class:`~torch_backend.ZeroDDP`) and ``optimizer`` as step ``step`` (collective).

    Every rank of the model's process group calls it; each writes only its own shards (see the module
    docstring). The checkpoint is ``directory/<step>/``, an Orbax checkpoint of the
    :mod:`chunkzero.checkpoint` format.

    Args:
        directory: checkpoint root (created if missing).
        step: training step (an int ``>= 0`` after every step already saved; never overwritten).
        optimizer: the :class:`~torch_backend.ZeroOptimizer`, or ``None`` for parameters only.
        extra: anything JSON-serializable to keep in ``meta.extra``.
        async_save: return once the shards are copied to host memory and handed to Orbax; the next
            save, a load of ``directory`` or the process's exit waits for the write to commit.
        max_to_keep: keep only the newest ``max_to_keep`` steps (older ones are deleted after a commit).
        model_config: JSON-able model configuration (default: ``module.config.to_dict()`` if the
            wrapped module has one — GPT and Hugging Face models do).
        data_position: JSON-able data-loader position (e.g. a sampler's ``state_dict()``).

    Returns:
        ``directory/<step>``.

    Raises:
        ConfigError: bad ``step`` or ``max_to_keep``, or metadata that is not JSON-serializable.
        CheckpointError: ``step`` exists already or is before the latest step, or Orbax failed.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    layout: ChunkLayout = model.layout
    rank, world = int(model.rank), int(model.world_size)
    group = getattr(model, "process_group", None)
    own_rng = rng_state()
    params: dict[int, np.ndarray] = {}
    for c in layout.chunks:
        # views of the live shards: write_shards hands Orbax a JAX-owned copy before returning
        if c.requires_grad:
            params[c.index] = to_numpy(model.master_shard(c.index), copy=False)
        else:
            params[c.index] = to_numpy(model.master_shard(c.index).to(_torch_dtype(c.dtype)), copy=False)
    optim_meta, optim = (None, {}) if optimizer is None else _optimizer_shards(model, optimizer)
    own_sums: dict[str, str] = {}
    for c in layout.chunks:
        n = layout.valid_length(c.index, rank)
        own_sums[checksum_key((PARAMS_KEY, chunk_key(c.index)))] = shard_checksum(params[c.index][:n])
        for key, shards in optim.items():
            if c.index in shards:
                own_sums[checksum_key((OPTIM_KEY, key, chunk_key(c.index)))] = shard_checksum(shards[c.index][:n])
    everyone = _all_gather_json({"rng": own_rng, "sums": own_sums}, rank, world, group)
    rng = [e["rng"] for e in everyone]
    arrays = {}
    for c in layout.chunks:
        keys = [checksum_key((PARAMS_KEY, chunk_key(c.index)))]
        keys += [checksum_key((OPTIM_KEY, k, chunk_key(c.index))) for k in optim if c.index in optim[k]]
        for key in keys:
            arrays[key] = [everyone[0]["sums"][key]] if c.keep_gathered else [e["sums"][key] for e in everyone]
    if model_config is None:
        model_config = _model_config(model)
    meta = CheckpointMeta(
        step=step,
        layout=layout,
        mixed_precision=str(getattr(model, "mixed_precision", "fp32")),
        optimizer=optim_meta,
        loss_scaler=None if optimizer is None else _json_ready(optimizer.loss_scaler_state(), "loss-scaler state"),
        model_config=None if model_config is None else _json_ready(dict(model_config), "model_config"),
        data_position=None if data_position is None else _json_ready(dict(data_position), "data_position"),
        rng_states=rng,
        extra=None if extra is None else _json_ready(dict(extra), "extra"),
        checksums={"algorithm": CHECKSUM_ALGORITHM, "arrays": arrays},
    )
    try:
        return write_shards(directory, meta, rank, params, optim, async_save=async_save, max_to_keep=max_to_keep,
                            process_group=group)
    finally:
        # Orbax and JAX draw from Python's and numpy's global RNGs (temporary names, ids): a save must
        # leave the training RNG streams exactly where they were, or runs with and without saves diverge.
        set_rng_state(own_rng, source="RNG state before the save")


def _agree(ok: bool, rank: int, world: int, group) -> bool:
    """Whether every rank reports ``ok`` (one all-reduce; ``True`` on a single process)."""
    if world == 1:
        return ok
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) == 0


def load_checkpoint(
    directory: str | os.PathLike,
    model,
    optimizer=None,
    step: int | None = None,
    *,
    load_rng: bool = True,
    load_hyperparameters: bool = True,
    staged: bool = False,
) -> CheckpointMeta:
    """Restore ``model`` and ``optimizer`` from a checkpoint of any world size or chunk size.

    Every rank of the model's process group calls it. Each rank reads only the element ranges its
    shards now hold (tensors matched by name; see the module docstring), then the ranks agree (one
    all-reduce) that all of them succeeded. Files are never modified.

    Everything that can be checked without reading array data is checked before the model is touched:
    the step, the metadata, the layout against the model's (names, shapes), the optimizer, every
    array's presence, shape and dtype. The array data then goes straight into the live CPU shards
    (TensorStore copies into them; no second buffer), so a read error *during* that phase — a
    truncated file, a checksum mismatch — leaves the model partly overwritten (the error says so).
    ``staged=True`` reads everything into new buffers first and touches the model only after every
    rank succeeded, at the cost of a second copy of this rank's state in memory.

    Restores: fp32 master shards (and the low-precision shards from them), optimizer state shards and
    step count, hyper-parameters (``lr``, ``betas`` …, not kernel flags like ``foreach``), the loss
    scaler, and — when the checkpoint was saved at this world size — each rank's Python, numpy, torch
    and CUDA RNG states. At another world size the RNGs are re-seeded from ``(step, rank)`` with a
    warning.

    Args:
        directory: checkpoint root, or one step's directory.
        step: the step to load (default: the latest committed one).
        optimizer: the :class:`~torch_backend.ZeroOptimizer` to restore, or ``None`` (parameters only).
        load_rng: restore (or re-seed) the RNG states.
        load_hyperparameters: overwrite the optimizer's hyper-parameters with the saved ones.
        staged: leave the model untouched on any failure (see above).

    Returns:
        The checkpoint's :class:`~chunkzero.checkpoint.CheckpointMeta` (``meta.data_position``,
        ``meta.model_config``, ``meta.extra`` …).

    Raises:
        CheckpointError: no such step, a truncated or missing array (names the file and array), a
            tensor of the model missing from the checkpoint or vice versa, an optimizer of another class,
            a checkpoint without optimizer state, or another rank failed to read.
        CheckpointFormatError: malformed metadata (names the file and field).
        ShapeMismatchError: a tensor's shape differs between the model and the checkpoint.
    """
    rank, world = int(model.rank), int(model.world_size)
    group = getattr(model, "process_group", None)
    error: BaseException | None = None
    reader: ChunkReader | None = None
    into: dict[tuple[str, ...], np.ndarray] = {}
    try:
        if Path(directory).exists():
            wait_until_finished(Path(directory).resolve())
            if is_step_dir(Path(directory)):
                wait_until_finished(Path(directory).resolve().parent)
        step_dir = resolve_step_dir(directory, step)
        meta = read_meta(step_dir)
        optim_keys: list[str] = []
        if optimizer is not None:
            if meta.optimizer is None:
                raise CheckpointError(f"checkpoint {str(step_dir)!r} holds no optimizer state (saved without an optimizer)")
            inner = getattr(optimizer, "optimizer", optimizer)
            if meta.optimizer.class_name != _class_name(inner):
                raise CheckpointError(
                    f"checkpoint {str(step_dir)!r} holds {meta.optimizer.class_name} state, the optimizer is "
                    f"{_class_name(inner)} (pass optimizer=None to load parameters only)"
                )
            optim_keys = list(meta.optimizer.state_keys)
        reader = ChunkReader(step_dir, meta)
        into, live_state = ({}, {}) if staged else _live_buffers(model, optimizer, optim_keys)
        params, optim = read_shards(step_dir, meta, model.layout, rank, optim_keys=optim_keys, reader=reader, into=into)
    except Exception as e:  # agree first, re-raise after
        error = e
        if not staged and reader is not None and reader.reads_started and isinstance(e, CheckpointError):
            error = type(e)(f"{e} (this rank's shards are now partly overwritten: load a good checkpoint, or pass "
                            "staged=True to keep the model intact on failure)")
    if not _agree(error is None, rank, world, group):
        if error is not None:
            raise error
        touched = "" if staged else " (this rank's shards were loaded; the ranks now disagree: load again)"
        raise CheckpointError(f"another rank failed to read the checkpoint under {str(directory)!r}{touched}")

    for i, shard in params.items():
        model.load_master_shard(i, to_torch(shard))  # in place already: refreshes the low-precision shard
    if optimizer is not None and meta.optimizer is not None:
        step_value = torch.tensor(float(meta.optimizer.step), dtype=torch.float32)
        for c in model.layout.chunks:
            if not c.requires_grad:
                continue
            live = live_state.get(c.index)
            if live is not None and optim_keys and all(optim[k][c.index] is into.get((OPTIM_KEY, k, chunk_key(c.index)))
                                                       for k in optim_keys):
                live["step"].copy_(step_value)  # the state tensors were overwritten in place
                continue
            state: dict[str, Any] = {k: to_torch(optim[k][c.index]) for k in optim_keys}
            if state:
                state["step"] = step_value.clone()
            optimizer.load_shard_state(c.index, state)
        if meta.loss_scaler is not None:
            optimizer.load_loss_scaler_state(meta.loss_scaler)
        if load_hyperparameters:
            _load_hyperparameters(optimizer, meta.optimizer.hyperparameters)
    if load_rng:
        if meta.rng_states is not None and len(meta.rng_states) == world:
            set_rng_state(meta.rng_states[rank], source=f"{step_dir}/{META_ITEM} rng_states[{rank}]")
        else:
            seed = (meta.step * 1_000_003 + rank) % 2**63
            saved = "no RNG states" if meta.rng_states is None else f"RNG states of {len(meta.rng_states)} ranks"
            logger.warning(
                "checkpoint %s holds %s, this run has %d: re-seeding rank %d's Python/numpy/torch RNGs with %d",
                step_dir, saved, world, rank, seed,
            )
            reseed(seed)
    return meta


def _cpu_view(t: torch.Tensor | None, numel: int, dtype: torch.dtype) -> np.ndarray | None:
    if (t is None or t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != (numel,)
            or not t.is_contiguous() or dtype == torch.bfloat16):
        return None
    return t.detach().numpy()


def _live_buffers(model, optimizer, optim_keys: list[str]):
    """Numpy views of the live CPU shards that a load can overwrite in place, by array path, and the
    live optimizer-state dicts whose tensors those views are (chunks with a complete Adam-style state)."""
    layout: ChunkLayout = model.layout
    into: dict[tuple[str, ...], np.ndarray] = {}
    live_state: dict[int, dict[str, torch.Tensor]] = {}
    for c in layout.chunks:
        n = layout.shard_numel(c.index)
        if c.requires_grad:  # frozen chunks are saved in their own dtype: read, then cast
            view = _cpu_view(model.master_shard(c.index), n, torch.float32)
            if view is not None:
                into[(PARAMS_KEY, chunk_key(c.index))] = view
        if optimizer is None or not c.requires_grad or not optim_keys:
            continue
        state = optimizer.shard_state(c.index)
        views = {k: _cpu_view(state.get(k), n, torch.float32) for k in optim_keys}
        step = state.get("step")
        if all(v is not None for v in views.values()) and isinstance(step, torch.Tensor) and step.numel() == 1:
            for k, v in views.items():
                into[(OPTIM_KEY, k, chunk_key(c.index))] = v
            live_state[c.index] = state
    return into, live_state


def _load_hyperparameters(optimizer, saved: Mapping[str, Any]) -> None:
    group = optimizer.param_groups[0]
    for key, value in saved.items():
        if key in _IMPLEMENTATION_FLAGS or key == "params" or key not in group:
            continue
        current = group[key]
        if isinstance(current, torch.Tensor):
            current.fill_(value)
        elif isinstance(current, tuple):
            group[key] = tuple(value)
        else:
            group[key] = value
