"""Placement decisions: ChunkPlacement, Gemini's static policy, and the trace-driven auto policy
(Belady's OPT) checked against brute force over every schedule on small cases."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chunkzero.placement_auto as pa
from chunkzero import ChunkLayout, ConfigError, PlacementBudgetError, TensorSpec
from chunkzero.placement import ChunkPlacement, Location, chunk_placements, offload_count, static_placement
from chunkzero.placement_auto import POLICIES, plan_placement

from .strategies import spec_lists


def belady_plan(*args, **kwargs):
    return plan_placement(*args, policy="belady", **kwargs)


def static_plan(*args, **kwargs):
    return plan_placement(*args, policy="static", **kwargs)


auto_placement = plan_placement  # policy="auto" is the default

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ ChunkPlacement
def test_chunk_placement_fields_and_properties():
    p = ChunkPlacement(3, "host", "host", "host", "host")
    assert p.param is Location.HOST and p.param == "host"
    assert p.trainable and p.param_offloaded and p.optim_offloaded
    assert p.tensors_on("device") == () and p.tensors_on(Location.HOST) == ("param", "master", "grad", "optim_state")
    frozen = ChunkPlacement(0, Location.DEVICE)
    assert not frozen.trainable and not frozen.param_offloaded and not frozen.optim_offloaded
    assert frozen.tensors_on("device") == ("param",) and frozen.tensors_on("host") == ()


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, "gpu"), "chunk 0 param must be one of"),
        ((0, "device", "host", None, "host"), "all be None"),
        ((1, "device", "host", "disk", "host"), "chunk 1 grad must be one of"),
        ((-1, "device"), "non-negative int"),
        ((True, "device"), "non-negative int"),
    ],
)
def test_chunk_placement_rejects_bad_fields(args, match):
    with pytest.raises(ConfigError, match=match):
        ChunkPlacement(*args)


# ------------------------------------------------------------------ static policy
@pytest.mark.parametrize(
    "frac, n, expected",
    [
        (0.0, 5, 0),
        (1e-6, 5, 1),
        (0.2, 5, 1),
        (0.21, 5, 2),
        (0.5, 3, 2),
        (1 / 3, 3, 1),
        (0.55, 100, 55),
        (1.0, 4, 4),
        (0.5, 0, 0),
    ],
)
def test_offload_count_rounds_up_without_float_noise(frac, n, expected):
    assert offload_count(frac, n) == expected


def _layout():
    # chunk order: trainable fp32 chunks, a frozen chunk, then a keep-gathered chunk
    specs = [TensorSpec(f"w{i}", (8,)) for i in range(6)]
    specs += [TensorSpec("frozen", (8,), requires_grad=False), TensorSpec("norm", (4,), keep_gathered=True)]
    return ChunkLayout.build(specs, chunk_size=8, world_size=2)


def test_static_placement_rounding_and_implications():
    layout = _layout()
    kinds = [(c.requires_grad, c.keep_gathered) for c in layout.chunks]
    assert kinds == [(True, False)] * 6 + [(False, False), (True, True)]
    placements = static_placement(layout.chunks, offload_optim_frac=0.25, offload_param_frac=0.5)
    assert [p.index for p in placements] == list(range(8))
    # optim: ceil(0.25 * 7 trainable) = 2 -> chunks 0, 1; param: ceil(0.5 * 7 sharded) = 4 -> chunks 0..3,
    # whose master, gradient and optimizer state follow them to the host
    assert [p.index for p in placements if p.param_offloaded] == [0, 1, 2, 3]
    assert [p.index for p in placements if p.optim_offloaded] == [0, 1, 2, 3]
    assert all(p.master is p.grad is p.optim_state for p in placements if p.trainable)
    frozen, kept = placements[6], placements[7]
    assert (frozen.master, frozen.grad, frozen.optim_state) == (None, None, None)
    assert kept.param is Location.DEVICE  # keep-gathered chunks are never param-offloaded
    everything = static_placement(layout.chunks, offload_optim_frac=1.0, offload_param_frac=1.0)
    assert [p.index for p in everything if not p.param_offloaded] == [7]
    assert all(p.optim_offloaded for p in everything if p.trainable)
    assert all(not p.param_offloaded and not p.optim_offloaded for p in static_placement(layout.chunks))


def test_static_placement_optim_only_keeps_params_on_device():
    placements = static_placement(_layout().chunks, offload_optim_frac=0.5)
    assert [p.index for p in placements if p.optim_offloaded] == [0, 1, 2, 3]  # ceil(3.5)
    assert not any(p.param_offloaded for p in placements)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.5", True, None])
@pytest.mark.parametrize("name", ["offload_optim_frac", "offload_param_frac"])
def test_static_placement_rejects_bad_fractions(name, bad):
    with pytest.raises(ConfigError, match=rf"{name} must be a number in \[0, 1\], got {bad!r}"):
        static_placement(_layout().chunks, **{name: bad})


@PROPS
@given(spec_lists(), st.integers(0, 20), st.integers(0, 20), st.integers(1, 4))
def test_static_placement_matches_the_rule(specs, optim_twentieths, param_twentieths, world_size):
    """Fractions in twentieths, so the reference can round up exactly (``Fraction``)."""
    chunks = ChunkLayout.build(specs, 64, world_size).chunks
    placements = static_placement(
        chunks, offload_optim_frac=optim_twentieths / 20, offload_param_frac=param_twentieths / 20
    )
    trainable = [c.index for c in chunks if c.requires_grad]
    sharded = [c.index for c in chunks if not c.keep_gathered]
    param_host = set(sharded[: math.ceil(Fraction(param_twentieths, 20) * len(sharded))])
    optim_host = set(trainable[: math.ceil(Fraction(optim_twentieths, 20) * len(trainable))])
    optim_host |= param_host & set(trainable)
    assert {p.index for p in placements if p.param_offloaded} == param_host
    assert {p.index for p in placements if p.optim_offloaded} == optim_host
    assert {p.index for p in placements if p.trainable} == set(trainable)


def test_chunk_placements_rejects_unknown_and_frozen_indices():
    chunks = _layout().chunks
    with pytest.raises(ConfigError, match="param_host names chunk 9"):
        chunk_placements(chunks, param_host=[9])
    with pytest.raises(ConfigError, match="chunk 6, which is frozen"):
        chunk_placements(chunks, optim_host=[6])
    with pytest.raises(ConfigError, match="chunk index 0 appears twice"):
        static_placement([chunks[0], chunks[0]])


# ------------------------------------------------------------------ auto policy: references
def replay(plan, sizes, order, m, budget):
    """Apply the plan's moves independently; check feasibility and its byte counts; return bytes/step."""
    end = set(plan.steps[-1].resident_at_start)
    total = 0
    for j, s in enumerate(plan.steps):
        if j and set(s.resident_at_start) != end:
            raise AssertionError(f"step {j} does not start where step {j - 1} ended")
        resident = set(s.resident_at_start)
        if j == 0:
            resident_first = set(resident)
        h2d = d2h = 0
        for t, c in enumerate(order):
            ev, pf = set(s.evict[t]), set(s.prefetch[t])
            assert ev <= resident and not pf & resident, (
                f"step {j} access {t}: evicts a missing or prefetches a present chunk"
            )
            resident = (resident - ev) | pf
            h2d += sum(sizes[i] for i in pf)
            d2h += sum(sizes[i] for i in ev)
            dev = sum(sizes[i] for i in resident)
            assert c in resident, f"step {j} access {t}: chunk {c} is not on the device"
            assert dev == s.device_bytes[t] and dev + m[t] <= budget, f"step {j} access {t}: {dev} + {m[t]} > {budget}"
        assert (h2d, d2h) == (s.h2d_bytes, s.d2h_bytes)
        total += h2d + d2h
        end = resident
    assert end == resident_first, "the cycle does not close"
    return total / len(plan.steps)


