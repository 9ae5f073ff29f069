"""The pinned arena (torch_backend/zero/pinned.py), with pinning off (pageable slabs): its slices cover
the requests, do not overlap, are aligned, are reused only after the recorded events are waited for,
and hold at most a small fraction more than they use where per-buffer power-of-two blocks hold up to
twice; ZeroDDP's memory_report gives the arena's bytes."""

import gc

import pytest
import torch

from torch_backend.zero import collectives
from torch_backend.zero.pinned import ALIGNMENT_BYTES, PinnedArena, host_arena, pinned_block_bytes

MiB = 2**20


def _pageable(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8), nbytes


def _ranges(tensors):
    return sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)


def test_slices_cover_the_requests_do_not_overlap_and_are_aligned():
    arena = PinnedArena(_pageable, slab_bytes=MiB)
    requests = [(1000, torch.float32), (3, torch.bfloat16), (300_000, torch.float32), (1, torch.float16),
                (70_000, torch.bfloat16), (5, torch.float64)]
    out = [arena.empty(n, dt) for n, dt in requests]
    for t, (n, dt) in zip(out, requests):
        assert t.shape == (n,) and t.dtype == dt and t.is_contiguous()
    slabs = [(s.ptr, s.ptr + s.nbytes) for s in arena._slabs]
    for a, b in _ranges(out):
        assert any(lo <= a and b <= hi for lo, hi in slabs)
        assert any((a - lo) % ALIGNMENT_BYTES == 0 for lo, hi in slabs if lo <= a < hi)
    r = _ranges(out)
    assert all(r[i][1] <= r[i + 1][0] for i in range(len(r) - 1))  # no overlap
    for i, t in enumerate(out):  # each slice is its own memory: writing one leaves the others
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(out))
    need = sum(
        -(-n * torch.empty(0, dtype=dt).element_size() // ALIGNMENT_BYTES) * ALIGNMENT_BYTES for n, dt in requests
    )
    assert arena.used_bytes == need
    assert arena.held_bytes == sum(s.nbytes for s in arena._slabs)
    assert arena.num_slabs == 3  # one shared 1 MiB slab; exact ones for the 1.2 MB and 140 kB requests
    assert sum(n for _, _, n in arena.slices()) == need


def test_a_request_of_a_slab_or_more_gets_an_exact_slab():
    arena = PinnedArena(_pageable, slab_bytes=MiB)
    t = arena.empty(3 * MiB // 4 + 1, torch.float32)  # 3 MiB + 4 bytes
    assert arena.held_bytes == -(-(3 * MiB + 4) // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
    small = arena.empty(MiB // 32 // 4, torch.float32)  # 1/32 of the slab: shared
    big = arena.empty(MiB // 32 // 4 + 1, torch.float32)  # above 1/32: its own exact slab
    assert arena.num_slabs == 3 and arena.held_bytes == (3 * MiB + 512) + MiB + (MiB // 32 + 512)
    del t
    gc.collect()
    again = arena.empty(3 * MiB // 4 + 1, torch.float32)  # an own slab is reused at its size
    assert arena.num_slabs == 3
    del small, big, again


def test_an_own_slab_rounded_up_by_the_allocator_is_reused_for_its_request():
    """Where registration fails, a slab is a power-of-two block of torch's host allocator, larger than
    the request: the next request of that size must reuse it, not pile up new slabs."""
    def rounded(nbytes):
        block = pinned_block_bytes(nbytes)
        return torch.empty(block, dtype=torch.uint8), block

    arena = PinnedArena(rounded, slab_bytes=MiB)
    for _ in range(3):
        t = arena.empty(3 * MiB // 4 + 1, torch.float32)  # 3 MiB + 4 bytes in a 4 MiB block
        del t
        gc.collect()
    assert arena.num_slabs == 1 and arena.held_bytes == 4 * MiB


def test_a_freed_range_is_reused_only_after_its_events_are_waited_for():
    log = []
    clock = iter(range(1000))
    arena = PinnedArena(_pageable, slab_bytes=MiB, events=lambda: [("event", next(clock))],
                        wait=lambda e: log.append(("wait", e)))
    a = arena.empty(1000, torch.float32)
    keep = torch.nn.Parameter(arena.empty(1000, torch.float32))  # a Parameter over a slice keeps it
    where = a.data_ptr()
    view = a[10:20]
    del a
    gc.collect()
    assert arena.used_bytes == 2 * 4096  # the view keeps the range
    del view
    gc.collect()
    assert arena.used_bytes == 4096 and log == []
    b = arena.empty(900, torch.float32)
    assert b.data_ptr() == where  # first fit: the freed range
    assert log == [("wait", ("event", 0))]  # ... after the host waited for the event of its free
    assert keep.data_ptr() != where and arena.used_bytes == 2 * 4096


def test_freed_neighbours_coalesce_and_trim_gives_back_unused_slabs():
    arena = PinnedArena(_pageable, slab_bytes=MiB)
    part = MiB // 32  # the largest request a shared slab takes
    parts = [arena.empty(part // 4, torch.float32) for _ in range(32)]  # the whole slab
    assert arena.num_slabs == 1 and arena._slabs[0].free == []
    del parts[2], parts[1]
    gc.collect()
    assert arena._slabs[0].free == [[part, 2 * part, []]]  # the two neighbours are one range
    parts.clear()
    gc.collect()
    assert arena._slabs[0].free == [[0, MiB, []]]
    keep = arena.empty(part // 4, torch.float32)
    extra = arena.empty(MiB, torch.float32)  # an exact slab of its own
    assert arena.num_slabs == 2
    del extra
    gc.collect()
    assert arena.trim() == 4 * MiB and arena.num_slabs == 1 and arena.held_bytes == MiB
    del keep


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="slab_bytes"):
        PinnedArena(_pageable, slab_bytes=1000)
    with pytest.raises(ValueError, match="numel"):
        PinnedArena(_pageable).empty(-1, torch.float32)
    assert PinnedArena(_pageable).empty(0, torch.float32).numel() == 0


# The engine's pinned buffers of a 2.5B Llama-shaped model at W = 2 with everything offloaded: fp32
# master shards and bf16 parameter shards and staging of the searched chunk sizes (8-34M elements),
# scaled down 64x (slab 1 MiB instead of 64 MiB) so the test allocates little; the ratio is scale-free.
SCALE = 64
CHUNK_NUMELS = [9_000_000, 13_500_000, 20_000_000, 28_311_552, 34_000_000]


def _shard_requests(chunk_numel, num_chunks=16, world=2):
    shard = chunk_numel // world // SCALE
    return [(shard, torch.float32), (shard, torch.bfloat16), (shard, torch.bfloat16)] * num_chunks


@pytest.mark.parametrize("chunk_numel", CHUNK_NUMELS)
def test_held_is_within_a_small_fraction_of_what_is_used(chunk_numel):
    requests = _shard_requests(chunk_numel)
    arena = PinnedArena(_pageable, slab_bytes=SLAB)
    keep = [arena.empty(n, dt) for n, dt in requests]
    used = sum(n * torch.empty(0, dtype=dt).element_size() for n, dt in requests)
    assert arena.held_bytes <= _bound(used)
    del keep


SLAB = 64 * MiB // SCALE


def _bound(used):
    return used * (1 + 1 / 32) + SLAB


def test_power_of_two_blocks_per_buffer_break_the_bound():
    """The mutant: each buffer a block of its own from torch's host allocator (the rounding the arena
    removes) exceeds the bound at each of these chunk sizes (none a power of two)."""
    over = 0
    for chunk_numel in CHUNK_NUMELS:
        requests = _shard_requests(chunk_numel)
        sizes = [n * torch.empty(0, dtype=dt).element_size() for n, dt in requests]
        over += sum(pinned_block_bytes(s) for s in sizes) > _bound(sum(sizes))
    assert over == len(CHUNK_NUMELS)


def test_memory_report_gives_the_arenas_bytes():
    """ZeroDDP with a stand-in stream layer (the CPU taken for a device with streams, so the engine
    pins): the report's pinned bytes are the arena's, and its slices are the offloaded masters."""
    from stream_recorder import StreamRecorder

    from torch_backend import ZeroDDP, ZeroOptimizer
    rec = StreamRecorder()
    previous = collectives.set_stream_layer(rec)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        ddp = ZeroDDP(model, chunk_size=1024, offload_optim_frac=1.0)
        opt = ZeroOptimizer(ddp, torch.optim.AdamW, lr=1e-3, eps=1e-6)
        opt.backward(ddp(torch.randn(4, 32)).sum())
        assert opt.step()
        gc.collect()
        report = ddp.memory_report()
        arena = host_arena(torch.device("cpu"), rec)
        assert report.pinned_held_bytes == arena.held_bytes > 0
        assert report.pinned_used_bytes == arena.used_bytes
        masters = [c.master for c in ddp.chunks if c.master is not None]
        assert masters
        # after the step: the masters and, in fp32, their gradients (the staged shard itself)
        held = masters + [m.grad for m in masters]
        assert arena.used_bytes == sum(-(-t.numel() * 4 // ALIGNMENT_BYTES) * ALIGNMENT_BYTES for t in held)
        del held
        opt.zero_grad()
        gc.collect()
        assert ddp.memory_report().pinned_used_bytes == sum(-(-m.numel() * 4 // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
                                                            for m in masters)
        assert "pinned host memory" in str(report)
    finally:
        collectives.set_stream_layer(previous)
