"""Collectives of a compiled XLA program, counted in its HLO text.

:func:`parse_collectives` reads every all-gather / reduce-scatter / all-reduce / all-to-all /
collective-permute instruction of ``compiled.as_text()`` (the asynchronous ``-start`` forms count as
their kind, ``-done`` not at all): the bytes of each buffer it produces per device and the size of
its replica group. :func:`count_collectives` sums them by kind: instructions, buffers (XLA's
combiners may merge several buffers into one instruction), full-buffer bytes, and the bytes each
device sends under the ring model — all-gather and reduce-scatter ``(W−1)/W·S``, all-reduce
``2(W−1)/W·S`` for a buffer of ``S`` bytes over ``W`` devices, the accounting of :mod:`chunkzero.cost`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
"""Collective kinds counted in HLO (``-start`` async forms count as their kind; ``-done`` is not counted)."""

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_OP_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s+(?P<op>all-gather-start|all-gather|reduce-scatter|"
    r"all-reduce-start|all-reduce|all-to-all|collective-permute-start|collective-permute)\("
)
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST_RE = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of compiled HLO.

    Attributes:
        kind: one of :data:`COLLECTIVE_KINDS`.
        result_bytes: bytes of each buffer it produces (per device), one entry per buffer.
        group_size: devices per replica group (``W`` for the data axis).
    """

    kind: str
    result_bytes: tuple[int, ...]
    group_size: int

    @property
    def buffers(self) -> int:
        """Buffers it moves (several when XLA combined collectives into one instruction)."""
        return len(self.result_bytes)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the full buffers: all-gather output, reduce-scatter input, all-reduce operand."""
        total = sum(self.result_bytes)
        return total * self.group_size if self.kind == "reduce-scatter" else total

    @property
    def wire_bytes(self) -> int:
        """Bytes each device sends under the ring model (:mod:`chunkzero.cost`'s accounting)."""
        n = self.group_size
        if n <= 1:
            return 0
        factor = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return round(factor * self.buffer_bytes)


def parse_collectives(hlo_text: str, default_group_size: int = 1) -> list[Collective]:
    """Every collective instruction of an HLO module's text (``compiled.as_text()``), in text order.

    Args:
        hlo_text: optimized HLO as text.
        default_group_size: group size when an instruction lists no replica groups (all devices).
    """
    out = []
    for line in hlo_text.splitlines():
        if "all-" not in line and "reduce-scatter" not in line and "collective-permute" not in line:
            continue
        clean = re.sub(r"/\*.*?\*/", "", line)
        m = _OP_RE.match(clean)
        if not m:
            continue
        op = m.group("op")
        kind = op.removesuffix("-start")
        shapes = [
            (_DTYPE_BYTES.get(dt, 4), [int(x) for x in dims.split(",") if x])
            for dt, dims in _SHAPE_RE.findall(m.group("type"))
        ]
        if op in ("all-gather-start", "collective-permute-start") and len(shapes) >= 2:
            shapes = shapes[len(shapes) // 2 :]  # (operands, results): keep the results
        sizes = tuple(b * math.prod(d) for b, d in shapes)
        g = _GROUPS_LIST_RE.search(clean)
        if g:
            group = len([x for x in g.group(1).split(",") if x])
        else:
            iota = _GROUPS_IOTA_RE.search(clean)
            group = int(iota.group(2)) if iota else default_group_size
        out.append(Collective(kind, sizes, group))
    return out


@dataclass(frozen=True)
class CollectiveCounts:
    """Collectives of one compiled program, by kind (every kind of :data:`COLLECTIVE_KINDS` present).

    Attributes:
        ops: instructions.
        buffers: buffers moved (``>= ops``; more when XLA combined collectives).
        buffer_bytes: bytes of the full buffers (per device).
        wire_bytes: bytes each device sends, ring model.
    """

    ops: dict[str, int]
    buffers: dict[str, int]
    buffer_bytes: dict[str, int]
    wire_bytes: dict[str, int]

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())


def count_collectives(hlo_text: str, default_group_size: int = 1) -> CollectiveCounts:
    """Count all-gather / reduce-scatter / all-reduce / … in compiled HLO text (see :func:`parse_collectives`)."""
    ops = dict.fromkeys(COLLECTIVE_KINDS, 0)
    buffers, bbytes, wire = dict(ops), dict(ops), dict(ops)
    for c in parse_collectives(hlo_text, default_group_size):
        ops[c.kind] += 1
        buffers[c.kind] += c.buffers
        bbytes[c.kind] += c.buffer_bytes
        wire[c.kind] += c.wire_bytes
    return CollectiveCounts(ops, buffers, bbytes, wire)



__all__ = ["COLLECTIVE_KINDS", "Collective", "CollectiveCounts", "count_collectives", "parse_collectives"]
