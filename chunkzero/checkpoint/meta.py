"""The checkpoint format's names and its metadata schema, shared by both backends (DESIGN.md §5).

One step is one standard Orbax checkpoint directory ``<root>/<step>/`` with two items:

* ``state`` — a PyTree of 1-D global arrays, each a whole chunk (padded to the chunk's size at
  save time):

  ``{"params": {"chunk_0000": f32[size], ...},                 # fp32 master chunks
     "optim": {"exp_avg": {"chunk_0000": f32[size], ...}, ...},  # one subtree per optimizer-state key
     "ema": {"chunk_0000": f32[size], ...}}                       # the EMA of the masters, when kept``

  Trainable chunks are stored as fp32 masters whatever the compute precision; frozen chunks in
  their own dtype and without optimizer state or EMA. Keep-gathered chunks are written once.
* ``meta`` — a JSON document validated by :class:`CheckpointMeta` (never unpickled). Its
  ``optimizer`` object (:class:`OptimizerMeta`) holds the optimizer class, the state keys, the step,
  the first group's and the optimizer-wide hyper-parameters (``max_norm``), and — optional fields —
  every param group's hyper-parameters with its tensors' names and the per-tensor steps that differ.
  Its optional ``ema`` object (:class:`EmaMeta`) is present exactly when the ``ema`` subtree is:
  the EMA's decay, warm-up and update count.

A plain ``orbax.checkpoint`` user restores ``state`` as numpy, or with target shardings on any
device count (padding differs between world sizes; restore with ``global_shape`` of the new size,
or slice ``[:utilized]``).

Each saved shard carries a checksum over its valid elements, and one per storage block of it
(:mod:`chunkzero.checkpoint.checksums`); :class:`CheckpointMeta` knows the saved shards' ranges
(:meth:`CheckpointMeta.saved_shards`) and blocks, builds the record and verifies against it.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import numpy_dtype
from ..errors import CheckpointError, CheckpointFormatError, ConfigError, LayoutFormatError
from ..layout import ChunkInfo, ChunkLayout
from .checksums import (
    CHECKSUM_ALGORITHM,
    block_checksums,
    checksum_key,
    combine_checksums,
    shard_checksum,
    storage_block_numel,
    validate_record,
)

ArrayPath = tuple[str, ...]
"""Path of one array in the ``state`` tree: ``("params", "chunk_0003")``, ``("optim", "exp_avg", "chunk_0003")``."""

CHECKPOINT_FORMAT = "chunkzero.checkpoint"
CHECKPOINT_VERSION = 1
STATE_ITEM = "state"
META_ITEM = "meta"
PARAMS_KEY = "params"
OPTIM_KEY = "optim"
EMA_KEY = "ema"
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


def array_name(path: ArrayPath) -> str:
    """Name of array ``path`` in messages: ``"params.chunk_0003"`` (the name Orbax gives it on disk)."""
    return ".".join(path)


def param_array_dtype(chunk: ChunkInfo) -> str:
    """Dtype a chunk's ``params`` array is saved in: fp32 master for trainable chunks, else its own."""
    return "float32" if chunk.requires_grad else chunk.dtype


