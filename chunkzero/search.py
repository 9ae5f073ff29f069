"""Chunk-size search: which packing capacity (elements) to build a :class:`ChunkLayout` with.

Two searches share one yardstick, :func:`packing_stats`, which packs exactly as
:meth:`ChunkLayout.build` does and reports, per candidate chunk size ``C`` (elements):

- **waste** — ColossalAI Gemini's capacity metric: with every packed chunk at capacity ``C``, the
  tail space skipped when the next tensor does not fit plus the last chunk's free space, i.e.
  ``Σ (C − utilized)`` over packed chunks. A tensor larger than ``C`` gets a chunk of its own sized to
  it and wastes nothing.
- **padding** — the zeros :meth:`ChunkLayout.build` really allocates: each sharded chunk is its
  utilized numel rounded up to a multiple of the world size ``W`` (``< W`` elements per chunk).

:func:`gemini_search` reproduces Gemini's ``search_chunk_configuration`` (ColossalAI,
``colossalai/zero/gemini/chunk/search_utils.py``; Fang et al. 2021, PatrickStar): candidate sizes
from a start in steps of an interval over a range, greedy in-order packing, parameters above
mean + 3·std filtered out, the smallest size of least waste, rounded up to a multiple of ``W``.

:func:`search_chunk_size` is chunkzero's search. Gemini's fixed grid rarely lands on a size at
which tensors pack exactly, so most chunks skip a tail. chunkzero instead proposes the sizes at
which packing *can* be exact — the sums of runs of consecutive tensors (one transformer block, a
block and a half, the embeddings plus a few projections …) — and evaluates every one exactly. On
repeated blocks a run sum equal to the block period makes every chunk after the first exact. Among
the sizes whose waste + padding is within a tolerance of the best, it prefers fewer chunks, then
less overhead, then the larger size.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from .errors import ConfigError
from .layout import ChunkLayout, TensorSpec, chunk_numel

MI = 2**20
"""``2**20`` elements: Gemini's unit for ``search_range_m`` / ``min_chunk_size_m``."""

GEMINI_SEARCH_RANGE_NUMEL = 32 * MI
"""Gemini's default ``search_range_m=32`` (in elements)."""
GEMINI_SEARCH_INTERVAL_NUMEL = 1024
"""Gemini's default interval when no ``hidden_dim`` is given."""
GEMINI_MIN_CHUNK_NUMEL = 32 * MI
"""Gemini's default ``min_chunk_size_m=32`` (in elements)."""

DEFAULT_MIN_CHUNK_NUMEL = MI
"""chunkzero's default lower bound on the chunk size: 1 Mi elements (2 MiB in bf16)."""
DEFAULT_MAX_CHUNK_NUMEL = 64 * MI
"""chunkzero's cap on the default upper bound: 64 Mi elements (Gemini's default start + range)."""
DEFAULT_MIN_SHARD_NUMEL = 2**16
"""Lower bound on ``chunk_size / W`` so each rank's shard of a chunk is not tiny."""
DEFAULT_TOLERANCE = 0.005
"""Overhead (waste + padding) within ``0.5 %`` of parameters counts as a tie."""

SpecsLike = Union[Sequence[TensorSpec], Sequence[int]]


# ---------------------------------------------------------------------------------------------------- results
class _Overhead:
    """``overhead_numel`` / ``overhead_fraction`` for results with wasted, padding and total numels."""

    wasted_numel: int
    padding_numel: int
    total_numel: int

    @property
    def overhead_numel(self) -> int:
        """``wasted_numel + padding_numel``."""
        return self.wasted_numel + self.padding_numel

    @property
    def overhead_fraction(self) -> float:
        """``overhead_numel / total_numel`` (0 for an empty model)."""
        return self.overhead_numel / self.total_numel if self.total_numel else 0.0


