"""Export a checkpoint's parameters as a full-shaped tree (Orbax or safetensors), streaming one chunk at a time.

:func:`export_checkpoint` (``chunkzero export``) reads the saved chunks one at a time (TensorStore reads
of the ``params`` arrays, :class:`~chunkzero.checkpoint.reader.ChunkReader`), cuts each tensor out of its
chunk, casts it if asked, writes it, and drops it — peak memory is about one chunk plus one tensor,
whatever the model's size. Numpy only: no torch, no JAX computation.

* ``orbax-params``: an Orbax PyTree checkpoint of the nested parameter tree
  (``{"transformer": {"h": {"0": {"attn": {"c_attn": {"weight": f32[...]}}}}}}``, split on ``.``), which
  ``orbax.checkpoint.StandardCheckpointer().restore(OUT)`` returns (numpy arrays, or ``jax.Array`` s with
  the shardings of an abstract target). Written through a streaming variant of Orbax's own numpy
  handler (:func:`~chunkzero.checkpoint.orbax_files.write_param_tree`), so the files are exactly what
  Orbax writes for numpy leaves.
* ``safetensors``: the Hugging Face layout: ``model.safetensors``, or above ``max_shard_size``
  ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``; ``config.json`` too when the
  checkpoint's ``model_config`` is a Hugging Face config (it has ``model_type``), so
  ``AutoModel*.from_pretrained(OUT)`` loads it. A tied tensor is written once, under its primary name
  (the first in parameter order, e.g. ``transformer.wte.weight``; Hugging Face re-ties ``lm_head``).
  The file format (8-byte header length, JSON header, raw little-endian data) is written directly so
  no tensor has to be held in memory with the others.

With ``ema=True`` the trainable tensors come from the checkpoint's EMA (the ``ema`` arrays a
``ZeroEMA`` saved) instead of the fp32 masters; frozen tensors, which have no EMA, as saved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import canonical_dtype, itemsize_bytes, numpy_dtype
from ..errors import CheckpointError, ConfigError
from ..layout import ChunkLayout, TensorSlot
from . import orbax_files, orbax_store
from .meta import EMA_KEY, PARAMS_KEY, ArrayPath, CheckpointMeta, chunk_key
from .orbax_logs import quiet_saves
from .reader import ChunkReader
from .steps import list_steps, read_meta

FORMATS = ("orbax-params", "safetensors")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_SIZE = "5GB"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "bool": "BOOL",
}

__all__ = [
    "ExportReport",
    "TensorStream",
    "export_checkpoint",
    "export_failed",
    "iter_tensors",
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
        mult = {
            "": 1,
            "K": 10**3,
            "M": 10**6,
            "G": 10**9,
            "T": 10**12,
            "KI": 2**10,
            "MI": 2**20,
            "GI": 2**30,
            "TI": 2**40,
        }[unit]
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


class TensorStream:
    """Each tensor of a checkpoint, read one chunk at a time (the only chunk held in memory).

    Args:
        step_dir: one step's directory; ``meta`` its metadata.
        ema: read the trainable chunks from the EMA arrays (frozen ones from ``params``).

    Raises:
        CheckpointError: ``ema`` and the checkpoint holds no EMA.
    """

    def __init__(self, step_dir: Path, meta: CheckpointMeta, *, ema: bool = False):
        if ema and meta.ema is None:
            raise CheckpointError(
                f"checkpoint {str(step_dir)!r} holds no EMA (saved without a ZeroEMA); export without --ema"
            )
        self.meta = meta
        self.ema = bool(ema)
        self.layout: ChunkLayout = meta.layout
        self.reader = ChunkReader(step_dir, meta)
        self._cached: tuple[int, np.ndarray] | None = None

    def array(self, index: int) -> ArrayPath:
        """The saved array chunk ``index``'s tensors are read from."""
        kind = EMA_KEY if self.ema and self.layout.chunks[index].requires_grad else PARAMS_KEY
        return (kind, chunk_key(index))

    def saved_dtype(self, t: TensorSlot) -> str:
        return self.reader.expected[self.array(t.chunk)][1]

    def chunk(self, index: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != index:
            self._cached = None  # drop the previous chunk before reading the next
            c = self.layout.chunks[index]
            self._cached = (index, self.reader.read(self.array(index), 0, c.utilized))
        return self._cached[1]

    def tensor(self, t: TensorSlot) -> np.ndarray:
        """Full-shaped view of tensor ``t`` in its chunk (valid until the next chunk is read)."""
        return self.chunk(t.chunk)[t.offset : t.end].reshape(t.shape)

    def ordered(self) -> list[TensorSlot]:
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
        ema: the trainable tensors are the EMA weights.
    """

    out: Path
    format: str
    step: int
    tensors: int
    total_bytes: int
    files: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    ema: bool = False


# ====================================================================== safetensors (streaming)


def _write_safetensors(
    stream: TensorStream, out: Path, dtype: str | None, max_shard_bytes: int
) -> tuple[list[str], int]:
    tensors = stream.ordered()
    plan: list[list[tuple[TensorSlot, str, int]]] = [[]]
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
            header[t.name] = {
                "dtype": _ST_DTYPES[out_dtype],
                "shape": list(t.shape),
                "data_offsets": [pos, pos + nbytes],
            }
            pos += nbytes
            weight_map[t.name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t, out_dtype, nbytes in entries:
                a = stream.tensor(t)
                if a.dtype != numpy_dtype(out_dtype):
                    a = a.astype(numpy_dtype(out_dtype))
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
    """A leaf of the exported tree: the tensor in ``slot`` of ``stream``, read when written (in
    storage order, so each chunk is read once)."""

    def __init__(self, stream: TensorStream, slot: TensorSlot, dtype: str):
        self.stream, self.slot = stream, slot
        self.shape = tuple(slot.shape)
        self.dtype = numpy_dtype(dtype)
        self.order = (slot.chunk, slot.offset)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def load(self) -> np.ndarray:
        a = self.stream.tensor(self.slot)
        return a.astype(self.dtype) if a.dtype != self.dtype else np.array(a)


def _write_orbax_params(stream: TensorStream, out: Path, dtype: str | None) -> int:
    total = 0

    def fill(node):
        nonlocal total
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        t = stream.layout.tensor(node)
        leaf = _LazyLeaf(stream, t, _export_dtype(stream.saved_dtype(t), dtype))
        total += leaf.size * leaf.dtype.itemsize
        return leaf

    quiet_saves()  # Orbax's save threads read the leaves: a failed read is raised once, not logged by each thread
    orbax_files.write_param_tree(out, fill(param_tree([t.name for t in stream.ordered()])), _LazyLeaf)
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
    ema: bool = False,
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
        ema: write the EMA weights (the ``ema`` arrays) for the trainable tensors, as fp32 unless ``dtype``.

    Raises:
        ConfigError: unknown format or dtype, bad size, ``out`` exists and is not empty, is inside the
            checkpoint directory (the steps' root), or cannot be created or written (nothing is left there).
        CheckpointError / CheckpointFormatError: the checkpoint cannot be read (names the file or array, and
            the ``--step`` of another committed step to export instead: :func:`export_failed`), or ``ema``
            and it holds no EMA.
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; expected one of {', '.join(FORMATS)}")
    if dtype is not None:
        dtype = canonical_dtype(dtype)
        if dtype not in EXPORT_DTYPES:
            raise ConfigError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    max_shard_bytes = parse_size(max_shard_size)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {str(out)!r} is an existing file, not a directory; refusing to overwrite it")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output {str(out)!r} already exists and is not an empty directory; refusing to overwrite it")
    step_dir = orbax_store.committed_step_dir(path, step)
    root = step_dir.resolve().parent
    if root == out.resolve() or root in out.resolve().parents:
        raise ConfigError(f"output {str(out)!r} is inside the checkpoint directory {str(root)!r}, where a run's "
                          "retention (--keep) deletes old steps with whatever is in them: export outside it")
    try:
        meta = read_meta(step_dir)
    except CheckpointError as e:
        raise export_failed(path, step_dir, e) from None
    stream = TensorStream(step_dir, meta, ema=ema)
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
    except CheckpointError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise export_failed(path, step_dir, e) from None
    except OSError as e:  # the output cannot be made or written (a file on its path, no permission, a full disk)
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"output {str(out)!r} cannot be written: {e.strerror or e} ({e.filename or tmp}); "
                          "nothing was exported") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportReport(out, format, meta.step, len(meta.layout.tensors), total, files, aliases, ema=bool(ema))


def export_failed(path: str | os.PathLike, step_dir: Path, error: CheckpointError) -> CheckpointError:
    """The error of an export whose step ``step_dir`` cannot be read (``error``: e.g. a checksum naming the
    corrupted array), of the same class, with how to export another committed step instead: ``--step`` with
    the newest older one (the newest other one when none is older), under the checkpoint root (``path`` or
    its parent)."""
    root, step = step_dir.parent, int(step_dir.name)
    others = [s for s in list_steps(root) if s != step]
    if not others:
        how = "no other committed step is saved to export instead"
    else:
        other = max([s for s in others if s < step] or others)
        how = f"to export step {other} instead, pass --step {other}"
        if Path(path).resolve() != root.resolve():
            how += f" with the checkpoint root {str(root)!r}"
    return type(error)(f"step {step} cannot be exported: {error}; {how}")


def iter_tensors(path: str | os.PathLike, step: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, full-shaped array)`` for each tensor of a checkpoint in storage order, one chunk in memory.

    Each array is a view valid until the next chunk is read (copy it to keep it); tied tensors once,
    under their primary name.

    Raises:
        CheckpointError / CheckpointFormatError: as :func:`~chunkzero.checkpoint.read_meta` and
            :class:`~chunkzero.checkpoint.reader.ChunkReader`.
    """
    step_dir = orbax_store.committed_step_dir(path, step)
    stream = TensorStream(step_dir, read_meta(step_dir))
    for t in stream.ordered():
        yield t.name, stream.tensor(t)
    stream.close()
