"""The checkpoint metadata schema shared by both backends (DESIGN.md §5).

One step is one standard Orbax checkpoint directory ``<root>/<step>/`` with two items:

* ``state`` — a PyTree of 1-D global arrays, each a whole chunk (padded to the chunk's size at
  save time):

  ``{"params": {"chunk_0000": f32[size], ...},                 # fp32 master chunks
     "optim": {"exp_avg": {"chunk_0000": f32[size], ...}, ...}}  # one subtree per optimizer-state key``

  Trainable chunks are stored as fp32 masters whatever the compute precision; frozen chunks in
  their own dtype and without optimizer state. Keep-gathered chunks are written once.
* ``meta`` — a JSON document validated by :class:`CheckpointMeta` (never unpickled).

A plain ``orbax.checkpoint`` user restores ``state`` as numpy, or with target shardings on any
device count (padding differs between world sizes; restore with ``global_shape`` of the new size,
or slice ``[:utilized]``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, CheckpointFormatError, ConfigError, LayoutFormatError
from .layout import ChunkInfo, ChunkLayout

CHECKPOINT_FORMAT = "chunkzero.checkpoint"
CHECKPOINT_VERSION = 1
STATE_ITEM = "state"
META_ITEM = "meta"
PARAMS_KEY = "params"
OPTIM_KEY = "optim"
MIXED_PRECISIONS = ("fp32", "bf16", "fp16")
META_FILENAME = "metadata"
"""File of the ``meta`` item inside a step directory (Orbax's JSON handler names it so)."""

_CHUNK_KEY = re.compile(r"^chunk_(\d{4,})$")


def chunk_key(index: int) -> str:
    """Key of chunk ``index`` in the ``state`` tree: ``chunk_0000``, ``chunk_0001`` …"""
    return f"chunk_{index:04d}"


def chunk_index(key: str) -> int:
    """Inverse of :func:`chunk_key`.

    Raises:
        CheckpointFormatError: ``key`` is not a chunk key.
    """
    m = _CHUNK_KEY.match(key)
    if not m:
        raise CheckpointFormatError(f"{key!r} is not a chunk key (expected chunk_NNNN)")
    return int(m.group(1))


def param_array_dtype(chunk: ChunkInfo) -> str:
    """Dtype a chunk's ``params`` array is saved in: fp32 master for trainable chunks, else its own."""
    return "float32" if chunk.requires_grad else chunk.dtype


@dataclass
class OptimizerMeta:
    """The optimizer part of the metadata.

    Attributes:
        class_name: fully qualified class, e.g. ``"torch.optim.AdamW"`` or ``"optax.adamw"``.
        hyperparameters: JSON-able hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay`` …).
        state_keys: names of per-element state arrays stored under ``optim`` (e.g. ``exp_avg``).
        step: number of optimizer steps taken (Adam's bias-correction count).
    """

    class_name: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    state_keys: list[str] = field(default_factory=list)
    step: int = 0


@dataclass
class CheckpointMeta:
    """Everything in a checkpoint besides the chunk arrays.

    Attributes:
        step: training step of the checkpoint.
        layout: the :class:`ChunkLayout` at save time (its ``world_size`` is the saving world size).
        mixed_precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        optimizer: :class:`OptimizerMeta`, or ``None`` for a parameters-only checkpoint.
        loss_scaler: dynamic loss-scaler state (``scale``, ``growth_tracker``, ``hysteresis_tracker`` …).
        model_config: JSON-able model configuration, to rebuild the model.
        data_position: JSON-able data-loader position, to resume the data stream.
        rng_states: one JSON-able RNG-state dict per saving rank (or ``None``).
        extra: anything else the caller passed (JSON-able).
        checksums: optional integrity record of the ``state`` arrays, written by the torch backend:
            ``{"algorithm": "sum64+xor64", "arrays": {"params/chunk_0000": [hex per saving rank], ...}}``
            — one entry per saved shard (one for a keep-gathered chunk), computed over the shard's
            valid (unpadded) elements; see :func:`shard_checksum`. Absent (``None``) in checkpoints
            written without it; readers then skip verification. Serialized only when present.
    """

    step: int
    layout: ChunkLayout
    mixed_precision: str = "fp32"
    optimizer: OptimizerMeta | None = None
    loss_scaler: dict[str, Any] | None = None
    model_config: dict[str, Any] | None = None
    data_position: dict[str, Any] | None = None
    rng_states: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None
    checksums: dict[str, Any] | None = None

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def to_dict(self) -> dict[str, Any]:
        doc = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "mixed_precision": self.mixed_precision,
            "layout": self.layout.to_dict(),
            "optimizer": None
            if self.optimizer is None
            else {
                "class_name": self.optimizer.class_name,
                "hyperparameters": self.optimizer.hyperparameters,
                "state_keys": list(self.optimizer.state_keys),
                "step": self.optimizer.step,
            },
            "loss_scaler": self.loss_scaler,
            "model_config": self.model_config,
            "data_position": self.data_position,
            "rng_states": self.rng_states,
            "extra": self.extra,
        }
        if self.checksums is not None:
            doc["checksums"] = self.checksums
        return doc

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = "meta") -> CheckpointMeta:
        """Validate and parse a metadata document.

        Args:
            source: where the document came from (a file path), used in error messages.

        Raises:
            CheckpointFormatError: a field is missing, mistyped or inconsistent, or the version is
                newer than this chunkzero reads; the message names ``source`` and the field.
        """

        def bad(name: str, why: str) -> CheckpointFormatError:
            return CheckpointFormatError(f"{source}: field {name!r}: {why}")

        if not isinstance(doc, dict):
            raise bad("<document>", f"expected an object, got {type(doc).__name__}")

        def get(name: str, kinds, optional: bool = False):
            if name not in doc:
                raise bad(name, "missing")
            value = doc[name]
            if value is None and optional:
                return None
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
                raise bad(name, f"expected {_kind_names(kinds)}, got {type(value).__name__}")
            return value

        if get("format", str) != CHECKPOINT_FORMAT:
            raise bad("format", f"expected {CHECKPOINT_FORMAT!r}, got {doc['format']!r}")
        version = get("version", int)
        if not 1 <= version <= CHECKPOINT_VERSION:
            raise bad("version", f"version {version} is not supported (this chunkzero reads up to {CHECKPOINT_VERSION})")
        step = get("step", int)
        if step < 0:
            raise bad("step", f"must be >= 0, got {step}")
        try:
            layout = ChunkLayout.from_dict(get("layout", dict))
        except LayoutFormatError as e:
            raise bad(f"layout.{e.field}", str(e)) from None
        if get("world_size", int) != layout.world_size:
            raise bad("world_size", f"{doc['world_size']} differs from the layout's world size {layout.world_size}")
        mp = get("mixed_precision", str)
        if mp not in MIXED_PRECISIONS:
            raise bad("mixed_precision", f"expected one of {MIXED_PRECISIONS}, got {mp!r}")
        optimizer = None
        od = get("optimizer", dict, optional=True)
        if od is not None:
            for key, kinds in (("class_name", str), ("hyperparameters", dict), ("state_keys", list), ("step", int)):
                if key not in od or not isinstance(od[key], kinds) or isinstance(od[key], bool):
                    raise bad(f"optimizer.{key}", f"missing or not {kinds.__name__}")
            if not all(isinstance(k, str) for k in od["state_keys"]):
                raise bad("optimizer.state_keys", "must be a list of strings")
            optimizer = OptimizerMeta(od["class_name"], od["hyperparameters"], list(od["state_keys"]), od["step"])
        rng = get("rng_states", list, optional=True)
        if rng is not None and not all(isinstance(r, dict) for r in rng):
            raise bad("rng_states", "must be a list of objects, one per rank")
        return cls(
            step=step,
            layout=layout,
            mixed_precision=mp,
            optimizer=optimizer,
            loss_scaler=get("loss_scaler", dict, optional=True),
            model_config=get("model_config", dict, optional=True),
            data_position=get("data_position", dict, optional=True),
            rng_states=rng,
            extra=get("extra", dict, optional=True),
            checksums=_checksums(doc, layout, bad),
        )

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "meta") -> CheckpointMeta:
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointFormatError(f"{source}: not valid JSON ({e})") from None
        return cls.from_dict(doc, source=source)

    def expected_arrays(self) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
        """Every array the ``state`` item must hold: ``path -> (global shape, dtype)``.

        Paths are tuples of tree keys, e.g. ``("params", "chunk_0003")`` or
        ``("optim", "exp_avg", "chunk_0003")``.
        """
        out: dict[tuple[str, ...], tuple[tuple[int, ...], str]] = {}
        for c in self.layout.chunks:
            out[(PARAMS_KEY, chunk_key(c.index))] = ((c.size,), param_array_dtype(c))
        if self.optimizer is not None:
            for key in self.optimizer.state_keys:
                for c in self.layout.chunks:
                    if c.requires_grad:
                        out[(OPTIM_KEY, key, chunk_key(c.index))] = ((c.size,), "float32")
        return out