@dataclass(frozen=True)
class PackingStats(_Overhead):
    """What packing at capacity ``chunk_size`` gives (see the module docstring for the metrics).

    Attributes:
        chunk_size: packing capacity in elements.
        world_size: ``W``, for the padding.
        total_numel: elements of all tensors (tied tensors once).
        num_chunks: chunks :meth:`ChunkLayout.build` makes (packed plus dedicated).
        dedicated_chunks: chunks holding one tensor larger than ``chunk_size``.
        wasted_numel: Gemini's capacity waste, ``Σ (chunk_size − utilized)`` over packed chunks.
        padding_numel: physical padding of the built layout (``== layout.padding_numel``).
    """

    chunk_size: int
    world_size: int
    total_numel: int
    num_chunks: int
    dedicated_chunks: int
    wasted_numel: int
    padding_numel: int


@dataclass(frozen=True)
class SearchResult(_Overhead):
    """A searched chunk size and how it packs.

    Attributes:
        method: ``"gemini"`` or ``"chunkzero"``.
        chunk_size: chosen packing capacity in elements (Gemini's is a multiple of ``world_size``).
        world_size: ``W`` searched for.
        total_numel: elements of all tensors (tied once).
        wasted_numel: capacity waste of the chosen size under :meth:`ChunkLayout.build` packing.
        padding_numel: physical padding of the built layout.
        num_chunks: chunks of the built layout.
        method_waste_numel: the waste as the method itself scored it (Gemini's ``min_chunk_waste``:
            filtered parameters excluded, before rounding to ``W``); equals ``wasted_numel`` for chunkzero.
        candidates: number of chunk sizes evaluated.
        keep_gathered_below_numel: pass to :meth:`ChunkLayout.build` (Gemini keeps a group whose
            total is under ``min_chunk_numel`` gathered; 0 for chunkzero).
    """

    method: str
    chunk_size: int
    world_size: int
    total_numel: int
    wasted_numel: int
    padding_numel: int
    num_chunks: int
    method_waste_numel: int
    candidates: int
    keep_gathered_below_numel: int = 0

    def layout(self, specs: Iterable[TensorSpec], world_size: int | None = None) -> ChunkLayout:
        """Build the :class:`ChunkLayout` of ``specs`` at this chunk size (``world_size`` defaults to
        the one searched for)."""
        return ChunkLayout.build(
            _as_specs(specs), self.chunk_size, world_size or self.world_size,
            keep_gathered_below_numel=self.keep_gathered_below_numel,
        )


# ---------------------------------------------------------------------------------------------------- input
def _as_specs(items: Iterable) -> list[TensorSpec]:
    """TensorSpecs as given, or ints turned into 1-D float32 specs ``t0, t1 …``."""
    items = list(items)
    if all(isinstance(x, TensorSpec) for x in items):
        return items
    specs = []
    for i, x in enumerate(items):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ConfigError(f"sizes[{i}]: expected a TensorSpec or an int numel, got {type(x).__name__} {x!r}")
        if x < 0:
            raise ConfigError(f"sizes[{i}]: numel must be >= 0, got {x}")
        specs.append(TensorSpec(f"t{i}", (int(x),)))
    return specs


def _groups(specs: Sequence[TensorSpec]) -> list[tuple[bool, list[int]]]:
    """Per packing group of :meth:`ChunkLayout.build` (dtype, requires_grad, keep_gathered), in first
    appearance order: ``(keep_gathered, numels in order)``."""
    groups: dict[tuple, list[int]] = {}
    for s in specs:
        groups.setdefault((s.dtype, s.requires_grad, s.keep_gathered), []).append(s.numel)
    return [(key[2], numels) for key, numels in groups.items()]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------------- yardstick
def _pack_group(
    numels: Sequence[int], chunk_size: int, world_size: int, keep_gathered: bool
) -> tuple[int, int, int, int]:
    """``(chunks, dedicated, waste, padding)`` of one group packed like :meth:`ChunkLayout.build`."""
    packed = [n for n in numels if n <= chunk_size]
    dedicated = [n for n in numels if n > chunk_size]
    padding = sum(chunk_numel(n, world_size, keep_gathered) - n for n in dedicated)
    prefix = [0]
    for n in packed:
        prefix.append(prefix[-1] + n)
    chunks = waste = 0
    p = 0
    while p < len(packed):
        end = bisect.bisect_right(prefix, prefix[p] + chunk_size) - 1  # last end with the run fitting
        used = prefix[end] - prefix[p]
        waste += chunk_size - used
        padding += chunk_numel(used, world_size, keep_gathered) - used
        chunks += 1
        p = end
    return chunks + len(dedicated), len(dedicated), waste, padding


