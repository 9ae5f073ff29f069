"""Export a chunk checkpoint to a parameter tree (Orbax or safetensors), import full weights into ZeroDDP,
and describe a checkpoint without loading its arrays.

**Export** (:func:`export_checkpoint`, ``chunkzero export``) streams: saved chunks are read one at a time
(TensorStore reads of the ``params`` arrays of :mod:`chunkzero.checkpoint`), each tensor is cut out of
its chunk, cast if asked, written, and dropped — peak memory is about one chunk plus one tensor,
whatever the model's size.

* ``orbax-params``: an Orbax PyTree checkpoint of the nested parameter tree
  (``{"transformer": {"h": {"0": {"attn": {"c_attn": {"weight": f32[...]}}}}}}``, split on ``.``), which
  ``orbax.checkpoint.StandardCheckpointer().restore(OUT)`` returns (numpy arrays, or ``jax.Array`` s with
  the shardings of an abstract target). Written through a streaming variant of Orbax's own numpy
  handler, so the files are exactly what Orbax writes for numpy leaves.
* ``safetensors``: the Hugging Face layout: ``model.safetensors``, or above ``max_shard_size``
  ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``; ``config.json`` too when the
  checkpoint's ``model_config`` is a Hugging Face config (it has ``model_type``), so
  ``AutoModel*.from_pretrained(OUT)`` loads it. A tied tensor is written once, under its primary name
  (the first in parameter order, e.g. ``transformer.wte.weight``; Hugging Face re-ties ``lm_head``).
  The file format (8-byte header length, JSON header, raw little-endian data) is written directly so
  no tensor has to be held in memory with the others.

**Import** (:func:`load_pretrained`) fills a ZeroDDP model from a full torch state dict, a ``.pt``/``.bin``
file (``torch.load(weights_only=True)``), a ``.safetensors`` file or a Hugging Face directory; each rank
reads only the element ranges its shards hold.

Nothing here unpickles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chunkzero.checkpoint import PARAMS_KEY, CheckpointMeta, chunk_key
from chunkzero.dtypes import canonical_dtype, itemsize_bytes
from chunkzero.errors import CheckpointError, ConfigError, ShapeMismatchError
from chunkzero.layout import ChunkLayout, TensorPlacement

from .checkpoint import (
    ChunkReader,
    _np_dtype,
    read_meta,
    resolve_step_dir,
    to_torch,
)

FORMATS = ("orbax-params", "safetensors")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_SIZE = "5GB"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "bool": "BOOL",
}
_ST_TO_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}

__all__ = [
    "ExportReport",
    "ImportReport",
    "export_checkpoint",
    "load_pretrained",
    "param_tree",
    "parse_size",
]


# ====================================================================== helpers


def parse_size(text: str | int) -> int:
    """Bytes of a size like ``"5GB"`` (10**9), ``"500MiB"`` (2**20), ``"2000"`` (bytes).

    Raises:
        ConfigError: not a positive size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", str(text), re.IGNORECASE)
        if not m:
            raise ConfigError(f"not a size: {text!r} (examples: 5GB, 500MB, 64MiB, 1000000)")
        unit = (m.group(2) or "").upper().rstrip("B")
        mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
        value = int(float(m.group(1)) * mult)
    if value < 1:
        raise ConfigError(f"size must be positive, got {text!r}")
    return value


def param_tree(names: list[str]) -> dict:
    """Nested dict of ``names`` split on ``.`` with each leaf the full name.

    Raises:
        ConfigError: a name is both a leaf and a prefix of another (``a.b`` and ``a.b.c``).
    """
    tree: dict = {}
    for name in names:
        node = tree
        parts = name.split(".")
        for i, p in enumerate(parts[:-1]):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"tensor name {'.'.join(parts[: i + 1])!r} is also a prefix of {name!r}")
            node = nxt
        if parts[-1] in node:
            raise ConfigError(f"tensor name {name!r} is also a prefix of another tensor's name")
        node[parts[-1]] = name
    return tree


