"""Property tests of ChunkLayout over random tensor lists and world sizes 1-8."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkzero import ChunkLayout, ConfigError, LayoutError, TensorSpec
from chunkzero.search import packing_stats

from .strategies import chunk_sizes, spec_lists, world_sizes

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_layout(layout: ChunkLayout, specs: list[TensorSpec]) -> None:
    """Every invariant DESIGN.md §2-3 states for a layout."""
    W = layout.world_size
    # every tensor (and alias) in exactly one chunk
    listed = [n for c in layout.chunks for n in c.tensor_names]
    assert sorted(listed) == sorted(s.name for s in specs)
    assert layout.names == tuple(s.name for s in specs)
    for s in specs:
        t = layout.tensor(s.name)
        assert (t.shape, t.dtype, t.aliases, t.requires_grad) == (s.shape, s.dtype, s.aliases, s.requires_grad)
        assert s.name in layout.chunks[t.chunk].tensor_names
        for a in s.aliases:
            assert layout.tensor(a) is t

    for c in layout.chunks:
        members = layout.chunk_tensors(c.index)
        # no overlap, packed back to back from 0, one dtype / requires_grad per chunk
        pos = 0
        for t in members:
            assert t.offset == pos and t.dtype == c.dtype and t.requires_grad == c.requires_grad
            pos = t.end
        assert pos == c.utilized <= c.size
        assert c.padding == c.size - c.utilized >= 0
        if c.utilized > layout.chunk_size:  # only a lone tensor may exceed the packing capacity
            assert len([t for t in members if t.numel]) == 1
        if c.keep_gathered:
            assert c.size == max(c.utilized, 1)
            for r in range(W):
                assert layout.shard_range(c.index, r) == (0, c.size)
                assert layout.valid_length(c.index, r) == c.utilized
            continue
        # sharded: size a multiple of W, padding < W, equal shards covering the chunk
        assert c.size % W == 0 and c.padding < W or (c.utilized == 0 and c.size == W)
        shard = layout.shard_numel(c.index)
        assert shard * W == c.size
        ranges = [layout.shard_range(c.index, r) for r in range(W)]
        assert ranges[0][0] == 0 and ranges[-1][1] == c.size
        assert all(b - a == shard for a, b in ranges)
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(W - 1))
        assert sum(layout.valid_length(c.index, r) for r in range(W)) == c.utilized

    for t in layout.tensors:
        c = layout.chunks[t.chunk]
        owned = [layout.owned_range(t.name, r) for r in range(W)]
        if c.keep_gathered:
            assert owned == [(0, t.numel)] * W
            continue
        # owned ranges partition the flattened tensor, in rank order
        nonempty = [(a, b) for a, b in owned if b > a]
        assert all(0 <= a <= b <= t.numel for a, b in owned)
        assert sum(b - a for a, b in owned) == t.numel
        if nonempty:
            assert nonempty[0][0] == 0 and nonempty[-1][1] == t.numel
            assert all(nonempty[i][1] == nonempty[i + 1][0] for i in range(len(nonempty) - 1))
        # owned range agrees with the shard range in chunk coordinates
        for r, (a, b) in enumerate(owned):
            s0, s1 = layout.shard_range(t.chunk, r)
            if b > a:
                assert s0 <= t.offset + a and t.offset + b <= s1

    # shard_pieces: the tensor pieces of each shard, consistent with owned_range and valid_length
    for c in layout.chunks:
        for r in range(W):
            pieces = layout.shard_pieces(c.index, r)
            assert sum(b - a for _, a, b, _ in pieces) == layout.valid_length(c.index, r)
            shard = layout.shard_numel(c.index)
            prev_end = 0
            for t, a, b, off in pieces:
                assert (a, b) == layout.owned_range(t.name, r) and b > a
                assert off == t.offset + a - layout.shard_range(c.index, r)[0]
                assert prev_end <= off and off + (b - a) <= shard
                prev_end = off + (b - a)

    assert layout.utilized_numel == sum(s.numel for s in specs)
    assert layout.total_numel == layout.utilized_numel + layout.padding_numel


@PROPS
@given(spec_lists(), chunk_sizes, world_sizes, st.sampled_from([0, 0, 5, 200]))
def test_layout_invariants(specs, chunk_size, world_size, keep_below):
    layout = ChunkLayout.build(specs, chunk_size, world_size, keep_gathered_below_numel=keep_below)
    check_layout(layout, specs)


@PROPS
@given(spec_lists(), chunk_sizes, world_sizes)
def test_greedy_in_order_packing(specs, chunk_size, world_size):
    """Within a (dtype, requires_grad, keep_gathered) group, tensors go in order into the open chunk
    while they fit; a tensor over the capacity has its own chunk and leaves the open one open. The
    search's yardstick reproduces the packing exactly."""
    layout = ChunkLayout.build(specs, chunk_size, world_size)
    open_chunk: dict[tuple, int] = {}
    fill: dict[int, int] = {}
    for s in specs:
        t = layout.tensor(s.name)
        key = (s.dtype, s.requires_grad, s.keep_gathered)
        if s.numel > chunk_size:
            assert layout.chunks[t.chunk].tensor_names == (s.name,)
            continue
        cur = open_chunk.get(key)
        if cur is not None and fill[cur] + s.numel <= chunk_size:
            assert t.chunk == cur
        else:
            assert t.chunk != cur and t.offset == 0
            open_chunk[key] = t.chunk
        fill[t.chunk] = t.end
    stats = packing_stats(specs, chunk_size, world_size)
    assert stats.num_chunks == len(layout.chunks)
    assert stats.padding_numel == layout.padding_numel
    assert stats.total_numel == layout.utilized_numel
    packed = [c for c in layout.chunks if not (len(c.tensor_names) == 1 and c.utilized > chunk_size)]
    assert stats.wasted_numel == sum(chunk_size - c.utilized for c in packed)


