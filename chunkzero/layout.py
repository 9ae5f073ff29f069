"""The chunk layout: how tensors are packed into chunks and how chunks are sharded over ranks.

This is the single source of truth shared by the torch backend, the JAX backend and the
checkpoint format (DESIGN.md §3). It is plain data: build it from an ordered list of
:class:`TensorSpec`, a chunk size in elements and a world size, serialize it to JSON, and ask it
where any tensor's bytes live on any rank.

Packing follows ColossalAI Gemini's ``ChunkManager`` (greedy, in parameter order, a tensor never
straddles two chunks, a tensor larger than the chunk size gets a chunk of its own), with one
difference: a chunk's size is its utilized numel rounded up to a multiple of the world size, so
padding is below ``world_size`` elements per sharded chunk instead of the chunk's free tail.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .dtypes import canonical_dtype, itemsize_bytes
from .errors import ConfigError, LayoutError, LayoutFormatError, LayoutVersionError

SHARD_AXIS, REPLICA_AXIS = "shard", "replica"
"""The mesh axis names every chunk array is laid out on, in both backends: a chunk's shards along
``"shard"`` (the ranks of a shard group: the whole world when sharding is flat), replicas of a hybrid
shard group along ``"replica"``."""

LAYOUT_FORMAT = "chunkzero.ChunkLayout"
LAYOUT_VERSION = 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to be packed.

    Attributes:
        name: the tensor's primary name (e.g. ``"transformer.wte.weight"``).
        shape: full shape; ``numel`` is its product (a 0-d tensor has numel 1).
        dtype: canonical dtype name (``"float32"``, ``"bfloat16"``, ``"float16"`` …).
        aliases: other names of the same storage (tied weights); stored once, all names recorded.
        requires_grad: ``False`` for frozen tensors, which are packed apart and never reduced.
        keep_gathered: pack into a keep-gathered (never sharded, all-reduced) chunk.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    aliases: tuple[str, ...] = ()
    requires_grad: bool = True
    keep_gathered: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"tensor spec name must be a non-empty string, got {self.name!r}")
        try:
            if isinstance(self.shape, (str, bytes)):
                raise TypeError
            shape = tuple(operator.index(d) for d in self.shape)  # ints only: no silent 2.5 -> 2
        except TypeError:
            raise ConfigError(f"tensor {self.name!r}: shape must be a sequence of ints, got {self.shape!r}") from None
        if any(d < 0 for d in shape):
            raise ConfigError(f"tensor {self.name!r}: negative dimension in shape {shape}")
        if isinstance(self.aliases, str) or not all(isinstance(a, str) and a for a in self.aliases):
            raise ConfigError(
                f"tensor {self.name!r}: aliases must be a sequence of non-empty names, got {self.aliases!r}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "aliases", tuple(self.aliases))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TensorSlot:
    """A tensor's slot: its ``chunk`` index and element ``offset`` inside it, ``numel`` elements."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk: int
    offset: int
    aliases: tuple[str, ...] = ()
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        """One past the last element in chunk coordinates."""
        return self.offset + self.numel

    @property
    def names(self) -> tuple[str, ...]:
        """Primary name then every alias."""
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk: a flat buffer of ``size`` elements of ``dtype``, of which ``utilized`` hold tensors."""

    index: int
    dtype: str
    size: int
    utilized: int
    keep_gathered: bool = False
    requires_grad: bool = True
    tensor_names: tuple[str, ...] = field(default=(), compare=True)

    @property
    def padding(self) -> int:
        """Trailing zero elements: ``size - utilized``."""
        return self.size - self.utilized

    @property
    def size_bytes(self) -> int:
        return self.size * itemsize_bytes(self.dtype)


class ChunkLayout:
    """Tensors packed into chunks, chunks sharded over ``world_size`` ranks.

    Build with :meth:`build`; never mutate. Rank ``r`` owns elements ``[r*s, (r+1)*s)`` of a
    sharded chunk of size ``W*s``; every rank holds all of a keep-gathered chunk.

    Attributes:
        chunk_size: packing capacity in elements (tensors are packed until the next would exceed it).
        world_size: number of data-parallel ranks.
        tensors: :class:`TensorSlot` per unique tensor, in parameter order.
        chunks: :class:`ChunkInfo` per chunk, by index.
    """

    def __init__(
        self, tensors: Sequence[TensorSlot], chunks: Sequence[ChunkInfo], *, chunk_size: int, world_size: int
    ):
        self.chunk_size = int(chunk_size)
        self.world_size = int(world_size)
        self.tensors: tuple[TensorSlot, ...] = tuple(tensors)
        self.chunks: tuple[ChunkInfo, ...] = tuple(chunks)
        self._by_name: dict[str, TensorSlot] = {}
        for t in self.tensors:
            for n in t.names:
                self._by_name[n] = t
        self._validate()

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        specs: Iterable[TensorSpec],
        chunk_size: int,
        world_size: int,
        *,
        keep_gathered_below_numel: int = 0,
    ) -> ChunkLayout:
        """Pack ``specs`` in order into chunks of at most ``chunk_size`` elements.

        Tensors are grouped by (dtype, requires_grad, keep_gathered); within a group each tensor goes
        into the group's open chunk if it fits, else a new chunk is opened; a tensor larger than
        ``chunk_size`` gets a chunk of its own (the open chunk stays open). A group whose total numel
        is below ``keep_gathered_below_numel`` is packed keep-gathered.

        Args:
            specs: tensors in parameter order; names and aliases must be unique.
            chunk_size: capacity in elements, ``>= 1``.
            world_size: data-parallel degree, ``>= 1``.
            keep_gathered_below_numel: groups smaller than this stay unsharded (Gemini's
                ``min_chunk_size`` rule).

        Raises:
            ConfigError: a non-positive chunk size or world size.
            LayoutError: duplicate tensor names or aliases.
        """
        chunk_size, world_size = _positive("chunk_size", chunk_size), _positive("world_size", world_size)
        specs = list(specs)
        seen: set[str] = set()
        for spec in specs:
            if not isinstance(spec, TensorSpec):
                raise ConfigError(f"expected TensorSpec, got {type(spec).__name__}")
            for n in (spec.name, *spec.aliases):
                if n in seen:
                    raise LayoutError(f"tensor name {n!r} appears twice (as a name or alias)")
                seen.add(n)

        group_total: dict[tuple, int] = {}
        for spec in specs:
            key = (spec.dtype, spec.requires_grad, spec.keep_gathered)
            group_total[key] = group_total.get(key, 0) + spec.numel

        def group_key(spec: TensorSpec) -> tuple:
            kg = (
                spec.keep_gathered
                or group_total[(spec.dtype, spec.requires_grad, spec.keep_gathered)] < keep_gathered_below_numel
            )
            return (spec.dtype, spec.requires_grad, kg)

        chunk_members: list[list[TensorSpec]] = []
        chunk_keys: list[tuple] = []
        chunk_fill: list[int] = []
        open_chunk: dict[tuple, int] = {}
        for spec in specs:
            key = group_key(spec)
            if spec.numel > chunk_size:
                chunk_members.append([spec])
                chunk_keys.append(key)
                chunk_fill.append(spec.numel)
                continue
            idx = open_chunk.get(key)
            if idx is None or chunk_fill[idx] + spec.numel > chunk_size:
                idx = len(chunk_members)
                chunk_members.append([])
                chunk_keys.append(key)
                chunk_fill.append(0)
                open_chunk[key] = idx
            chunk_members[idx].append(spec)
            chunk_fill[idx] += spec.numel

        slots: dict[str, TensorSlot] = {}
        chunks: list[ChunkInfo] = []
        for idx, (members, key) in enumerate(zip(chunk_members, chunk_keys)):
            dtype, requires_grad, keep_gathered = key
            offset = 0
            for spec in members:
                slots[spec.name] = TensorSlot(
                    spec.name, spec.shape, spec.dtype, idx, offset, spec.aliases, spec.requires_grad
                )
                offset += spec.numel
            chunks.append(
                ChunkInfo(
                    idx,
                    dtype,
                    chunk_numel(offset, world_size, keep_gathered),
                    offset,
                    keep_gathered,
                    requires_grad,
                    tuple(s.name for s in members),
                )
            )
        tensors = [slots[s.name] for s in specs]
        return cls(tensors, chunks, chunk_size=chunk_size, world_size=world_size)

    def relayout(self, world_size: int) -> ChunkLayout:
        """The same packing for another world size: every tensor keeps its chunk and offset; only
        padding and shard ranges change."""
        world_size = _positive("world_size", world_size)
        chunks = [replace(c, size=chunk_numel(c.utilized, world_size, c.keep_gathered)) for c in self.chunks]
        return ChunkLayout(self.tensors, chunks, chunk_size=self.chunk_size, world_size=world_size)

    # ------------------------------------------------------------------ queries
    def tensor(self, name: str) -> TensorSlot:
        """Placement of the tensor called ``name`` (a primary name or an alias).

        Raises:
            KeyError: naming ``name`` if no tensor has it.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in the layout") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    @property
    def names(self) -> tuple[str, ...]:
        """Primary tensor names in parameter order."""
        return tuple(t.name for t in self.tensors)

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every name including aliases, each tensor's primary name first."""
        return tuple(n for t in self.tensors for n in t.names)

    def chunk_tensors(self, chunk: int) -> tuple[TensorSlot, ...]:
        """The tensors of chunk ``chunk``, in offset order."""
        return tuple(self._by_name[n] for n in self.chunks[chunk].tensor_names)

    def shard_numel(self, chunk: int) -> int:
        """Elements each rank holds of ``chunk`` (its whole size if keep-gathered)."""
        c = self.chunks[chunk]
        return c.size if c.keep_gathered else c.size // self.world_size

    def shard_range(self, chunk: int, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of ``chunk`` (chunk coordinates, elements) owned by ``rank``."""
        self._check_rank(rank)
        c = self.chunks[chunk]
        if c.keep_gathered:
            return (0, c.size)
        s = c.size // self.world_size
        return (rank * s, (rank + 1) * s)

    def valid_length(self, chunk: int, rank: int) -> int:
        """Elements of ``rank``'s shard of ``chunk`` that hold tensor data (not padding)."""
        start, stop = self.shard_range(chunk, rank)
        return max(0, min(stop, self.chunks[chunk].utilized) - start)

    def owned_range(self, name: str, rank: int) -> tuple[int, int]:
        """``[start, stop)`` within the flattened tensor ``name`` that ``rank``'s shard holds
        (``start == stop`` when it holds none of it)."""
        t = self.tensor(name)
        s0, s1 = self.shard_range(t.chunk, rank)
        start = min(max(s0, t.offset), t.end)
        stop = max(min(s1, t.end), start)
        return (start - t.offset, stop - t.offset)

    def shard_pieces(self, chunk: int, rank: int) -> list[tuple[TensorSlot, int, int, int]]:
        """The tensor pieces inside ``rank``'s shard of ``chunk``.

        Returns:
            ``(tensor, tensor_start, tensor_stop, shard_offset)`` per tensor overlapping the shard:
            flattened-tensor elements ``[tensor_start, tensor_stop)`` sit at ``shard_offset`` in the shard.
        """
        s0, _ = self.shard_range(chunk, rank)
        pieces = []
        for t in self.chunk_tensors(chunk):
            a, b = self.owned_range(t.name, rank)
            if b > a:
                pieces.append((t, a, b, t.offset + a - s0))
        return pieces

    @property
    def utilized_numel(self) -> int:
        """Elements holding tensors (each tied tensor once)."""
        return sum(c.utilized for c in self.chunks)

    @property
    def total_numel(self) -> int:
        """Elements of all chunks, padding included."""
        return sum(c.size for c in self.chunks)

    @property
    def padding_numel(self) -> int:
        return self.total_numel - self.utilized_numel

    def shard_bytes(self, rank: int = 0) -> int:
        """Bytes of chunk shards ``rank`` holds (keep-gathered chunks whole)."""
        self._check_rank(rank)
        return sum(self.shard_numel(c.index) * itemsize_bytes(c.dtype) for c in self.chunks)

    def summary(self) -> str:
        """A short human-readable description (one line per chunk)."""
        lines = [
            f"ChunkLayout: {len(self.tensors)} tensors, {len(self.chunks)} chunks, chunk_size={self.chunk_size} "
            f"elements, world_size={self.world_size}, utilized={self.utilized_numel}, padding={self.padding_numel}"
        ]
        for c in self.chunks:
            kind = "keep-gathered" if c.keep_gathered else "sharded"
            frozen = "" if c.requires_grad else ", frozen"
            lines.append(
                f"  chunk {c.index}: {c.dtype} size={c.size} utilized={c.utilized} padding={c.padding} "
                f"({kind}{frozen}) tensors={len(c.tensor_names)}"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (versioned); see :meth:`from_dict`."""
        return {
            "format": LAYOUT_FORMAT,
            "version": LAYOUT_VERSION,
            "chunk_size": self.chunk_size,
            "world_size": self.world_size,
            "tensors": [
                {
                    "name": t.name,
                    "aliases": list(t.aliases),
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "requires_grad": t.requires_grad,
                    "chunk": t.chunk,
                    "offset": t.offset,
                }
                for t in self.tensors
            ],
            "chunks": [
                {
                    "index": c.index,
                    "dtype": c.dtype,
                    "size": c.size,
                    "utilized": c.utilized,
                    "keep_gathered": c.keep_gathered,
                    "requires_grad": c.requires_grad,
                }
                for c in self.chunks
            ],
        }

    def to_json(self, **kwargs) -> str:
        """Serialize to a versioned JSON document."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, doc: Any) -> ChunkLayout:
        """Rebuild a layout from :meth:`to_dict` output, validating every field.

        Raises:
            LayoutVersionError: ``version`` is newer than this chunkzero reads.
            LayoutFormatError: any field missing, of the wrong type, or inconsistent (names the field).
        """
        d = _Fields(doc, "")
        if d.get("format", str) != LAYOUT_FORMAT:
            raise LayoutFormatError("format", f"expected {LAYOUT_FORMAT!r}, got {doc.get('format')!r}")
        version = d.get("version", int)
        if version > LAYOUT_VERSION or version < 1:
            raise LayoutVersionError(
                "version", f"version {version} is not supported (this chunkzero reads up to {LAYOUT_VERSION})"
            )
        chunk_size = d.get("chunk_size", int)
        world_size = d.get("world_size", int)
        if chunk_size < 1 or world_size < 1:
            raise LayoutFormatError("chunk_size" if chunk_size < 1 else "world_size", "must be >= 1")
        tensors = []
        for i, td in enumerate(d.get("tensors", list)):
            f = _Fields(td, f"tensors[{i}].")
            shape = f.get("shape", list)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
                raise LayoutFormatError(f"tensors[{i}].shape", f"must be a list of non-negative ints, got {shape!r}")
            aliases = f.get("aliases", list)
            if not all(isinstance(a, str) for a in aliases):
                raise LayoutFormatError(f"tensors[{i}].aliases", "must be a list of strings")
            try:
                dtype = canonical_dtype(f.get("dtype", str))
            except ConfigError as e:
                raise LayoutFormatError(f"tensors[{i}].dtype", str(e)) from None
            tensors.append(
                TensorSlot(
                    f.get("name", str), tuple(shape), dtype, f.get("chunk", int), f.get("offset", int),
                    tuple(aliases), f.get("requires_grad", bool),
                )
            )
        chunk_dicts = d.get("chunks", list)
        members: dict[int, list[TensorSlot]] = {i: [] for i in range(len(chunk_dicts))}
        for i, t in enumerate(tensors):
            if t.chunk not in members:
                raise LayoutFormatError(
                    f"tensors[{i}].chunk", f"chunk {t.chunk} does not exist ({len(chunk_dicts)} chunks)"
                )
            members[t.chunk].append(t)
        chunks = []
        for i, cd in enumerate(chunk_dicts):
            f = _Fields(cd, f"chunks[{i}].")
            if f.get("index", int) != i:
                raise LayoutFormatError(f"chunks[{i}].index", f"expected {i}, got {cd['index']}")
            try:
                dtype = canonical_dtype(f.get("dtype", str))
            except ConfigError as e:
                raise LayoutFormatError(f"chunks[{i}].dtype", str(e)) from None
            ordered = sorted(members[i], key=lambda t: t.offset)
            chunks.append(
                ChunkInfo(
                    i, dtype, f.get("size", int), f.get("utilized", int), f.get("keep_gathered", bool),
                    f.get("requires_grad", bool), tuple(t.name for t in ordered),
                )
            )
        return cls(tensors, chunks, chunk_size=chunk_size, world_size=world_size)

    @classmethod
    def from_json(cls, text: str | bytes) -> ChunkLayout:
        """Parse a document written by :meth:`to_json` (see :meth:`from_dict` for errors)."""
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LayoutFormatError("<document>", f"not valid JSON: {e}") from None
        return cls.from_dict(doc)

    # ------------------------------------------------------------------ dunder / checks
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChunkLayout):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self):
        return hash(self.to_json())

    def __repr__(self) -> str:
        return (
            f"ChunkLayout(tensors={len(self.tensors)}, chunks={len(self.chunks)}, chunk_size={self.chunk_size}, "
            f"world_size={self.world_size}, utilized_numel={self.utilized_numel}, padding_numel={self.padding_numel})"
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} out of range for world size {self.world_size}")

    def _validate(self) -> None:
        names: set[str] = set()
        listed = [set(c.tensor_names) for c in self.chunks]
        for i, t in enumerate(self.tensors):
            for n in t.names:
                if n in names:
                    raise LayoutFormatError(f"tensors[{i}].name", f"name {n!r} appears twice")
                names.add(n)
            if not 0 <= t.chunk < len(self.chunks) or t.name not in listed[t.chunk]:
                raise LayoutFormatError(f"tensors[{i}].chunk", f"tensor {t.name!r} is not listed in chunk {t.chunk}")
        for i, c in enumerate(self.chunks):
            if c.index != i:
                raise LayoutFormatError(f"chunks[{i}].index", f"expected {i}, got {c.index}")
            for n in c.tensor_names:
                if n not in self._by_name or self._by_name[n].name != n or self._by_name[n].chunk != i:
                    raise LayoutFormatError(f"chunks[{i}].tensor_names", f"{n!r} is not a tensor placed in chunk {i}")
            members = sorted(self.chunk_tensors(c.index), key=lambda t: t.offset)
            pos = 0
            for t in members:
                if t.offset != pos:
                    raise LayoutFormatError(
                        f"tensors[{self.tensors.index(t)}].offset",
                        f"tensor {t.name!r} at offset {t.offset} in chunk {i}, expected {pos} (tensors are packed "
                        "back to back)",
                    )
                if t.dtype != c.dtype:
                    raise LayoutFormatError(
                        f"chunks[{i}].dtype", f"chunk is {c.dtype} but tensor {t.name!r} is {t.dtype}"
                    )
                if t.requires_grad != c.requires_grad:
                    raise LayoutFormatError(
                        f"chunks[{i}].requires_grad",
                        f"chunk has requires_grad={c.requires_grad} but tensor {t.name!r} has {t.requires_grad}",
                    )
                pos = t.end
            if c.utilized != pos:
                raise LayoutFormatError(f"chunks[{i}].utilized", f"is {c.utilized} but its tensors hold {pos} elements")
            if c.size < max(c.utilized, 1):
                raise LayoutFormatError(
                    f"chunks[{i}].size", f"size {c.size} is below utilized {c.utilized} (or below 1)"
                )
            if not c.keep_gathered and c.size % self.world_size:
                raise LayoutFormatError(
                    f"chunks[{i}].size", f"size {c.size} is not a multiple of world size {self.world_size}"
                )


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def chunk_numel(utilized: int, world_size: int, keep_gathered: bool) -> int:
    """Size in elements of a chunk holding ``utilized`` elements: at least 1, and for a sharded chunk
    rounded up to a multiple of ``world_size`` (every rank's shard is as long); a keep-gathered chunk
    is never sharded, so it is padded to no multiple. The chunk-size search counts padding with it."""
    if keep_gathered:
        return max(utilized, 1)
    return _round_up(max(utilized, 1), world_size)


class _Fields:
    """Typed field access on a JSON object that raises :class:`LayoutFormatError` naming the field."""

    def __init__(self, obj: Any, prefix: str):
        if not isinstance(obj, dict):
            raise LayoutFormatError(prefix.rstrip(".") or "<document>", f"expected an object, got {type(obj).__name__}")
        self.obj, self.prefix = obj, prefix

    def get(self, key: str, kind: type):
        if key not in self.obj:
            raise LayoutFormatError(self.prefix + key, "missing")
        value = self.obj[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise LayoutFormatError(
                self.prefix + key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}"
            )
        return value