def brute_force_bytes(sizes, order, m, budget, period=1):
    """Fewest bytes per step of any schedule that repeats every ``period`` steps: a shortest cycle
    through the feasible device sets (every subset of chunks) at each access, a move between two
    sets costing the bytes of their symmetric difference. Any prefetch or eviction is allowed."""
    n, order, m = len(sizes), list(order) * period, list(m) * period
    if not order:
        return 0.0
    subsets = np.arange(1 << n)
    set_bytes = np.array([sum(sizes[i] for i in range(n) if s >> i & 1) for s in subsets], np.float64)
    move = set_bytes[subsets[:, None] ^ subsets[None, :]]
    feasible = [((subsets >> c) & 1).astype(bool) & (set_bytes + x <= budget) for c, x in zip(order, m)]
    dist = np.where(np.diag(feasible[0]), 0.0, np.inf)  # dist[first set, current set]
    for ok in feasible[1:]:
        dist = (dist[:, :, None] + move[None]).min(axis=1)
        dist[:, ~ok] = np.inf
    return float((dist + move.T).min()) / period


@st.composite
def traces(draw, equal_sizes=None, max_chunks=5, max_accesses=7, max_size=8):
    n = draw(st.integers(1, max_chunks))
    equal = draw(st.booleans()) if equal_sizes is None else equal_sizes
    size = st.integers(1, max_size) if equal else st.integers(0, max_size)
    sizes = [draw(size)] * n if equal else draw(st.lists(size, min_size=n, max_size=n))
    order = draw(st.lists(st.integers(0, n - 1), max_size=max_accesses))
    m = draw(st.lists(st.integers(0, 4), min_size=len(order), max_size=len(order)))
    low = max([sizes[c] + x for c, x in zip(order, m)], default=0)
    budget = draw(st.integers(low, max(low, sum(sizes) + max(m, default=0) + 1)))
    return sizes, order, m, budget