@dataclass
class OptimizerMeta:
    """The optimizer part of the metadata.

    Attributes:
        class_name: fully qualified class, e.g. ``"torch.optim.AdamW"`` or ``"optax.adamw"``.
        hyperparameters: JSON-able hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay`` …) of
            the first param group, and the optimizer-wide ones (``max_norm``: global-norm clipping,
            ``None`` for none) — what a reader that knows one group uses.
        state_keys: names of per-element state arrays stored under ``optim`` (e.g. ``exp_avg``).
        step: number of optimizer steps taken (Adam's bias-correction count).
        param_groups: every param group as torch writes it, ``{hyper-parameters..., "params": [primary
            tensor names, in the group's order]}``; ``None`` (absent) in checkpoints written with one
            group of ``hyperparameters`` (before param groups, or by a writer without them).
        tensor_steps: ``{tensor name: step}`` for the tensors whose step differs from ``step`` (0: the
            tensor has no optimizer state yet — it never had a gradient, as torch keeps no state for a
            parameter whose ``grad`` was always ``None``); ``None`` (absent) when none differs.

    ``param_groups`` and ``tensor_steps`` are optional fields added without a version bump: readers
    that predate them ignore them.
    """

    class_name: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    state_keys: list[str] = field(default_factory=list)
    step: int = 0
    param_groups: list[dict[str, Any]] | None = None
    tensor_steps: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        doc = {"class_name": self.class_name, "hyperparameters": self.hyperparameters,
               "state_keys": list(self.state_keys), "step": self.step}
        if self.param_groups is not None:
            doc["param_groups"] = self.param_groups
        if self.tensor_steps is not None:
            doc["tensor_steps"] = self.tensor_steps
        return doc

    @classmethod
    def from_dict(cls, od: dict[str, Any], bad) -> OptimizerMeta:
        """Parse the ``optimizer`` object; ``bad(field, why)`` builds the error to raise."""
        for key, kinds in (("class_name", str), ("hyperparameters", dict), ("state_keys", list), ("step", int)):
            if key not in od or not isinstance(od[key], kinds) or isinstance(od[key], bool):
                raise bad(f"optimizer.{key}", f"missing or not {kinds.__name__}")
        if not all(isinstance(k, str) for k in od["state_keys"]):
            raise bad("optimizer.state_keys", "must be a list of strings")
        groups = od.get("param_groups")
        if groups is not None:
            if not isinstance(groups, list) or not groups:
                raise bad("optimizer.param_groups", "must be a non-empty list of objects")
            for i, g in enumerate(groups):
                if not isinstance(g, dict) or not isinstance(g.get("params"), list) \
                        or not all(isinstance(n, str) for n in g["params"]):
                    raise bad(f"optimizer.param_groups[{i}]", "must be an object with 'params': a list of tensor names")
        steps = od.get("tensor_steps")
        if steps is not None and (not isinstance(steps, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in steps.values())):
            raise bad("optimizer.tensor_steps", "must map tensor names to steps (ints >= 0)")
        return cls(od["class_name"], od["hyperparameters"], list(od["state_keys"]), od["step"],
                   None if groups is None else [dict(g) for g in groups], None if steps is None else dict(steps))


def check_ema_decay(decay: Any, what: str = "EMA decay") -> float:
    """``decay`` as a float in ``[0, 1)``, the EMA decay of either engine (``ZeroEMA``, ``ChunkEMA``, the
    Lightning callback).

    Raises:
        ConfigError: anything else (names ``what`` and the value).
    """
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= float(decay) < 1.0:
        raise ConfigError(f"{what} must be a number in [0, 1), got {decay!r}")
    return float(decay)


def ema_decay_at(decay: float, update_count: int, warmup: bool) -> float:
    """The decay of the EMA update after ``update_count`` updates: ``decay``, or with ``warmup``
    ``min(decay, (1 + n) / (10 + n))`` (TensorFlow's ``ExponentialMovingAverage(num_updates=)``)."""
    n = update_count
    return min(decay, (1.0 + n) / (10.0 + n)) if warmup else decay


