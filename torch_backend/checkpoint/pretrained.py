"""Import full-shaped weights into a ZeroDDP model: a torch state dict, a ``.pt``/``.bin`` file
(``torch.load(weights_only=True)``), a ``.safetensors`` file or a Hugging Face directory. Each rank
reads only the element ranges its shards hold. Nothing here unpickles.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chunkzero.checkpoint import is_step_dir, latest_step, matching_names
from chunkzero.checkpoint.export import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from chunkzero.errors import CheckpointError, ShapeMismatchError
from chunkzero.layout import ChunkLayout

__all__ = ["ImportReport", "load_pretrained"]


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
            except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError on a bad header
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
        except Exception as e:  # noqa: BLE001 - re-raised as CheckpointError
            raise CheckpointError(f"cannot read {key!r} from {str(self.file_of[key])!r}: {e}") from None

    def full(self, key):
        try:
            return self.handles[self.file_of[key]].get_tensor(key)
        except Exception as e:  # noqa: BLE001 - re-raised as CheckpointError
            raise CheckpointError(f"cannot read {key!r} from {str(self.file_of[key])!r}: {e}") from None


def _is_chunkzero_checkpoint(path: Path) -> bool:
    """A chunkzero checkpoint root (``runs/ckpt``) or one of its step directories."""
    return path.is_dir() and (is_step_dir(path) or latest_step(path) is not None)


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
        raise CheckpointError(
            f"{str(path)!r} holds no {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME} or pytorch_model.bin"
        )
    if path.suffix == ".safetensors":
        return _SafetensorsSource([path])
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError for anything beyond plain tensors: never unpickled
        raise CheckpointError(
            f"cannot load {str(path)!r} as a weights-only torch state dict: {str(e).splitlines()[0]}"
        ) from None
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
            ``weights_only=True``), a ``.safetensors`` file, a directory holding ``model.safetensors``,
            ``model.safetensors.index.json`` or ``pytorch_model.bin``, or a chunkzero checkpoint (a
            root or one step's directory, of any world size: its parameters only, as
            :func:`~torch_backend.load_checkpoint` reads them; ``prefix`` does not apply).
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
    if not isinstance(source, Mapping) and not prefix and _is_chunkzero_checkpoint(Path(source)):
        from .sharded import load_checkpoint

        meta = load_checkpoint(source, model, load_rng=False)  # streams each saved shard into the owners
        return ImportReport([], [], len(meta.layout.tensors))
    src = _open_source(source)
    keys = [k[len(prefix):] for k in src.keys() if k.startswith(prefix)]
    present = set(keys)
    layout: ChunkLayout = model.layout
    module = getattr(model, "module", model)
    chosen: dict[str, str] = {}
    missing: list[str] = []
    used: set[str] = set()
    for t in layout.tensors:
        names = matching_names(t, present)
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

    rank = int(getattr(model, "shard_rank", model.rank))  # the layout's rank (hybrid: in the shard group)
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