@PROPS
@given(spec_lists(), chunk_sizes, world_sizes, st.booleans())
def test_json_round_trip_is_identity(specs, chunk_size, world_size, indent):
    layout = ChunkLayout.build(specs, chunk_size, world_size, keep_gathered_below_numel=7)
    text = layout.to_json(indent=2 if indent else None)
    again = ChunkLayout.from_json(text)
    assert again == layout
    assert again.to_json() == layout.to_json()
    assert [c.tensor_names for c in again.chunks] == [c.tensor_names for c in layout.chunks]
    assert again.tensors == layout.tensors and again.chunks == layout.chunks
    assert ChunkLayout.from_json(text.encode()) == layout
    assert json.loads(text)["version"] == 1


@PROPS
@given(spec_lists(), chunk_sizes, world_sizes, world_sizes)
def test_relayout_keeps_chunk_and_offset(specs, chunk_size, w1, w2):
    layout = ChunkLayout.build(specs, chunk_size, w1)
    moved = layout.relayout(w2)
    assert moved.world_size == w2 and moved.chunk_size == layout.chunk_size
    assert moved.tensors == layout.tensors  # chunk, offset, shape, dtype unchanged
    for a, b in zip(layout.chunks, moved.chunks):
        assert (a.index, a.dtype, a.utilized, a.keep_gathered, a.requires_grad, a.tensor_names) == (
            b.index, b.dtype, b.utilized, b.keep_gathered, b.requires_grad, b.tensor_names)
        if not a.keep_gathered:
            assert b.size % w2 == 0 and b.size - b.utilized < w2 or (b.utilized == 0 and b.size == w2)
        else:
            assert b.size == a.size
    check_layout(moved, specs)
    assert moved.relayout(w1) == layout
    # the same packing as building directly at w2
    assert moved == ChunkLayout.build(specs, chunk_size, w2)


def test_small_example_by_hand():
    """W=3, capacity 10: [a(6), b(4)] fill chunk 0 exactly; c(12) is too big and gets chunk 1;
    d(0-d, 1 element) opens chunk 2 after the full chunk 0."""
    specs = [
        TensorSpec("a", (2, 3)), TensorSpec("b", (4,), aliases=("b_tied",)),
        TensorSpec("c", (12,)), TensorSpec("d", ()),
    ]
    L = ChunkLayout.build(specs, 10, 3)
    assert [(c.size, c.utilized, c.tensor_names) for c in L.chunks] == [
        (12, 10, ("a", "b")), (12, 12, ("c",)), (3, 1, ("d",))]
    assert [L.shard_range(0, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert [L.valid_length(0, r) for r in range(3)] == [4, 4, 2]
    assert [L.owned_range("a", r) for r in range(3)] == [(0, 4), (4, 6), (6, 6)]
    assert [L.owned_range("b_tied", r) for r in range(3)] == [(0, 0), (0, 2), (2, 4)]
    assert [(t.name, a, b, off) for t, a, b, off in L.shard_pieces(0, 1)] == [("a", 4, 6, 0), ("b", 0, 2, 2)]
    assert L.padding_numel == 2 + 0 + 2
    assert L.tensor("b_tied") is L.tensor("b")


def test_build_rejects_bad_input():
    with pytest.raises(LayoutError, match="'w'"):
        ChunkLayout.build([TensorSpec("w", (2,)), TensorSpec("v", (2,), aliases=("w",))], 4, 1)
    with pytest.raises(ConfigError, match="chunk_size"):
        ChunkLayout.build([TensorSpec("w", (2,))], 0, 1)
    with pytest.raises(ConfigError, match="world_size"):
        ChunkLayout.build([TensorSpec("w", (2,))], 4, 0)
    with pytest.raises(ConfigError, match="TensorSpec"):
        ChunkLayout.build([("w", (2,))], 4, 1)
    for bad in ("ab", 5, [2.5], None, (-1, 2)):
        with pytest.raises(ConfigError, match="'w'"):
            TensorSpec("w", bad)
    with pytest.raises(ConfigError, match="aliases"):
        TensorSpec("w", (2,), aliases="lm_head.weight")
    with pytest.raises(ConfigError, match="dtype"):
        TensorSpec("w", (2,), "complex64")
    with pytest.raises(ConfigError):
        TensorSpec("", (2,))
    L = ChunkLayout.build([TensorSpec("w", (2,))], 4, 2)
    with pytest.raises(ConfigError, match="rank 2"):
        L.shard_range(0, 2)
    with pytest.raises(KeyError, match="'nope'"):
        L.tensor("nope")