@dataclass
class EmaMeta:
    """The EMA part of the metadata (its shards are the ``ema`` subtree, one fp32 array per trainable chunk).

    Attributes:
        decay: the EMA decay in ``[0, 1)``: ``ema = decay * ema + (1 - decay) * master`` per update.
        update_count: updates applied (after each applied optimizer step).
        warmup: whether the update's decay is ``min(decay, (1 + n) / (10 + n))`` for ``n`` = the updates before it.

    An optional field of the metadata added without a version bump: readers that predate it ignore it
    (and the ``ema`` subtree).
    """

    decay: float
    update_count: int = 0
    warmup: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "update_count": self.update_count, "warmup": self.warmup}

    @classmethod
    def from_dict(cls, doc: Any, bad) -> EmaMeta:
        """Parse the ``ema`` object; ``bad(field, why)`` builds the error to raise."""
        if not isinstance(doc, dict):
            raise bad("ema", "must be an object")
        decay = doc.get("decay")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise bad("ema.decay", f"must be a number in [0, 1), got {decay!r}")
        count = doc.get("update_count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise bad("ema.update_count", f"must be an int >= 0, got {count!r}")
        warmup = doc.get("warmup", False)
        if not isinstance(warmup, bool):
            raise bad("ema.warmup", f"must be a bool, got {warmup!r}")
        return cls(float(decay), count, warmup)


@dataclass
class CheckpointMeta:
    """Everything in a checkpoint besides the chunk arrays.

    Attributes:
        step: training step of the checkpoint.
        layout: the :class:`ChunkLayout` at save time (its ``world_size`` is the saving world size; under
            hybrid sharding the shard group's size ``S``, each shard saved once).
        mixed_precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        optimizer: :class:`OptimizerMeta`, or ``None`` for a parameters-only checkpoint.
        loss_scaler: dynamic loss-scaler state (``scale``, ``growth_tracker``, ``hysteresis_tracker`` …).
        model_config: JSON-able model configuration, to rebuild the model.
        data_position: JSON-able data-loader position, to resume the data stream.
        rng_states: one JSON-able RNG-state dict per saving rank (or ``None``).
        extra: anything else the caller passed (JSON-able).
        ema: :class:`EmaMeta` when the checkpoint holds an EMA (the ``ema`` arrays), else ``None``
            (serialized only when present).
        checksums: optional integrity record of the ``state`` arrays, written at save by both backends:
            ``{"algorithm": "sum64+xor64", "arrays": {"params/chunk_0000": [hex per saving rank], ...},
            "blocks": {"params/chunk_0000": {"block_numel": n, "sums": [[hex per block] per saving rank]}}}``
            — one entry per saved shard (one for a keep-gathered chunk), computed over the shard's
            valid (unpadded) elements, and one per storage block of it (``blocks``: optional, absent in
            checkpoints written before it); see :mod:`chunkzero.checkpoint.checksums`,
            :meth:`verify_shard` and :meth:`verify_blocks`. Absent (``None``) in checkpoints written
            without it; readers then skip verification. Serialized only when present.
        replicas: how many copies of each shard the saving run held (hybrid sharding: ``R`` shard groups
            of ``layout.world_size`` ranks, ``rng_states`` then has one entry per rank of all
            ``world_size · replicas``); 1 for flat ZeRO-3. Serialized only when above 1; readers need
            not know it (the arrays are the same at any ``replicas``).
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
    ema: EmaMeta | None = None
    replicas: int = 1

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
            "optimizer": None if self.optimizer is None else self.optimizer.to_dict(),
            "loss_scaler": self.loss_scaler,
            "model_config": self.model_config,
            "data_position": self.data_position,
            "rng_states": self.rng_states,
            "extra": self.extra,
        }
        if self.checksums is not None:
            doc["checksums"] = self.checksums
        if self.ema is not None:
            doc["ema"] = self.ema.to_dict()
        if self.replicas != 1:
            doc["replicas"] = self.replicas
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
            raise bad(
                "version", f"version {version} is not supported (this chunkzero reads up to {CHECKPOINT_VERSION})"
            )
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
            optimizer = OptimizerMeta.from_dict(od, bad)
        replicas = doc.get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise bad("replicas", f"expected an int >= 1, got {replicas!r}")
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
            checksums=validate_record(doc.get("checksums"), _valid_numels(layout), bad),
            ema=None if doc.get("ema") is None else EmaMeta.from_dict(doc["ema"], bad),
            replicas=replicas,
        )

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "meta") -> CheckpointMeta:
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointFormatError(f"{source}: not valid JSON ({e})") from None
        return cls.from_dict(doc, source=source)

    def expected_arrays(self) -> dict[ArrayPath, tuple[tuple[int, ...], str]]:
        """Every array the ``state`` item must hold: ``path -> (global shape, dtype)``.

        Paths are tuples of tree keys, e.g. ``("params", "chunk_0003")``,
        ``("optim", "exp_avg", "chunk_0003")`` or ``("ema", "chunk_0003")``.
        """
        out: dict[ArrayPath, tuple[tuple[int, ...], str]] = {}
        for c in self.layout.chunks:
            out[(PARAMS_KEY, chunk_key(c.index))] = ((c.size,), param_array_dtype(c))
        if self.optimizer is not None:
            for key in self.optimizer.state_keys:
                for c in self.layout.chunks:
                    if c.requires_grad:
                        out[(OPTIM_KEY, key, chunk_key(c.index))] = ((c.size,), "float32")
        if self.ema is not None:
            for c in self.layout.chunks:
                if c.requires_grad:
                    out[(EMA_KEY, chunk_key(c.index))] = ((c.size,), "float32")
        return out

    # ------------------------------------------------------------------ the saved arrays
    def check_saved_arrays(self, saved: Mapping[ArrayPath, tuple[tuple[int, ...], str] | None], *, source: str,
                           with_optimizer: bool = True, with_ema: bool = True) -> None:
        """Check that the ``state`` item holds every array this metadata promises.

        Args:
            saved: the arrays on disk, ``path -> (global shape, dtype)``, or ``-> None`` where only
                their presence is known (shapes are then checked when the arrays are opened).
            source: the file or directory the listing came from, for messages.
            with_optimizer: also require the optimizer-state arrays.
            with_ema: also require the EMA arrays (when the metadata lists an EMA).

        Raises:
            CheckpointFormatError: the first missing array (and how many are), or an array whose
                shape or dtype differs (names ``source``, the array, and both).
        """
        wanted = {p: v for p, v in self.expected_arrays().items()
                  if p[0] == PARAMS_KEY or (with_optimizer and p[0] == OPTIM_KEY) or (with_ema and p[0] == EMA_KEY)}
        missing = [p for p in wanted if p not in saved]
        if missing:
            more = f" ({len(missing)} missing)" if len(missing) > 1 else ""
            raise CheckpointFormatError(
                f"{source}: array {array_name(missing[0])!r} listed by the checkpoint metadata is not saved{more}"
            )
        for path, (shape, dtype) in wanted.items():
            got = saved[path]
            if got is not None and (tuple(got[0]), str(got[1])) != (tuple(shape), dtype):
                raise CheckpointFormatError(
                    f"{source}: array {array_name(path)!r} is {got[1]}{list(got[0])}, the metadata's layout says "
                    f"{dtype}{list(shape)}"
                )

    def saved_shards(self, path: ArrayPath) -> list[tuple[int, int, int]]:
        """``(saving rank, start, stop)``: the valid element range of each saved shard of array ``path``
        (chunk coordinates, padding excluded; one range for a keep-gathered chunk, which is saved once)
        — the unit a checksum covers and a storage read decodes."""
        layout, chunk = self.layout, chunk_index(path[-1])
        if layout.chunks[chunk].keep_gathered:
            return [(0, 0, layout.chunks[chunk].utilized)]
        starts = [layout.shard_range(chunk, q)[0] for q in range(layout.world_size)]
        return [(q, a, a + layout.valid_length(chunk, q)) for q, a in enumerate(starts)]

    def storage_block_numel(self, path: ArrayPath) -> int:
        """Elements per storage block of array ``path``: a divisor of the elements each saving rank
        writes (:func:`~chunkzero.checkpoint.checksums.storage_block_numel`); the unit of its block
        checksums and of the storage chunks the writer asks Orbax for."""
        chunk = chunk_index(path[-1])
        dtype = "float32" if path[0] in (OPTIM_KEY, EMA_KEY) else param_array_dtype(self.layout.chunks[chunk])
        return storage_block_numel(self.layout.shard_numel(chunk), numpy_dtype(dtype).itemsize)

    # ------------------------------------------------------------------ checksums
    def shard_checksums(self, rank: int, shards: Mapping[ArrayPath, Any]) -> dict[str, list[str]]:
        """This saving rank's part of the record: ``checksum_key(path) -> block checksums`` of the valid
        elements of each of its shards (``path -> 1-D array``: the rank's shard, a keep-gathered chunk
        whole), in blocks of :meth:`storage_block_numel`."""
        return {checksum_key(p): block_checksums(np.asarray(a)[: self.layout.valid_length(chunk_index(p[-1]), rank)],
                                                 self.storage_block_numel(p))
                for p, a in shards.items()}

    def checksums_from_ranks(self, per_rank: Sequence[Mapping[str, list[str]]]) -> dict[str, Any]:
        """The ``checksums`` record from every saving rank's :meth:`shard_checksums`, in rank order
        (a keep-gathered chunk's entry from rank 0): block checksums, and each shard's combined.

        Raises:
            CheckpointError: a rank sent no checksum for an array (the ranks disagree on what they save).
        """
        blocks: dict[str, list[list[str]]] = {}
        for path in self.expected_arrays():
            key = checksum_key(path)
            ranks = [0] if self.layout.chunks[chunk_index(path[-1])].keep_gathered else range(len(per_rank))
            for q in ranks:
                if key not in per_rank[q]:
                    raise CheckpointError(
                        f"rank {q} computed no checksum for array {array_name(path)!r}; the ranks disagree on what "
                        "they save"
                    )
            blocks[key] = [list(per_rank[q][key]) for q in ranks]
        return self.record_of_blocks(blocks)

    def checksums_of_arrays(self, arrays: Mapping[ArrayPath, Any]) -> dict[str, Any]:
        """The ``checksums`` record of whole arrays (``path -> 1-D host array`` at this layout's world
        size): the block checksums of each saved shard's range, and each shard's combined."""
        return self.record_of_blocks({checksum_key(p): [block_checksums(np.asarray(a)[s:e], self.storage_block_numel(p))
                                               for _, s, e in self.saved_shards(p)] for p, a in arrays.items()})

    def record_of_blocks(self, blocks: Mapping[str, list[list[str]]]) -> dict[str, Any]:
        numel = {k: self.storage_block_numel(tuple(k.split("/"))) for k in blocks}  # k: checksum_key(path)
        return {
            "algorithm": CHECKSUM_ALGORITHM,
            "arrays": {k: [combine_checksums(b) for b in per_shard] for k, per_shard in blocks.items()},
            "blocks": {
                k: {"block_numel": numel[k], "sums": [list(b) for b in per_shard]} for k, per_shard in blocks.items()
            },
        }

    def verification_unit(self, path: ArrayPath) -> int | None:
        """The elements one checksum of array ``path`` covers, counted from each saved shard's start:
        its recorded block (``checksums["blocks"]``), or ``0`` when only whole shards have checksums
        (checkpoints written before blocks), or ``None`` when the checkpoint has no checksums."""
        if self.checksums is None:
            return None
        entry = (self.checksums.get("blocks") or {}).get(checksum_key(path))
        return 0 if entry is None else int(entry["block_numel"])

    def verify_blocks(self, path: ArrayPath, rank: int, start: int, data: Any, *, step_dir: str | Path) -> bool:
        """Check elements ``[start, start + len(data))`` of array ``path``, read back, against the
        checksums of saved shard ``rank``: the range must be whole verification units of that shard
        (:meth:`verification_unit`; the last one may end at the shard's valid end), or the whole shard.

        Returns:
            ``False`` when the checkpoint has no checksums (nothing verified), else ``True``.

        Raises:
            CheckpointFormatError: the checkpoint has checksums but none for ``path``.
            CheckpointError: a checksum differs (names the array, the directory, the saving rank and the
                element range), or the range is not made of whole units (a reader's bug).
        """
        unit = self.verification_unit(path)
        if unit is None:
            return False
        _, a, e = self.saved_shards(path)[rank]
        data = np.asarray(data)
        stop = start + data.size
        if unit == 0 and (start, stop) == (a, e):
            return self.verify_shard(path, rank, data, step_dir=step_dir)
        if unit == 0 or start < a or stop > e or (start - a) % unit or ((stop - a) % unit and stop != e):
            raise CheckpointError(f"elements [{start}, {stop}) of {array_name(path)!r} are not whole checksum units "
                                  f"({unit or 'the whole shard'}) of the shard saved by rank {rank}, [{a}, {e})")
        sums = self.checksums["blocks"][checksum_key(path)]["sums"][rank]
        first = (start - a) // unit
        for k, got in enumerate(block_checksums(data, unit)):
            if got != sums[first + k]:
                lo = start + k * unit
                self.raise_corrupted(path, rank, lo, min(lo + unit, e), got, sums[first + k], step_dir)
        return True

    def verify_shard(self, path: ArrayPath, rank: int, data: Any, *, step_dir: str | Path) -> bool:
        """Check saved shard ``rank`` of array ``path`` against the recorded checksum.

        Args:
            data: the shard's valid elements (:meth:`saved_shards` gives their range), as read back.
            step_dir: the step's directory, for messages.

        Returns:
            ``False`` when the checkpoint has no checksums (nothing verified), else ``True``.

        Raises:
            CheckpointFormatError: the checkpoint has checksums but none for ``path``.
            CheckpointError: the checksum differs (names the array, the directory, the saving rank
                and the element range).
        """
        if self.checksums is None:
            return False
        sums = self.checksums["arrays"].get(checksum_key(path))
        if sums is None:
            raise CheckpointFormatError(f"{Path(step_dir) / META_ITEM}: no checksum for array {array_name(path)!r}")
        got = shard_checksum(data)
        if got != sums[rank]:
            _, start, stop = self.saved_shards(path)[rank]
            self.raise_corrupted(path, rank, start, stop, got, sums[rank], step_dir)
        return True

    def warn_if_unverified(self, step_dir: str | Path) -> bool:
        """Warn (once, :class:`UnverifiedCheckpointWarning`) that the data of ``step_dir`` cannot be verified
        when the checkpoint records no checksums (written by a multi-process JAX run before they were
        recorded at every process count, or by hand). Returns whether it warned."""
        if self.checksums is not None:
            return False
        warnings.warn(
            f"{step_dir}: this checkpoint records no checksums (written before they were recorded at every "
            "process count, or saved without them), so its data is loaded unverified",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )
        return True

    def raise_corrupted(self, path: ArrayPath, rank: int, start: int, stop: int, got: str, want: str, step_dir) -> None:
        raise CheckpointError(
            f"array {array_name(path)!r} in {str(Path(step_dir) / STATE_ITEM)!r} is corrupted: elements [{start}, "
            f"{stop}) "
            f"saved by rank {rank} have checksum {got}, the metadata recorded {want}"
        )


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint's data is loaded without checksums to verify it against."""


def _valid_numels(layout: ChunkLayout) -> dict[str, tuple[int, ...]]:
    """``chunk key -> valid numel of each saved shard`` (one for a keep-gathered chunk)."""
    return {chunk_key(c.index): (c.utilized,) if c.keep_gathered else
            tuple(layout.valid_length(c.index, q) for q in range(layout.world_size)) for c in layout.chunks}


def _tuple(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _kind_names(kinds) -> str:
    return " or ".join(k.__name__ for k in _tuple(kinds))
