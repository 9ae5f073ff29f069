"""Gemini's ``auto`` placement: decisions from a warm-up trace, by Belady's farthest-next-use eviction.

A warm-up step records the **access order** (the chunk used at each access, repeats allowed, e.g.
forward then backward) and the **non-model memory** (activations and other buffers alive) at each
access. Given each chunk's device footprint and a device **budget**, the functions here decide, for
every access, which chunks to move to the host (**evict**) and which to bring to the device
(**prefetch**) so that at every access ``t``

    the accessed chunk is on the device, and  device_bytes[t] + non_model_bytes[t] <= budget,

where ``device_bytes[t]`` sums the sizes of the chunks on the device during access ``t``. Moves happen
between accesses, evictions first. Cost is bytes moved: host→device plus device→host.

The trace repeats every step, so the plan is cyclic: the device set at the end of one step is the
start of the next. The ``"belady"`` rule simulates step after step from an empty device until the
set of chunks on the device at a step boundary repeats; the steps of that cycle (one step for a
forward then backward trace; up to ``n - 1`` steps for a pure cyclic scan of ``n`` chunks) form the
steady state, and bytes per step are the cycle's total over its length. The warm-up transient is
left out.

Belady's rule (MIN / OPT, Belady 1966): when an access does not fit, evict the chunk whose next use
is farthest in the future, looking across step boundaries into the next step. For equal chunk sizes
it moves the fewest bytes of any schedule (any eviction and prefetch choice, any period) at the
same budget. For unequal sizes, caching in bytes is NP-hard (Chrobak et al. 2012, "Caching is hard
— even in the fault model") and farthest-next-use can lose, even to the static policy; so the
victim set is made minimal (a farthest victim not needed to fit is kept), and the ``"auto"`` policy
returns the cheaper of the ``"belady"`` and ``"static"`` plans.

Source: PatrickStar (Fang et al. 2021) and ColossalAI Gemini's ``AutoPlacementPolicy`` (warm-up
memory tracer, next-use eviction, ``steady_cuda_cap_ratio``) and ``GeminiOptimizer`` (optimizer
state on the device only in the memory margin the step leaves free).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, PlacementBudgetError

__all__ = ["POLICIES", "PlacementPlan", "StepSchedule", "plan_placement"]


@dataclass(frozen=True)
class StepSchedule:
    """One step of a cyclic schedule: the moves before each of its ``T`` accesses.

    Attributes:
        resident_at_start: chunk indices on the device at the step boundary, before access 0's moves
            (the previous step's end), ascending.
        evict: per access, the chunks to move device→host before it (ascending).
        prefetch: per access, the chunks to move host→device before it (ascending).
        device_bytes: per access, bytes of the chunks on the device during that access.
        h2d_bytes: host→device bytes of the step (sum of the prefetched chunks' sizes).
        d2h_bytes: device→host bytes of the step (sum of the evicted chunks' sizes).
    """

    resident_at_start: tuple[int, ...]
    evict: tuple[tuple[int, ...], ...]
    prefetch: tuple[tuple[int, ...], ...]
    device_bytes: tuple[int, ...]
    h2d_bytes: int
    d2h_bytes: int

    @property
    def bytes_moved(self) -> int:
        """Host→device plus device→host bytes of the step."""
        return self.h2d_bytes + self.d2h_bytes


@dataclass(frozen=True)
class PlacementPlan:
    """A steady-state placement: the cycle of step schedules a backend applies, step ``k`` using
    ``plan.step(k)``, plus where the optimizer state lives.

    Attributes:
        policy: ``"belady"`` or ``"static"``: which rule produced the schedule.
        budget_bytes: the device budget the plan respects at every access.
        steps: the cycle; to enter it, move chunks until the device holds ``steps[0].resident_at_start``.
        exact_cycle: ``False`` only if the ``"belady"`` rule found no repeat within ``max_steps`` and
            closed its last step on itself instead (still feasible, possibly more bytes).
        margin_bytes: device bytes left free at every access of the cycle:
            ``budget - max_t(device_bytes[t] + non_model_bytes[t])``.
        optim_host: trainable chunks (``optim_state_bytes > 0``) whose master, gradient and optimizer
            state stay on the host: the first ones in chunk order, all but the longest tail of
            trainable chunks whose optimizer-state bytes together fit in ``margin_bytes``.
        offloaded_prefix: for ``"static"``, how many chunks (first in chunk order) live on the host
            between uses (what ``offload_param_frac`` would offload); ``None`` for ``"belady"``.
    """

    policy: str
    budget_bytes: int
    steps: tuple[StepSchedule, ...]
    exact_cycle: bool
    margin_bytes: int
    optim_host: tuple[int, ...]
    offloaded_prefix: int | None = None

    @property
    def period_steps(self) -> int:
        """Steps in the cycle."""
        return len(self.steps)

    def step(self, k: int) -> StepSchedule:
        """The schedule of step ``k`` (counted from entering the cycle)."""
        return self.steps[k % len(self.steps)]

    @property
    def h2d_bytes_per_step(self) -> float:
        """Host→device bytes per step in steady state (cycle total / period)."""
        return sum(s.h2d_bytes for s in self.steps) / len(self.steps)

    @property
    def d2h_bytes_per_step(self) -> float:
        """Device→host bytes per step in steady state (cycle total / period)."""
        return sum(s.d2h_bytes for s in self.steps) / len(self.steps)

    @property
    def bytes_moved_per_step(self) -> float:
        """Host→device plus device→host bytes per step in steady state."""
        return self.h2d_bytes_per_step + self.d2h_bytes_per_step

    @property
    def optim_host_count(self) -> int:
        """How many chunks keep their optimizer state on the host."""
        return len(self.optim_host)


# ---------------------------------------------------------------------------------------- inputs
def _byte_array(name: str, values, length: int | None = None) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 1:
        raise ConfigError(f"{name} must be a 1-D sequence of ints, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise ConfigError(f"{name} must hold ints, got dtype {a.dtype}")
    a = a.astype(np.int64)
    if length is not None and a.size != length:
        raise ConfigError(f"{name} must have {length} entries, got {a.size}")
    if a.size and a.min() < 0:
        i = int(np.argmin(a))
        raise ConfigError(f"{name}[{i}] is {int(a[i])}; must be >= 0")
    return a


def _inputs(chunk_bytes, access_order, non_model_bytes, device_budget_bytes, optim_state_bytes):
    sizes = _byte_array("chunk_bytes", chunk_bytes)
    order = _byte_array("access_order", access_order)
    if order.size and order.max() >= sizes.size:
        i = int(np.argmax(order))
        raise ConfigError(f"access_order[{i}] is chunk {int(order[i])}, but there are {sizes.size} chunks")
    m = _byte_array("non_model_bytes", non_model_bytes, order.size)
    optim = np.zeros_like(sizes)
    if optim_state_bytes is not None:
        optim = _byte_array("optim_state_bytes", optim_state_bytes, sizes.size)
    b = device_budget_bytes
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0:
        raise ConfigError(f"device_budget_bytes must be a non-negative int, got {b!r}")
    need = sizes[order] + m
    if need.size and need.max() > b:
        t = int(np.argmax(need))
        raise PlacementBudgetError(int(b), t, int(order[t]), int(sizes[order[t]]), int(m[t]))
    return sizes, order, m, int(b), optim


def _next_use_gaps(order: np.ndarray) -> np.ndarray:
    """Per access ``t``: accesses until the same chunk is used again, wrapping into the next step
    (``T`` if the chunk is used once per step)."""
    T = order.size
    gaps = np.empty(T, np.int64)
    last: dict[int, int] = {}
    for t in range(2 * T - 1, -1, -1):  # two passes backwards: the second sees the wrap-around
        c = int(order[t % T])
        if t < T:
            gaps[t] = last[c] - t
        last[c] = t
    return gaps


def _victims(candidates: np.ndarray, next_use: np.ndarray, sizes: np.ndarray, need: int) -> list[int]:
    """Chunks to evict to free ``need`` bytes: farthest next use first, until enough is freed; then
    keep back (nearest next use first) any victim the others already cover."""
    order = np.argsort(-next_use, kind="stable")
    freed = np.cumsum(sizes[order])
    taken = order[: int(np.searchsorted(freed, need)) + 1]
    spare = int(freed[taken.size - 1]) - need
    keep = []
    for j in taken[::-1]:
        if sizes[j] <= spare:
            spare -= int(sizes[j])
            keep.append(j)
    return sorted(int(candidates[j]) for j in taken if j not in keep)


# ------------------------------------------------------------------------------------- schedules
def _step(start: set[int], evict, prefetch, sizes) -> StepSchedule:
    """A StepSchedule from its start set and moves, with the device bytes at each access."""
    resident, dev, device_bytes = set(start), int(sizes[list(start)].sum()), []
    for ev, pf in zip(evict, prefetch):
        resident.difference_update(ev)
        resident.update(pf)
        dev += int(sizes[list(pf)].sum()) - int(sizes[list(ev)].sum())
        device_bytes.append(dev)
    return StepSchedule(
        tuple(sorted(start)),
        tuple(tuple(sorted(e)) for e in evict),
        tuple(tuple(sorted(p)) for p in prefetch),
        tuple(device_bytes),
        sum(int(sizes[list(p)].sum()) for p in prefetch),
        sum(int(sizes[list(e)].sum()) for e in evict),
    )


def _closed(sets: Sequence[set[int]], sizes) -> StepSchedule:
    """The period-1 schedule whose device set at access ``t`` is ``sets[t]`` (``sets`` non-empty;
    the set at the last access carries over to the next step)."""
    prev = sets[-1]
    evict, prefetch = [], []
    for cur in sets:
        evict.append(prev - cur)
        prefetch.append(cur - prev)
        prev = cur
    return _step(set(sets[-1]), evict, prefetch, sizes)


def _plan(policy, steps, exact, sizes, m, budget, optim, offloaded_prefix=None) -> PlacementPlan:
    at_rest = int(sizes[list(steps[0].resident_at_start)].sum())  # the peak when there are no accesses
    margin = budget - max((d + int(x) for s in steps for d, x in zip(s.device_bytes, m)), default=at_rest)
    trainable = [int(i) for i in np.flatnonzero(optim > 0)]
    on_device, kept = 0, 0
    for i in reversed(trainable):
        if on_device + int(optim[i]) > margin:
            break
        on_device += int(optim[i])
        kept += 1
    optim_host = tuple(trainable[: len(trainable) - kept])
    return PlacementPlan(policy, budget, tuple(steps), exact, margin, optim_host, offloaded_prefix)


POLICIES = ("auto", "belady", "static")
"""The rules :func:`plan_placement` knows."""


def plan_placement(
    chunk_bytes: Sequence[int],
    access_order: Sequence[int],
    non_model_bytes: Sequence[int],
    device_budget_bytes: int,
    *,
    policy: str = "auto",
    optim_state_bytes: Sequence[int] | None = None,
    max_steps: int | None = None,
) -> PlacementPlan:
    """The steady-state placement of a cyclic trace under a device budget.

    Policies:
        ``"belady"``: at each access the accessed chunk is prefetched if it is not on the device;
        then, if the device bytes plus the access's non-model memory exceed the budget, the chunks
        (other than the accessed one) whose next use is farthest away, across the step boundary, are
        evicted until it fits, keeping back a victim the later ones already cover (a no-op for equal
        sizes). Steps are simulated from an empty device until the device set at a step boundary
        repeats; the repeating steps are the plan.

        ``"static"``: the first ``k`` chunks in chunk order live on the host, the others stay on the
        device for good; an offloaded chunk is moved to the device before an access to it and back
        before the next access to another chunk (consecutive accesses to one chunk, also across the
        step boundary, move it once). ``k`` (``offloaded_prefix``) is the smallest for which every
        access fits and the resident chunks alone fit: a static ``offload_param_frac`` sized to the
        budget.

        ``"auto"`` (Gemini's ``auto``): the ``"belady"`` plan, unless the ``"static"`` plan moves
        fewer bytes per step (possible only with unequal chunk sizes); never more than ``"static"``.

    Args:
        chunk_bytes: shape ``(n,)`` ints: bytes each chunk occupies on the device when present.
        access_order: shape ``(T,)`` chunk indices in ``[0, n)``, one per access, repeats allowed.
        non_model_bytes: shape ``(T,)`` ints: non-model memory (bytes) alive at each access.
        device_budget_bytes: device bytes available to chunks plus non-model memory.
        policy: one of :data:`POLICIES`.
        optim_state_bytes: shape ``(n,)`` ints: bytes of each chunk's master, gradient and optimizer
            state on the device (0 for a frozen chunk); decides :attr:`PlacementPlan.optim_host`.
        max_steps: steps ``"belady"`` simulates before giving up on finding the cycle (default
            ``4n + 16``); then its last step is closed on itself and ``exact_cycle`` is ``False``.

    Raises:
        PlacementBudgetError: some access's chunk plus its non-model memory exceed the budget (names
            the access, the chunk and both byte counts).
        ConfigError: an unknown policy or malformed inputs (the message names the argument).
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    sizes, order, m, budget, optim = _inputs(
        chunk_bytes, access_order, non_model_bytes, device_budget_bytes, optim_state_bytes
    )
    if max_steps is None:
        max_steps = 4 * sizes.size + 16
    if isinstance(max_steps, bool) or not isinstance(max_steps, numbers.Integral) or max_steps < 1:
        raise ConfigError(f"max_steps must be a positive int, got {max_steps!r}")
    if policy == "static":
        return _static(sizes, order, m, budget, optim)
    opt = _belady(sizes, order, m, budget, optim, int(max_steps))
    if policy == "belady":
        return opt
    static = _static(sizes, order, m, budget, optim)
    return static if static.bytes_moved_per_step < opt.bytes_moved_per_step else opt


def _belady(sizes, order, m, budget, optim, max_steps) -> PlacementPlan:
    n, T = sizes.size, order.size
    gaps = _next_use_gaps(order)
    resident = np.zeros(n, bool)
    next_use = np.zeros(n, np.int64)
    dev = 0
    seen: dict[frozenset[int], int] = {}
    starts, moves = [], []
    for k in range(max_steps + 1):
        state = frozenset(int(i) for i in np.flatnonzero(resident))
        if state in seen:
            first = seen[state]
            steps = [_step(set(s), *mv, sizes) for s, mv in zip(starts[first:], moves[first:])]
            return _plan("belady", steps, True, sizes, m, budget, optim)
        if k == max_steps:
            break
        seen[state] = k
        starts.append(state)
        evict, prefetch = [], []
        for t in range(T):
            c = int(order[t])
            pf: list[int] = []
            if not resident[c]:
                resident[c] = True
                dev += int(sizes[c])
                pf = [c]
            next_use[c] = k * T + t + gaps[t]
            need = dev + int(m[t]) - budget
            ev: list[int] = []
            if need > 0:
                resident[c] = False
                cand = np.flatnonzero(resident)
                resident[c] = True
                ev = _victims(cand, next_use[cand], sizes[cand], need)
                resident[ev] = False
                dev -= int(sizes[ev].sum())
            evict.append(ev)
            prefetch.append(pf)
        moves.append((evict, prefetch))
    # no repeat within max_steps: close the last step on itself (period 1)
    resident_sets, cur = [], set(starts[-1])
    for ev, pf in zip(*moves[-1]):
        cur = (cur - set(ev)) | set(pf)
        resident_sets.append(cur)
    return _plan("belady", [_closed(resident_sets, sizes)], False, sizes, m, budget, optim)


def _static(sizes, order, m, budget, optim) -> PlacementPlan:
    n = sizes.size
    kept_bytes = np.concatenate([np.cumsum(sizes[::-1])[::-1], [0]])  # bytes of chunks k.. for k = 0..n
    k = next(
        k
        for k in range(n + 1)
        if kept_bytes[k] <= budget and bool(np.all(kept_bytes[k] + np.where(order < k, sizes[order], 0) + m <= budget))
    )
    fixed = set(range(k, n))
    sets = [fixed | {int(c)} for c in order]
    step = _closed(sets, sizes) if sets else _step(fixed, (), (), sizes)
    return _plan("static", [step], True, sizes, m, budget, optim, k)