def packing_stats(specs: SpecsLike, chunk_size: int, world_size: int = 1) -> PackingStats:
    """Chunks, waste and padding of packing ``specs`` at capacity ``chunk_size`` over ``world_size``
    ranks, exactly as :meth:`ChunkLayout.build` packs (``keep_gathered_below_numel=0``).

    Args:
        specs: :class:`TensorSpec` in parameter order, or plain numels (one float32 group).
        chunk_size: capacity in elements.
        world_size: ``W``.

    Raises:
        ConfigError: a non-positive ``chunk_size``/``world_size`` or a bad size.
    """
    chunk_size = _positive_int("chunk_size", chunk_size)
    world_size = _positive_int("world_size", world_size)
    groups = _groups(_as_specs(specs))
    chunks = dedicated = waste = padding = total = 0
    for keep_gathered, numels in groups:
        c, d, w, p = _pack_group(numels, chunk_size, world_size, keep_gathered)
        chunks, dedicated, waste, padding = chunks + c, dedicated + d, waste + w, padding + p
        total += sum(numels)
    return PackingStats(chunk_size, world_size, total, chunks, dedicated, waste, padding)


# ---------------------------------------------------------------------------------------------------- Gemini
def _gemini_unused_numel(sizes: Sequence[int], candidates: np.ndarray) -> np.ndarray:
    """Gemini's ``_get_unused_byte`` for every candidate at once (int64 ``[len(candidates)]``).

    Greedy in-order packing: a tensor that does not fit in what is left of the current chunk opens a
    new one and the left-over is wasted; the last chunk's free space is wasted too. (Despite Gemini's
    name the unit is elements.)
    """
    acc = np.zeros_like(candidates)
    left = np.zeros_like(candidates)
    for s in sizes:
        opens = s > left
        acc = np.where(opens, acc + left, acc)
        left = np.where(opens, candidates, left) - s
    return acc + left