CHECKSUM_ALGORITHM = "sum64+xor64"


def shard_checksum(data: Any) -> str:
    """Checksum of one saved shard's valid elements (any numpy array; its raw little-endian bytes).

    The bytes, zero-padded to a multiple of 8, are read as little-endian uint64 words; the result is
    the 16-hex-digit wrapping sum of the words followed by the 16-hex-digit XOR of the words. Cheap
    (one pass at memory speed) and it changes with any single-bit or single-word corruption.
    """
    import numpy as np

    b = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    n8 = b.size - b.size % 8
    words = b[:n8].view("<u8")
    total = int(words.sum(dtype=np.uint64)) if words.size else 0
    xor = int(np.bitwise_xor.reduce(words)) if words.size else 0
    if n8 < b.size:
        tail = int.from_bytes(bytes(b[n8:]) + bytes(8 - (b.size - n8)), "little")
        total, xor = (total + tail) % 2**64, xor ^ tail
    return f"{total:016x}{xor:016x}"


def checksum_key(path: tuple[str, ...]) -> str:
    """Key of array ``path`` in ``checksums["arrays"]``: ``"params/chunk_0000"``."""
    return "/".join(path)


def _checksums(doc: dict, layout: ChunkLayout, bad) -> dict[str, Any] | None:
    value = doc.get("checksums")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("algorithm") != CHECKSUM_ALGORITHM or not isinstance(value.get("arrays"), dict):
        raise bad("checksums", f"expected {{'algorithm': {CHECKSUM_ALGORITHM!r}, 'arrays': {{...}}}}")
    for key, sums in value["arrays"].items():
        if not isinstance(sums, list) or not all(isinstance(x, str) and re.fullmatch(r"[0-9a-f]{32}", x) for x in sums):
            raise bad(f"checksums.arrays.{key}", "expected a list of 32-hex-digit strings")
        try:
            c = layout.chunks[chunk_index(key.rsplit("/", 1)[-1])]
        except (CheckpointFormatError, IndexError):
            raise bad(f"checksums.arrays.{key}", "does not name a chunk of the layout") from None
        want = 1 if c.keep_gathered else layout.world_size
        if len(sums) != want:
            raise bad(f"checksums.arrays.{key}", f"expected {want} checksums (one per saved shard), got {len(sums)}")
    return value