# ------------------------------------------------------------------ auto policy: optimality
@PROPS
@given(traces(equal_sizes=True))
def test_belady_moves_no_more_bytes_than_any_schedule_for_equal_chunk_sizes(case):
    """The property proved: with equal chunk sizes, Belady's steady-state bytes per step are at most
    those of every schedule that repeats every step or every two steps (brute force over all device
    sets), and equal to the best schedule of its own period."""
    plan = belady_plan(*case)
    got = replay(plan, *case)
    assert got == plan.bytes_moved_per_step
    for period in (1, 2):
        assert got <= brute_force_bytes(*case, period=period) + 1e-9
    if plan.period_steps <= 3:
        assert got == pytest.approx(brute_force_bytes(*case, period=plan.period_steps))


def test_belady_is_not_optimal_for_unequal_sizes_and_auto_falls_back_to_static():
    """Two 2-byte chunks and an 8-byte one, budget 10: farthest-next-use sometimes evicts the big
    chunk; keeping it and cycling the small ones (the static prefix) moves 8 bytes per step."""
    case = ([2, 2, 8], [0, 1, 2], [0, 0, 0], 10)
    assert brute_force_bytes(*case) == 8.0
    assert replay(belady_plan(*case), *case) == 12.0
    auto = auto_placement(*case)
    assert auto.policy == "static" and auto.offloaded_prefix == 2 and replay(auto, *case) == 8.0


@PROPS
@given(traces(max_chunks=9, max_accesses=30))
def test_auto_is_feasible_and_moves_no_more_than_static(case):
    auto, static = auto_placement(*case), static_plan(*case)
    assert replay(auto, *case) <= replay(static, *case)
    assert replay(belady_plan(*case), *case) <= replay(static, *case) or len(set(case[0])) > 1


