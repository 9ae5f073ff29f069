"""Integrity of the saved arrays: a checksum per saved shard, and one per storage block of it.

Each saved shard's valid elements are split into **storage blocks** of ``block_numel`` elements (the
last one shorter), starting at the shard's first element. ``block_numel`` divides the shard's numel, so
the blocks are also the array's storage chunks on disk (the writer asks Orbax for chunks of that size,
:func:`storage_block_numel`): a rank that resumes at another world size reads only the blocks that hold
elements it now owns, TensorStore decodes nothing more, and each block it reads is verified against its
own checksum. The checksum of a whole shard — what readers that predate blocks verify — is the
combination of its blocks' (:func:`combine_checksums`), so one pass over the data gives both.

The record, in ``meta.checksums`` (written by both backends; ``blocks`` is optional, added without a
version bump — readers that predate it verify whole shards)::

    {"algorithm": "sum64+xor64",
     "arrays": {"params/chunk_0000": [shard checksum per saving rank], ...},
     "blocks": {"params/chunk_0000": {"block_numel": 262144, "sums": [[block checksums] per saving rank]}, ...}}

Why blocks rather than verifying only reads of whole shards: a 2→3 resume would then read half of the
checkpoint twice (every new middle shard straddles two saved ones), and a finer checksum is the only
way to verify a partial read without reading what is not needed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

CHECKSUM_ALGORITHM = "sum64+xor64"

STORAGE_BLOCK_BYTES = 1 << 20
"""Target size of a storage block (1 MiB): small enough that a partial read decodes at most one block
too many at each end of a range, large enough that a checkpoint holds few of them."""

_MIN_BLOCK_FRACTION = 16
"""A shard whose numel has no divisor within 1/16 of the target is stored as one block (see below)."""

_HEX = re.compile(r"[0-9a-f]{32}")


def shard_checksum(data: Any) -> str:
    """Checksum of one saved shard's valid elements (any numpy array; its raw little-endian bytes).

    The bytes, zero-padded to a multiple of 8, are read as little-endian uint64 words; the result is
    the 16-hex-digit wrapping sum of the words followed by the 16-hex-digit XOR of the words. Cheap
    (one pass at memory speed) and it changes with any single-bit or single-word corruption.
    """
    b = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    n8 = b.size - b.size % 8
    words = b[:n8].view("<u8")
    total = int(words.sum(dtype=np.uint64)) if words.size else 0
    xor = int(np.bitwise_xor.reduce(words)) if words.size else 0
    if n8 < b.size:
        tail = int.from_bytes(bytes(b[n8:]) + bytes(8 - (b.size - n8)), "little")
        total, xor = (total + tail) % 2**64, xor ^ tail
    return f"{total:016x}{xor:016x}"


def combine_checksums(sums: Sequence[str]) -> str:
    """The :func:`shard_checksum` of consecutive pieces joined, from the pieces' checksums — exact when
    every piece but the last is a multiple of 8 bytes (the words then do not straddle pieces)."""
    total, xor = 0, 0
    for s in sums:
        total, xor = (total + int(s[:16], 16)) % 2**64, xor ^ int(s[16:], 16)
    return f"{total:016x}{xor:016x}"


def block_checksums(data: Any, block_numel: int) -> list[str]:
    """:func:`shard_checksum` of each ``block_numel``-element block of 1-D ``data`` (the last one shorter)."""
    flat = np.ascontiguousarray(data).reshape(-1)
    return [shard_checksum(flat[s : s + block_numel]) for s in range(0, flat.size, block_numel)]


@lru_cache(maxsize=4096)
def storage_block_numel(write_numel: int, itemsize: int) -> int:
    """The storage block of an array written ``write_numel`` elements at a time (a saved shard; a
    keep-gathered chunk whole): the largest divisor of ``write_numel`` of at most
    :data:`STORAGE_BLOCK_BYTES` whose bytes are a multiple of 8 (so block checksums combine).

    Storage chunks must divide each process's write, so when ``write_numel`` has no such divisor of at
    least 1/16 of the target (a large prime factor), the shard stays one block: it is then read whole
    whenever a rank needs any of it, as before blocks.
    """
    target = max(1, STORAGE_BLOCK_BYTES // itemsize)
    if write_numel <= target:
        return max(1, write_numel)
    best = 0
    for d in range(1, math.isqrt(write_numel) + 1):
        if write_numel % d:
            continue
        for div in (d, write_numel // d):
            if div <= target and div * itemsize % 8 == 0 and div > best:
                best = div
    return best if best * _MIN_BLOCK_FRACTION >= target else write_numel


def checksum_key(path: tuple[str, ...]) -> str:
    """Key of array ``path`` in ``checksums["arrays"]``: ``"params/chunk_0000"``."""
    return "/".join(path)


def validate_record(value: Any, valid_numels: dict[str, tuple[int, ...]], bad) -> dict[str, Any] | None:
    """Check a ``checksums`` record; ``None`` stays ``None``.

    Args:
        value: the record.
        valid_numels: ``chunk key -> valid numel of each saved shard`` (in saving-rank order; one
            entry for a keep-gathered chunk) for every chunk of the layout, to check the counts against.
        bad: ``bad(field, why)`` builds the error to raise.

    Raises:
        whatever ``bad`` builds: wrong algorithm, malformed lists, a key that names no chunk, a
        count of checksums that does not match the saving ranks or the blocks.
    """
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or value.get("algorithm") != CHECKSUM_ALGORITHM
        or not isinstance(value.get("arrays"), dict)
    ):
        raise bad("checksums", f"expected {{'algorithm': {CHECKSUM_ALGORITHM!r}, 'arrays': {{...}}}}")
    for key, sums in value["arrays"].items():
        if not isinstance(sums, list) or not all(isinstance(x, str) and _HEX.fullmatch(x) for x in sums):
            raise bad(f"checksums.arrays.{key}", "expected a list of 32-hex-digit strings")
        valid = _valid_numels(key, valid_numels, bad, "arrays")
        if len(sums) != len(valid):
            raise bad(
                f"checksums.arrays.{key}", f"expected {len(valid)} checksums (one per saved shard), got {len(sums)}"
            )
    blocks = value.get("blocks")
    if blocks is None:
        return value
    if not isinstance(blocks, dict):
        raise bad("checksums.blocks", "expected an object")
    for key, entry in blocks.items():
        where = f"checksums.blocks.{key}"
        valid = _valid_numels(key, valid_numels, bad, "blocks")
        if key not in value["arrays"]:
            raise bad(where, "has blocks but no shard checksums in checksums.arrays")
        n = entry.get("block_numel") if isinstance(entry, dict) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(entry.get("sums"), list):
            raise bad(where, "expected {'block_numel': a positive int, 'sums': [[...] per saving rank]}")
        if len(entry["sums"]) != len(valid):
            raise bad(where, f"expected the blocks of {len(valid)} saved shard(s), got {len(entry['sums'])}")
        for q, (sums, numel) in enumerate(zip(entry["sums"], valid)):
            if not isinstance(sums, list) or not all(isinstance(x, str) and _HEX.fullmatch(x) for x in sums):
                raise bad(f"{where}.sums[{q}]", "expected a list of 32-hex-digit strings")
            if len(sums) != -(-numel // n):
                raise bad(f"{where}.sums[{q}]", f"expected {-(-numel // n)} block checksums for {numel} elements "
                                               f"in blocks of {n}, got {len(sums)}")
    return value


def _valid_numels(key: str, valid_numels: dict[str, tuple[int, ...]], bad, part: str) -> tuple[int, ...]:
    chunk = key.rsplit("/", 1)[-1]
    if chunk not in valid_numels:
        raise bad(f"checksums.{part}.{key}", "does not name a chunk of the layout")
    return valid_numels[chunk]