def _tuple(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _kind_names(kinds) -> str:
    return " or ".join(k.__name__ for k in _tuple(kinds))


# ---------------------------------------------------------------------------- steps on disk
# Plain file-system reads (no Orbax, no cross-process sync), so any single process may call them.
# Orbax writes a step under a temporary name and renames it to ``<step>`` when the save commits,
# so only all-digit directory names holding both items are committed steps.


def is_step_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one committed step directory (``<root>/<int>/`` with both items)."""
    p = Path(path)
    return p.name.isdigit() and (p / META_ITEM).is_dir() and (p / STATE_ITEM).is_dir()


def list_steps(root: str | os.PathLike) -> list[int]:
    """Committed steps under ``root``, ascending (``[]`` if ``root`` does not exist); a save that died
    midway is not listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if is_step_dir(p))


def latest_step(root: str | os.PathLike) -> int | None:
    """The highest committed step under ``root``, or ``None`` if there is none."""
    steps = list_steps(root)
    return steps[-1] if steps else None


def resolve_step_dir(path: str | os.PathLike, step: int | None = None) -> Path:
    """The directory of one committed step.

    Args:
        path: a checkpoint root (``runs/ckpt``) or one step's directory (``runs/ckpt/100``).
        step: the step under a root; ``None`` means the latest (or ``path`` itself if it is a step).

    Raises:
        CheckpointError: the path does not exist, holds no committed step, or not ``step`` (the
            message lists the steps it does hold).
        ConfigError: ``step`` is not an int, or contradicts the step directory given.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ConfigError(f"step must be an int, got {step!r}")
    if is_step_dir(path):
        if step is not None and step != int(path.name):
            raise ConfigError(f"step={step} but {str(path)!r} is the directory of step {path.name}")
        return path
    steps = list_steps(path)
    if not steps:
        raise CheckpointError(
            f"no committed checkpoint step under {str(path)!r} (expected <root>/<step>/ with {STATE_ITEM!r} and {META_ITEM!r})"
        )
    if step is None:
        step = steps[-1]
    if step not in steps:
        held = ", ".join(map(str, steps))
        raise CheckpointError(f"no committed step {step} under {str(path)!r} (steps held: {held})")
    return path / str(step)


def read_meta(path: str | os.PathLike, step: int | None = None) -> CheckpointMeta:
    """Read and validate a step's ``meta`` item without touching its arrays (never unpickles).

    Args:
        path, step: as :func:`resolve_step_dir`.

    Raises:
        CheckpointError: no such step, or the meta file is missing.
        CheckpointFormatError: the file is not valid JSON or does not match the schema, or its step
            differs from the directory's (names the file and the field).
    """
    step_dir = resolve_step_dir(path, step)
    meta_file = step_dir / META_ITEM / META_FILENAME
    try:
        text = meta_file.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint metadata {str(meta_file)!r} is missing") from None
    meta = CheckpointMeta.from_json(text, source=str(meta_file))
    if int(step_dir.name) != meta.step:
        raise CheckpointFormatError(f"{meta_file}: field 'step': {meta.step} differs from the directory's step {step_dir.name}")
    return meta