@PROPS
@given(st.integers(2, 12), st.data())
def test_forward_backward_trace_meets_the_lower_bound(n, data):
    """Forward 0..n-1 then backward n-1..0 with room for k of n equal chunks: each pass must fetch
    the n - k chunks absent at its start, so 2(n - k) fetches and as many evictions per step is a lower
    bound; Belady meets it, and the static prefix at the same budget moves strictly more for k >= 2."""
    k, size = data.draw(st.integers(1, n - 1)), data.draw(st.integers(1, 1000))
    order = [*range(n), *reversed(range(n))]
    case = ([size] * n, order, [0] * len(order), k * size)
    plan = belady_plan(*case)
    assert plan.period_steps == 1 and replay(plan, *case) == 4 * size * (n - k)
    static = replay(static_plan(*case), *case)
    assert static > 4 * size * (n - k) if k >= 2 else static == 4 * size * (n - k)


@pytest.mark.parametrize("n, k", [(5, 2), (7, 3), (10, 9)])
def test_cyclic_scan_has_a_multi_step_cycle(n, k):
    """A loop over n unit chunks with k slots: OPT misses (n - k)/(n - 1) of the accesses in steady
    state, which no single-step schedule achieves; the cycle is n - 1 steps long."""
    case = ([1] * n, list(range(n)), [0] * n, k)
    plan = belady_plan(*case)
    assert plan.period_steps == n - 1 and plan.exact_cycle
    assert replay(plan, *case) == pytest.approx(2 * n * (n - k) / (n - 1))
    assert plan.bytes_moved_per_step < brute_force_bytes(*case) if n <= 7 else True


def test_max_steps_closes_the_last_step_when_no_cycle_is_found():
    case = ([1] * 6, list(range(6)), [0] * 6, 3)
    plan = belady_plan(*case, max_steps=2)
    assert not plan.exact_cycle and plan.period_steps == 1
    assert replay(plan, *case) >= belady_plan(*case).bytes_moved_per_step


# ------------------------------------------------------------------ mutants that must fail
FORWARD_BACKWARD = ([4, 4, 4], [0, 1, 2, 2, 1, 0], [0] * 6, 8)


def test_mutant_nearest_next_use_moves_more(monkeypatch):
    opt = replay(belady_plan(*FORWARD_BACKWARD), *FORWARD_BACKWARD)
    assert opt == brute_force_bytes(*FORWARD_BACKWARD) == 16
    real = pa._victims
    monkeypatch.setattr(pa, "_victims", lambda cand, nu, sizes, need: real(cand, -nu, sizes, need))
    assert replay(belady_plan(*FORWARD_BACKWARD), *FORWARD_BACKWARD) > opt


def test_mutant_without_wraparound_moves_more(monkeypatch):
    """Looking only to the end of the step (every chunk is 'never used again' after its last access)
    throws away the chunks the next step's forward needs first."""
    opt = replay(belady_plan(*FORWARD_BACKWARD), *FORWARD_BACKWARD)
    real = pa._next_use_gaps

    def no_wrap(order):
        gaps = real(order)
        return np.where(np.arange(len(order)) + gaps >= len(order), 10**9, gaps)

    monkeypatch.setattr(pa, "_next_use_gaps", no_wrap)
    assert replay(belady_plan(*FORWARD_BACKWARD), *FORWARD_BACKWARD) > opt


def test_mutant_without_minimal_victims_moves_more(monkeypatch):
    case = ([6, 2, 6], [0, 1, 2], [0, 0, 1], 10)
    opt = replay(belady_plan(*case), *case)

    def all_taken(cand, nu, sizes, need):
        order = np.argsort(-nu, kind="stable")
        return sorted(int(cand[j]) for j in order[: int(np.searchsorted(np.cumsum(sizes[order]), need)) + 1])

    monkeypatch.setattr(pa, "_victims", all_taken)
    assert replay(belady_plan(*case), *case) > opt


