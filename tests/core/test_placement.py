"""Placement decisions: ChunkPlacement and Gemini's static policy."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkzero import ChunkLayout, ConfigError, TensorSpec
from chunkzero.placement import ChunkPlacement, Location, chunk_placements, offload_count, static_placement

from .strategies import spec_lists

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
    [(0.0, 5, 0), (1e-6, 5, 1), (0.2, 5, 1), (0.21, 5, 2), (0.5, 3, 2), (1 / 3, 3, 1), (0.55, 100, 55), (1.0, 4, 4), (0.5, 0, 0)],
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