def _export_dtype(saved_dtype: str, dtype: str | None) -> str:
    if dtype is None:
        return saved_dtype
    saved = canonical_dtype(saved_dtype)
    return canonical_dtype(dtype) if saved in EXPORT_DTYPES or saved == "float64" else saved


class _ChunkStream:
    """Each tensor of a checkpoint, read one chunk at a time (the only chunk held in memory)."""

    def __init__(self, step_dir: Path, meta: CheckpointMeta):
        self.meta = meta
        self.layout: ChunkLayout = meta.layout
        self.reader = ChunkReader(step_dir, meta)
        self._cached: tuple[int, np.ndarray] | None = None

    def saved_dtype(self, t: TensorPlacement) -> str:
        return self.reader.expected[(PARAMS_KEY, chunk_key(t.chunk))][1]

    def chunk(self, index: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != index:
            self._cached = None  # drop the previous chunk before reading the next
            c = self.layout.chunks[index]
            self._cached = (index, self.reader.read((PARAMS_KEY, chunk_key(index)), 0, c.utilized))
        return self._cached[1]

    def tensor(self, t: TensorPlacement) -> np.ndarray:
        """Full-shaped view of tensor ``t`` in its chunk (valid until the next chunk is read)."""
        return self.chunk(t.chunk)[t.offset : t.end].reshape(t.shape)

    def ordered(self) -> list[TensorPlacement]:
        """Tensors in storage order (chunk, offset): each chunk is read once."""
        return sorted(self.layout.tensors, key=lambda t: (t.chunk, t.offset))

    def close(self) -> None:
        self._cached = None


@dataclass
class ExportReport:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        out: the output directory.
        format: ``"orbax-params"`` or ``"safetensors"``.
        step: the checkpoint step exported.
        tensors: number of tensors written (each tied tensor once).
        total_bytes: bytes of tensor data written.
        files: the files written (relative to ``out``).
        aliases: tied names not written, each mapped to the name it is stored under.
    """

    out: Path
    format: str
    step: int
    tensors: int
    total_bytes: int
    files: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)


# ====================================================================== safetensors (streaming)


def _write_safetensors(stream: _ChunkStream, out: Path, dtype: str | None, max_shard_bytes: int) -> tuple[list[str], int]:
    tensors = stream.ordered()
    plan: list[list[tuple[TensorPlacement, str, int]]] = [[]]
    current = 0
    for t in tensors:
        out_dtype = _export_dtype(stream.saved_dtype(t), dtype)
        nbytes = t.numel * itemsize_bytes(out_dtype)
        if plan[-1] and current + nbytes > max_shard_bytes:
            plan.append([])
            current = 0
        plan[-1].append((t, out_dtype, nbytes))
        current += nbytes
    n = len(plan)
    names = [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total = 0
    weight_map: dict[str, str] = {}
    for fname, entries in zip(names, plan):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        pos = 0
        for t, out_dtype, nbytes in entries:
            header[t.name] = {"dtype": _ST_DTYPES[out_dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
            weight_map[t.name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t, out_dtype, nbytes in entries:
                a = stream.tensor(t)
                if a.dtype != _np_dtype(out_dtype):
                    a = a.astype(_np_dtype(out_dtype))
                a = np.ascontiguousarray(a)
                if a.dtype.byteorder == ">":
                    a = a.byteswap().view(a.dtype.newbyteorder("<"))
                f.write(memoryview(a.reshape(-1).view(np.uint8)))
                total += nbytes
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        names.append(SAFE_WEIGHTS_INDEX_NAME)
    return names, total


# ====================================================================== orbax-params (streaming)


class _LazyLeaf:
    """A leaf of the exported tree: the tensor ``placement`` of ``stream``, read when written."""

    def __init__(self, stream: _ChunkStream, placement: TensorPlacement, dtype: str):
        self.stream, self.placement = stream, placement
        self.shape = tuple(placement.shape)
        self.dtype = _np_dtype(dtype)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def load(self) -> np.ndarray:
        a = self.stream.tensor(self.placement)
        return a.astype(self.dtype) if a.dtype != self.dtype else np.array(a)


def _streaming_numpy_handler():
    """Orbax's ``NumpyHandler`` writing :class:`_LazyLeaf` s one at a time in storage order.

    On disk the leaves are ordinary numpy arrays (value type ``np.ndarray``), restorable by any Orbax.
    """
    import orbax.checkpoint as ocp
    from orbax.checkpoint import future as ocp_future
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    class StreamingNumpyHandler(ocp.type_handlers.NumpyHandler):
        async def serialize(self, values, infos, args=None):
            args = list(args or [ocp.SaveArgs()] * len(values))
            return [ocp_future.CommitFutureAwaitingContractedSignals(self._stream(values, infos, args), name="chunkzero_export")]

        async def _stream(self, values, infos, args):
            order = sorted(range(len(values)), key=lambda i: (values[i].placement.chunk, values[i].placement.offset))
            for i in order:
                value, info, arg = values[i], infos[i], args[i]
                await info.await_path_creation()
                a = value.load()
                spec = ts_utils.build_array_write_spec(
                    info=info, arg=arg, global_shape=a.shape, local_shape=a.shape, dtype=a.dtype,
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
                    metadata_key=self._metadata_key,
                ).json
                await self._open_and_write(a, spec, info.ts_context)
                del a

    return StreamingNumpyHandler()


def _write_orbax_params(stream: _ChunkStream, out: Path, dtype: str | None) -> int:
    import orbax.checkpoint as ocp

    names = [t.name for t in stream.ordered()]
    skeleton = param_tree(names)
    total = 0

    def fill(node):
        nonlocal total
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        t = stream.layout.tensor(node)
        leaf = _LazyLeaf(stream, t, _export_dtype(stream.saved_dtype(t), dtype))
        total += leaf.size * leaf.dtype.itemsize
        return leaf

    tree = fill(skeleton)
    registry = ocp.type_handlers.create_type_handler_registry((_LazyLeaf, _streaming_numpy_handler()))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)) as ckptr:
        ckptr.save(out, args=ocp.args.PyTreeSave(tree))
    return total


# ====================================================================== export


def export_checkpoint(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str = "safetensors",
    dtype: str | None = None,
    step: int | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> ExportReport:
    """Write a checkpoint's parameters as a full-shaped tree, streaming one chunk at a time.

    Args:
        path: checkpoint root (the latest step is used unless ``step``) or one step's directory.
        out: output directory; must not exist or be empty (nothing is overwritten). Written under a
            temporary name and renamed when complete.
        format: ``"orbax-params"`` or ``"safetensors"`` (see the module docstring).
        dtype: cast floating tensors to ``float32``, ``bfloat16`` or ``float16`` (default: as saved —
            fp32 masters for trainable tensors).
        max_shard_size: safetensors only: largest file (``"5GB"``, ``"500MB"`` or bytes) before the
            weights are split into shards with an index (a tensor larger than it gets a file of its own).

    Raises:
        ConfigError: unknown format or dtype, bad size, ``out`` exists and is not empty.
        CheckpointError / CheckpointFormatError: the checkpoint cannot be read (names the file or array).
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; expected one of {', '.join(FORMATS)}")
    if dtype is not None:
        dtype = canonical_dtype(dtype)
        if dtype not in EXPORT_DTYPES:
            raise ConfigError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    max_shard_bytes = parse_size(max_shard_size)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {str(out)!r} already exists and is not an empty directory; refusing to overwrite it")
    step_dir = resolve_step_dir(path, step)
    meta = read_meta(step_dir)
    stream = _ChunkStream(step_dir, meta)
    aliases = {a: t.name for t in meta.layout.tensors for a in t.aliases}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        if format == "safetensors":
            tmp.mkdir(parents=True)
            files, total = _write_safetensors(stream, tmp, dtype, max_shard_bytes)
            config = meta.model_config
            if isinstance(config, dict) and "model_type" in config:
                (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                files.append("config.json")
        else:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            total = _write_orbax_params(stream, tmp.absolute(), dtype)
            files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        stream.close()
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportReport(out, format, meta.step, len(meta.layout.tensors), total, files, aliases)


# ====================================================================== inspect


# ====================================================================== import


@dataclass
class ImportReport:
    """What :func:`load_pretrained` loaded.

    Attributes:
        missing_keys: names of the model (parameters and persistent buffers) the source lacks.
        unexpected_keys: source keys (under ``prefix``) the model does not have.
        loaded: number of tensors loaded (each tied tensor once).
    """

    missing_keys: list[str]
    unexpected_keys: list[str]
    loaded: int


class _Source:
    """Full-shaped tensors by key, read by flat element range."""

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor (1-D, its own dtype)."""
        raise NotImplementedError

    def full(self, key: str) -> torch.Tensor:
        raise NotImplementedError


class _DictSource(_Source):
    def __init__(self, sd: Mapping[str, Any], where: str):
        self.sd = {}
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                if isinstance(v, np.ndarray):
                    v = torch.from_numpy(v)
                else:
                    continue  # non-tensor entries (e.g. _metadata) are not weights
            self.sd[str(k)] = v
        self.where = where

    def keys(self):
        return list(self.sd)

    def shape(self, key):
        return tuple(self.sd[key].shape)

    def read(self, key, start, stop):
        return self.sd[key].detach().reshape(-1)[start:stop]

    def full(self, key):
        return self.sd[key].detach()


class _SafetensorsSource(_Source):
    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self.handles = {}
        self.file_of: dict[str, Path] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises SafetensorError on a bad header
                raise CheckpointError(f"cannot read safetensors file {str(f)!r}: {e}") from None
            self.handles[f] = h
            for k in h.keys():
                self.file_of[k] = f

    def keys(self):
        return list(self.file_of)

    def shape(self, key):
        return tuple(self.handles[self.file_of[key]].get_slice(key).get_shape())

    def read(self, key, start, stop):
        sl = self.handles[self.file_of[key]].get_slice(key)
        shape = tuple(sl.get_shape())
        try:
            if len(shape) <= 1:
                return sl[start:stop].reshape(-1)
            row = int(np.prod(shape[1:], dtype=np.int64))
            r0, r1 = start // row, -(-stop // row)
            rows = sl[r0:r1].reshape(-1)  # only the rows that hold [start, stop)
            return rows[start - r0 * row : stop - r0 * row]
        except Exception as e:
            raise CheckpointError(f"cannot read {key!r} from {str(self.file_of[key])!r}: {e}") from None

    def full(self, key):
        try:
            return self.handles[self.file_of[key]].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"cannot read {key!r} from {str(self.file_of[key])!r}: {e}") from None


def _open_source(source) -> _Source:
    if isinstance(source, Mapping):
        return _DictSource(source, "state dict")
    path = Path(source)
    if not path.exists():
        raise CheckpointError(f"weights path {str(path)!r} does not exist")
    if path.is_dir():
        index = path / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({path / f for f in weight_map.values()})
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"malformed safetensors index {str(index)!r}: {e}") from None
            return _SafetensorsSource(files)
        if (path / SAFE_WEIGHTS_NAME).is_file():
            return _SafetensorsSource([path / SAFE_WEIGHTS_NAME])
        for name in ("pytorch_model.bin", "model.pt"):
            if (path / name).is_file():
                return _open_source(path / name)
        raise CheckpointError(f"{str(path)!r} holds no {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME} or pytorch_model.bin")
    if path.suffix == ".safetensors":
        return _SafetensorsSource([path])
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # UnpicklingError for anything beyond plain tensors: never unpickled
        raise CheckpointError(f"cannot load {str(path)!r} as a weights-only torch state dict: {str(e).splitlines()[0]}") from None
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{str(path)!r} does not hold a state dict (got {type(sd).__name__})")
    if "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]
    return _DictSource(sd, str(path))


def load_pretrained(model, source, *, strict: bool = True, prefix: str = "") -> ImportReport:
    """Load full-shaped weights into a :class:`~torch_backend.ZeroDDP` model (every rank calls it).

    Each rank reads only the element ranges of each tensor that its shards hold (safetensors slices;
    for an in-memory state dict, slices of the given tensors) and overwrites its fp32 master shards
    (the low-precision shards are refreshed). Persistent buffers of the wrapped module are loaded whole.

    Args:
        source: a state dict (``{name: tensor}``), a ``.pt``/``.bin`` file (``torch.load`` with
            ``weights_only=True``), a ``.safetensors`` file, or a directory holding ``model.safetensors``,
            ``model.safetensors.index.json`` or ``pytorch_model.bin``.
        strict: require every parameter and buffer of the model and no other key under ``prefix``.
        prefix: only keys starting with ``prefix`` are considered, with it removed — load a sub-model
            from a bigger model's weights (``prefix="transformer."``). Keys outside it are ignored.

    A tied tensor may appear under any of its names (one suffices; the others are not unexpected).

    Returns:
        :class:`ImportReport` with the missing and unexpected keys.

    Raises:
        ShapeMismatchError: a tensor's shape differs (names the key and both shapes); nothing loaded.
        CheckpointError: with ``strict``, missing or unexpected keys (all listed); nothing loaded. An
            unreadable file (names it).
    """
    src = _open_source(source)
    keys = [k[len(prefix):] for k in src.keys() if k.startswith(prefix)]
    present = set(keys)
    layout: ChunkLayout = model.layout
    module = getattr(model, "module", model)
    chosen: dict[str, str] = {}
    missing: list[str] = []
    used: set[str] = set()
    for t in layout.tensors:
        names = [n for n in t.names if n in present]
        if not names:
            missing.extend(t.names)
            continue
        for n in names:
            got = src.shape(prefix + n)
            if tuple(got) != tuple(t.shape):
                raise ShapeMismatchError(prefix + n, t.shape, got, "model vs weights")
            used.add(n)
        chosen[t.name] = prefix + names[0]
    buffers = {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in layout}
    for k, b in buffers.items():
        if k not in present:
            missing.append(k)
            continue
        got = src.shape(prefix + k)
        if isinstance(b, torch.Tensor) and tuple(got) != tuple(b.shape):
            raise ShapeMismatchError(prefix + k, tuple(b.shape), got, "model vs weights")
        used.add(k)
    unexpected = [k for k in keys if k not in used]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {', '.join(unexpected)}")
        raise CheckpointError("cannot load weights strictly (nothing loaded): " + "; ".join(parts))

    rank = int(model.rank)
    for c in layout.chunks:
        pieces = [(t, a, b, off) for t, a, b, off in layout.shard_pieces(c.index, rank) if t.name in chosen]
        if not pieces:
            continue
        shard = model.master_shard(c.index).detach().to("cpu", torch.float32, copy=True)
        for t, a, b, off in pieces:
            shard[off : off + b - a] = src.read(chosen[t.name], a, b).to(torch.float32)
        model.load_master_shard(c.index, shard)
    with torch.no_grad():
        named = dict(module.named_buffers())
        for k in buffers:
            if k in present and k in named:
                named[k].copy_(src.full(prefix + k))
    return ImportReport(missing, unexpected, len(chosen))


def read_tensor(path: str | os.PathLike, name: str, step: int | None = None) -> torch.Tensor:
    """One full-shaped parameter of a checkpoint (reads only its chunk's range), as saved."""
    step_dir = resolve_step_dir(path, step)
    meta = read_meta(step_dir)
    t = meta.layout.tensor(name) if name in meta.layout else None
    if t is None:
        raise CheckpointError(f"no tensor {name!r} in {str(step_dir)!r}")
    reader = ChunkReader(step_dir, meta)
    return to_torch(reader.read((PARAMS_KEY, chunk_key(t.chunk)), t.offset, t.end)).reshape(t.shape)


def iter_tensors(path: str | os.PathLike, step: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, full-shaped array)`` for each tensor of a checkpoint in storage order, one chunk in memory."""
    step_dir = resolve_step_dir(path, step)
    stream = _ChunkStream(step_dir, read_meta(step_dir))
    for t in stream.ordered():
        yield t.name, stream.tensor(t)
    stream.close()