def test_replay_catches_a_plan_that_ignores_non_model_memory():
    sizes, order, m, budget = [4, 4, 4], [0, 1, 2, 2, 1, 0], [0, 0, 4, 4, 0, 0], 12
    blind = belady_plan(sizes, order, [0] * 6, budget)
    with pytest.raises(AssertionError, match="> 12"):
        replay(blind, sizes, order, m, budget)
    replay(belady_plan(sizes, order, m, budget), sizes, order, m, budget)


# ------------------------------------------------------------------ optimizer state, limits, inputs
def test_optimizer_state_fills_the_margin_from_the_last_chunk():
    sizes, order, m = [4, 4, 4], [0, 1, 2, 2, 1, 0], [0, 1, 2, 2, 1, 0]
    plan = belady_plan(sizes, order, m, 16, optim_state_bytes=[1, 1, 1])
    assert plan.margin_bytes == 16 - (12 + 2) and plan.optim_host == (0,) and plan.optim_host_count == 1
    plan = belady_plan(sizes, order, m, 16, optim_state_bytes=[0, 3, 1])  # chunk 0 frozen; 3 + 1 > 2
    assert plan.optim_host == (1,)
    tight = belady_plan(sizes, order, m, 8, optim_state_bytes=[1, 1, 1])
    assert tight.margin_bytes == 0 and tight.optim_host == (0, 1, 2)
    assert belady_plan(sizes, order, m, 16).optim_host == ()


def test_budget_below_one_chunk_plus_its_activations_names_both_numbers():
    sizes, order, m = [100, 300, 200], [0, 1, 2, 2, 1, 0], [0, 50, 400, 400, 50, 0]
    assert replay(belady_plan(sizes, order, m, 600), sizes, order, m, 600) > 0  # 200 + 400 fits exactly
    message = (
        "599 bytes is too small for access 2 .chunk 2.: the chunk needs 200 bytes and the non-model memory "
        "at that access is 400 bytes"
    )
    for policy in POLICIES:
        with pytest.raises(PlacementBudgetError, match=message) as err:
            plan_placement(sizes, order, m, 599, policy=policy)
        assert (err.value.access, err.value.chunk_bytes, err.value.non_model_bytes) == (2, 200, 400)


@pytest.mark.parametrize(
    "args, match",
    [
        (([4, 4], [0, 2], [0, 0], 8), r"access_order\[1\] is chunk 2, but there are 2 chunks"),
        (([4, -4], [0], [0], 8), r"chunk_bytes\[1\] is -4"),
        (([4, 4], [0, 1], [0], 8), "non_model_bytes must have 2 entries"),
        (([4.5, 4], [0], [0], 8), "chunk_bytes must hold ints"),
        (([4, 4], [0], [0], 8.0), "device_budget_bytes must be a non-negative int"),
        (([[4, 4]], [0], [0], 8), "chunk_bytes must be a 1-D sequence"),
        (([4, 4], [0], [0], 8, "opt"), r"policy must be one of \['auto', 'belady', 'static'\], got 'opt'"),
        (([4, 4], [0], [0], 8, "belady", None, 0), "max_steps must be a positive int, got 0"),
    ],
)
def test_auto_rejects_bad_inputs(args, match):
    names = (
        "chunk_bytes",
        "access_order",
        "non_model_bytes",
        "device_budget_bytes",
        "policy",
        "optim_state_bytes",
        "max_steps",
    )
    with pytest.raises(ConfigError, match=match):
        plan_placement(*args[:4], **dict(zip(names[4:], args[4:])))


def test_empty_trace_moves_nothing():
    assert belady_plan([4, 4], [], [], 4).bytes_moved_per_step == 0
    static = static_plan([4, 4], [], [], 4)
    assert (
        static.offloaded_prefix == 1 and static.steps[0].resident_at_start == (1,) and static.bytes_moved_per_step == 0
    )