def gemini_search(
    numels_or_specs: SpecsLike,
    *,
    search_range_numel: int = GEMINI_SEARCH_RANGE_NUMEL,
    search_interval_numel: int = GEMINI_SEARCH_INTERVAL_NUMEL,
    min_chunk_numel: int = GEMINI_MIN_CHUNK_NUMEL,
    filter_exlarge: bool = True,
    world_size: int = 1,
) -> SearchResult:
    """ColossalAI Gemini's chunk-size search (``search_chunk_configuration``), for comparison.

    Method (ColossalAI ``colossalai/zero/gemini/chunk/search_utils.py``, from PatrickStar, Fang et al.
    2021): all tensors form one group (Gemini groups by data-parallel degree only). If the group's
    total is below ``min_chunk_numel`` it is kept gathered as one chunk. Otherwise, if
    ``filter_exlarge``, tensors above ``mean + 3·std`` of the sizes (population std) are dropped from
    the search (at build time they get chunks of their own if larger than the chunk size). The start
    is ``max(min_chunk_numel, largest remaining size)`` rounded up to a multiple of
    ``search_interval_numel``; candidates are ``start, start + interval, …, start + search_range_numel``;
    each is scored by greedy in-order packing waste (:func:`_gemini_unused_numel`); the first
    (smallest) of least waste wins and is rounded up to a multiple of ``world_size``.

    Args:
        numels_or_specs: tensors in parameter order (:class:`TensorSpec`, tied once) or plain numels.
        search_range_numel: width of the candidate range in elements (Gemini: ``search_range_m·2**20``).
        search_interval_numel: step in elements (Gemini: ``hidden_dim``, default 1024).
        min_chunk_numel: minimum chunk size in elements (Gemini: ``min_chunk_size_m·2**20``).
        filter_exlarge: drop tensors above mean + 3·std from the search.
        world_size: ``W``; the result is a multiple of it.

    Returns:
        :class:`SearchResult` with ``method="gemini"``; ``method_waste_numel`` is Gemini's own figure,
        ``wasted_numel``/``padding_numel`` are measured by :func:`packing_stats` at the final size.

    Raises:
        ConfigError: a bad argument or size, or no tensors.
    """
    specs = _as_specs(numels_or_specs)
    if not specs:
        raise ConfigError("numels_or_specs: no tensors to search a chunk size for")
    if (
        isinstance(search_range_numel, bool)
        or not isinstance(search_range_numel, (int, np.integer))
        or search_range_numel < 0
    ):
        raise ConfigError(f"search_range_numel must be an int >= 0, got {search_range_numel!r}")
    interval = _positive_int("search_interval_numel", search_interval_numel)
    min_chunk = _positive_int("min_chunk_numel", min_chunk_numel)
    world_size = _positive_int("world_size", world_size)

    sizes = [s.numel for s in specs]
    total = sum(sizes)
    keep_gathered = total < min_chunk
    if keep_gathered:
        search_sizes: list[int] = []
        best = max(total, 1)
        method_waste = 0
        n_candidates = 0
    else:
        search_sizes = sizes
        if filter_exlarge:
            arr = np.asarray(sizes, dtype=np.float64)
            upper = float(arr.mean() + 3 * arr.std())
            search_sizes = [s for s in sizes if s <= upper]
        max_size = max([min_chunk, *search_sizes])
        start = -(-max_size // interval) * interval
        candidates = np.arange(start, start + int(search_range_numel) + 1, interval, dtype=np.int64)
        waste = _gemini_unused_numel(search_sizes, candidates)
        i = int(np.argmin(waste))  # first (smallest) candidate of least waste, as Gemini's strict '<'
        best, method_waste, n_candidates = int(candidates[i]), int(waste[i]), len(candidates)
    chunk_size = -(-best // world_size) * world_size
    if keep_gathered:
        # Gemini's keep-gathered group is one chunk of the whole group; build with capacity >= total.
        layout_stats = packing_stats([_as_keep_gathered(s) for s in specs], max(chunk_size, 1), world_size)
    else:
        layout_stats = packing_stats(specs, chunk_size, world_size)
    return SearchResult(
        "gemini",
        chunk_size,
        world_size,
        total,
        layout_stats.wasted_numel,
        layout_stats.padding_numel,
        layout_stats.num_chunks,
        method_waste,
        n_candidates,
        keep_gathered_below_numel=min_chunk if keep_gathered else 0,
    )


def _as_keep_gathered(spec: TensorSpec) -> TensorSpec:
    """``spec`` marked keep-gathered (to measure Gemini's keep-gathered group)."""
    return TensorSpec(spec.name, spec.shape, spec.dtype, spec.aliases, spec.requires_grad, True)


# ---------------------------------------------------------------------------------------------------- chunkzero
MAX_BANDS = 32
"""At most this many size bands get their own run sums (the largest distinct tensor sizes)."""
MAX_RUN_PAIRS = 1_000_000
"""At most this many (start, end) runs are summed per band (evenly thinned per start beyond it)."""


def _run_sums(numels: np.ndarray, lo: int, hi: int, max_pairs: int = MAX_RUN_PAIRS) -> np.ndarray:
    """Sums of runs of consecutive ``numels`` (int64 ``[n]``) that lie in ``[lo, hi]``, unique and
    sorted; beyond ``max_pairs`` runs, an evenly spaced subset of the ends of each start."""
    if not len(numels) or hi < lo:
        return np.zeros(0, dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(numels, dtype=np.int64)])
    starts = prefix[:-1]
    first = np.searchsorted(prefix, starts + lo, side="left")
    last = np.searchsorted(prefix, starts + hi, side="right")  # exclusive
    counts = np.maximum(last - first, 0)
    per_start = max(1, max_pairs // len(starts))
    taken = np.minimum(counts, per_start)
    if not taken.sum():
        return np.zeros(0, dtype=np.int64)
    rows = np.repeat(np.arange(len(starts)), taken)
    k = np.arange(taken.sum()) - np.repeat(np.cumsum(taken) - taken, taken)  # 0..taken-1 per start
    step = np.repeat(counts / np.maximum(taken, 1), taken)  # 1 when not thinned
    ends = np.repeat(first, taken) + (k * step).astype(np.int64)
    return np.unique(prefix[ends] - starts[rows])


class _Packer:
    """Evaluates capacities fast: per group, the sequence with every tensor above the capacity
    zeroed (it gets a chunk of its own and leaves the open chunk open, so it does not affect
    packing), its prefix sums cached per band of capacities (between consecutive distinct sizes)."""

    def __init__(self, groups: list[tuple[bool, list[int]]], world_size: int):
        self.world_size = world_size
        self.groups = [(kg, np.asarray(numels, dtype=np.int64)) for kg, numels in groups]
        self.sizes = sorted({int(n) for _, arr in self.groups for n in arr.tolist()})
        self._cache: dict[int, list[tuple[bool, list[int], int, int, int]]] = {}

    def _band(self, chunk_size: int):
        key = bisect.bisect_right(self.sizes, chunk_size)  # number of distinct sizes <= chunk_size
        band = self._cache.get(key)
        if band is None:
            band = []
            for kg, arr in self.groups:
                fits = arr <= chunk_size
                big = arr[~fits].tolist()
                pad = sum(chunk_numel(n, self.world_size, kg) - n for n in big)
                prefix = np.concatenate([[0], np.cumsum(np.where(fits, arr, 0))]).tolist()
                band.append((kg, prefix, int(fits.sum()), len(big), pad))
            self._cache[key] = band
        return band

    def __call__(self, chunk_size: int) -> tuple[int, int, int]:
        """``(chunks, waste, padding)`` exactly as :func:`packing_stats`."""
        chunks = waste = padding = 0
        w = self.world_size
        for kg, prefix, n_packed, n_big, big_pad in self._band(chunk_size):
            chunks += n_big
            padding += big_pad
            if not n_packed:
                continue
            p, n = 0, len(prefix) - 1
            while p < n:
                end = bisect.bisect_right(prefix, prefix[p] + chunk_size) - 1
                used = prefix[end] - prefix[p]
                waste += chunk_size - used
                padding += chunk_numel(used, w, kg) - used
                chunks += 1
                p = end
        return chunks, waste, padding


def _candidate_sizes(groups: list[tuple[bool, list[int]]], lo: int, hi: int, max_candidates: int) -> np.ndarray:
    """Candidate capacities in ``[lo, hi]``: the range ends, and run sums of the tensors a capacity
    in each size band would pack. Bands are split at the distinct tensor sizes in ``(lo, hi]`` (the
    :data:`MAX_BANDS` largest), so within a band the dedicated tensors are (nearly) fixed."""
    sizes = sorted({n for _, numels in groups for n in numels if lo < n <= hi})[-MAX_BANDS:]
    bounds = [lo, *sizes, hi + 1]
    found = [np.array([lo, hi], dtype=np.int64)]
    pairs = max(10_000, MAX_RUN_PAIRS // len(bounds))
    for a, b in zip(bounds[:-1], bounds[1:]):
        b -= 1
        if b < a:
            continue
        found.append(np.array([a, b], dtype=np.int64))
        for _, numels in groups:
            arr = np.asarray(numels, dtype=np.int64)
            found.append(_run_sums(np.where(arr <= a, arr, 0), a, b, pairs))
    cands = np.unique(np.concatenate(found))
    if len(cands) > max_candidates:  # deterministic thinning, keeping both ends
        idx = np.unique(np.linspace(0, len(cands) - 1, max_candidates).round().astype(np.int64))
        cands = cands[idx]
    return cands


def default_chunk_range(total_numel: int, world_size: int, *, min_chunk_numel: int | None = None,
                        max_chunk_numel: int | None = None,
                        min_shard_numel: int = DEFAULT_MIN_SHARD_NUMEL) -> tuple[int, int]:
    """The ``[lo, hi]`` chunk-size range (elements) :func:`search_chunk_size` searches.

    ``lo = min_chunk_numel`` if given, else ``max(min(1 Mi, total/64), W·min_shard_numel)`` — the
    ``W·min_shard_numel`` floor keeps each rank's shard of a chunk from being tiny.
    ``hi = max_chunk_numel`` if given, else ``min(64 Mi, total/8)``: at least ~8 chunks to overlap
    gathers with compute and a gathered chunk at most ~1/8 of the model, with Gemini's default
    64 Mi as cap; if that falls below ``lo`` (a small model), ``hi`` is the whole model. A model of at
    most ``lo`` elements is one chunk: ``lo = hi = total``. Always ``1 <= lo <= hi``.
    """
    if min_chunk_numel is None:
        lo = max(min(DEFAULT_MIN_CHUNK_NUMEL, -(-total_numel // 64)), world_size * min_shard_numel, 1)
    else:
        lo = max(min_chunk_numel, 1)
    if max_chunk_numel is None:
        hi = min(DEFAULT_MAX_CHUNK_NUMEL, -(-total_numel // 8))
        if hi < lo:  # a small model: any size up to the whole model
            hi = total_numel
    else:
        hi = max_chunk_numel
    if total_numel <= lo:
        lo = hi = max(total_numel, 1)
    hi = max(hi, lo)
    return lo, hi


def search_chunk_size(
    specs: SpecsLike,
    world_size: int,
    *,
    min_chunk_numel: int | None = None,
    max_chunk_numel: int | None = None,
    min_shard_numel: int = DEFAULT_MIN_SHARD_NUMEL,
    tolerance: float = DEFAULT_TOLERANCE,
    max_candidates: int = 5_000,
) -> SearchResult:
    """chunkzero's chunk-size search: least waste + padding, at sizes where packing can be exact.

    Method: the range ``[lo, hi]`` comes from :func:`default_chunk_range` (``min_chunk_numel``
    and ``max_chunk_numel`` override its ends; a model of at most ``lo`` elements is one chunk).
    Candidates are both ends and every run sum of consecutive tensors in the range
    (:func:`_candidate_sizes`) — a capacity equal to a run sum packs that run with no tail, and one
    equal to a repeated block's sum packs every following block exactly. Each candidate is measured
    exactly by :func:`packing_stats`. Let ``best`` be the least ``waste + padding``; candidates within
    ``max(best, tolerance·total)`` are ties, and among them the fewest chunks, then the least
    overhead, then the largest size wins. Deterministic; each candidate costs one binary search
    per chunk (prefix sums are shared by the capacities of a size band).

    The chunk size need not be a multiple of ``W``: :meth:`ChunkLayout.build` rounds each chunk to
    its utilized numel up to a multiple of ``W``, so padding is below ``W`` elements per chunk.

    Args:
        specs: :class:`TensorSpec` in parameter order (tied tensors once) or plain numels.
        world_size: ``W`` (``>= 1``).
        min_chunk_numel: lower end of the range in elements (default
            ``max(min(1 Mi, total/64), W·min_shard_numel)``).
        max_chunk_numel: upper end in elements (default ``min(64 Mi, total/8)``).
        min_shard_numel: with the default ``min_chunk_numel``, the range starts at no less than
            ``W·min_shard_numel`` elements.
        tolerance: fraction of parameters within which overheads count as ties.
        max_candidates: cap on evaluated sizes (thinned evenly if exceeded).

    Returns:
        :class:`SearchResult` with ``method="chunkzero"``; ``.layout(specs)`` builds it.

    Raises:
        ConfigError: no tensors, ``min_chunk_numel > max_chunk_numel``, or a bad argument.
    """
    specs = _as_specs(specs)
    if not specs:
        raise ConfigError("specs: no tensors to search a chunk size for")
    world_size = _positive_int("world_size", world_size)
    if min_chunk_numel is not None:
        min_chunk_numel = _positive_int("min_chunk_numel", min_chunk_numel)
    if max_chunk_numel is not None:
        max_chunk_numel = _positive_int("max_chunk_numel", max_chunk_numel)
    if min_chunk_numel is not None and max_chunk_numel is not None and min_chunk_numel > max_chunk_numel:
        raise ConfigError(f"min_chunk_numel {min_chunk_numel} exceeds max_chunk_numel {max_chunk_numel}")
    min_shard_numel = _positive_int("min_shard_numel", min_shard_numel)
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1 and not math.isnan(tolerance)):
        raise ConfigError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")
    max_candidates = max(2, _positive_int("max_candidates", max_candidates))

    groups = _groups(specs)
    total = sum(s.numel for s in specs)
    lo, hi = default_chunk_range(total, world_size, min_chunk_numel=min_chunk_numel,
                                 max_chunk_numel=max_chunk_numel, min_shard_numel=min_shard_numel)
    candidates = _candidate_sizes(groups, lo, hi, max_candidates)

    pack = _Packer(groups, world_size)
    scored = []
    for c in candidates.tolist():
        chunks, waste, padding = pack(c)
        scored.append((waste + padding, chunks, c, waste, padding))
    best = min(s[0] for s in scored)
    budget = max(best, math.floor(tolerance * total))
    overhead, chunks, chosen, waste, padding = min(
        (s for s in scored if s[0] <= budget), key=lambda s: (s[1], s[0], -s[2])
    )
    return SearchResult("chunkzero", chosen, world_size, total, waste, padding, chunks, waste, len(candidates))


def build_layout(
    specs: Iterable[TensorSpec],
    world_size: int,
    chunk_size: int | None = None,
    *,
    keep_gathered_below_numel: int = 0,
    **search_kwargs,
) -> ChunkLayout:
    """:meth:`ChunkLayout.build` with the chunk size searched by :func:`search_chunk_size` when
    ``chunk_size`` is ``None`` (``search_kwargs`` go to the search).

    Raises:
        ConfigError, LayoutError: as :func:`search_chunk_size` and :meth:`ChunkLayout.build`.
    """
    specs = _as_specs(specs)
    if chunk_size is None:
        chunk_size = search_chunk_size(specs, world_size, **search_kwargs).chunk_size
    elif search_kwargs:
        raise ConfigError(f"search options {sorted(search_kwargs)} given with an explicit chunk_size")
    return ChunkLayout.build(specs, chunk_size, world_size, keep_gathered_below_numel=keep_gathered_below_numel)


# ---------------------------------------------------------------------------------------------------- report
def waste_table(
    models: Sequence[str] = ("hf-gpt2", "hf-gpt2-medium", "llama-1b"),
    world_sizes: Sequence[int] = (2, 3, 4, 8),
) -> list[dict]:
    """Gemini's search (its defaults, interval = the model's hidden size) and chunkzero's, per model
    config and world size: one row dict per (model, W, method) with ``chunk_size``, ``num_chunks``,
    ``padding_numel``, ``wasted_numel``, ``total_numel`` and ``overhead_pct`` (percent of parameters)."""
    from .configs import model_config, model_specs

    rows = []
    for name in models:
        specs = model_specs(name)
        for w in world_sizes:
            results = [
                gemini_search(specs, search_interval_numel=model_config(name).hidden_size, world_size=w),
                search_chunk_size(specs, w),
            ]
            for r in results:
                rows.append(dict(
                    model=name, world_size=w, method=r.method, chunk_size=r.chunk_size, num_chunks=r.num_chunks,
                    padding_numel=r.padding_numel, wasted_numel=r.wasted_numel, total_numel=r.total_numel,
                    overhead_pct=100 * r.overhead_fraction,
                ))
    return rows


def format_waste_table(rows: Sequence[dict]) -> str:
    """A markdown table of :func:`waste_table` rows."""
    head = "| model | W | search | chunk size (elements) | chunks | padding | waste | (padding+waste)/params |"
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['world_size']} | {r['method']} | {r['chunk_size']:,} | {r['num_chunks']} | "
            f"{r['padding_numel']:,} | {r['wasted_numel']:,} | {r['overhead_pct']:.3f}% |"
        )
    return "\n".join(lines)
