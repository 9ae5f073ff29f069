"""A resume reads only what each rank now owns: a checkpoint saved at world size 2 (each shard written
by its own device, as the torch ranks write theirs) is stored in storage blocks, and a rank of world
size 3 reads only the blocks that hold its elements — counted by the reader and by TensorStore's own
file-read counter — each verified against its block checksum. A checkpoint with whole-shard checksums
only (written before blocks) still loads, reading the overlapping shards whole."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jax_backend as jb
from chunkzero.checkpoint import STORAGE_BLOCK_BYTES, CheckpointMeta, OptimizerMeta, chunk_index, chunk_key, read_meta
from chunkzero.checkpoint.reader import ChunkReader, file_bytes_read, read_shards
from chunkzero.errors import CheckpointError
from chunkzero.layout import ChunkLayout, TensorSpec

BLOCK = STORAGE_BLOCK_BYTES // 4
SPECS = [TensorSpec("a", (8 * BLOCK - 1,)), TensorSpec("b", (3 * BLOCK, 2)), TensorSpec("c", (7,), keep_gathered=True)]
"""Two sharded chunks of several blocks per shard at world size 2 (4 MiB and 3 MiB) and a keep-gathered one."""
METADATA_SLACK_BYTES = 64 << 10
"""File bytes a read may add to the array data: OCDBT manifest and B-tree nodes."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 1 at world size 2 with AdamW state, every array sharded over 2 devices; the arrays whole."""
    root = tmp_path_factory.mktemp("reads") / "ckpt"
    layout = ChunkLayout.build(SPECS, 8 * BLOCK, 2)
    rng = np.random.default_rng(0)
    whole = {
        chunk_key(c.index): np.concatenate([rng.standard_normal(c.utilized), np.zeros(c.padding)]).astype(np.float32)
        for c in layout.chunks
    }
    opt = {"exp_avg": {k: a + 1 for k, a in whole.items()}}
    mesh = jb.make_mesh(2)
    jb.save_checkpoint(root, jb.shard_chunks(whole, layout, mesh), layout, step=1,
                       opt_state_chunks={"exp_avg": jb.shard_chunks(opt["exp_avg"], layout, mesh)},
                       optimizer_meta=OptimizerMeta("torch.optim.AdamW", {}, ["exp_avg"], 1))
    return root, {("params",): whole, ("optim", "exp_avg"): opt["exp_avg"]}


def _expected_shard(arrays, target: ChunkLayout, kind, chunk: int, rank: int) -> np.ndarray:
    lo, hi = target.shard_range(chunk, rank)
    full = np.zeros(target.chunks[chunk].size, np.float32)
    a = arrays[kind][chunk_key(chunk)]
    full[: target.chunks[chunk].utilized] = a[: target.chunks[chunk].utilized]
    return full[lo:hi]


def _read(step_dir, meta, target, rank):
    reader = ChunkReader(step_dir, meta)
    before = file_bytes_read()
    params, optim = read_shards(step_dir, meta, target, rank, reader=reader)
    return params, optim, reader.bytes_read, file_bytes_read() - before


def test_storage_chunks_are_the_blocks(saved):
    root, _ = saved
    meta = read_meta(root)
    reader = ChunkReader(root / "1", meta)
    for path in meta.expected_arrays():
        spec = reader.open(path).spec().to_json()
        assert spec["metadata"]["chunks"] == [meta.storage_block_numel(path)], path
        assert meta.verification_unit(path) == meta.storage_block_numel(path)
    assert meta.storage_block_numel(("params", "chunk_0000")) == BLOCK  # 4 blocks per saved shard


def test_resume_2_to_3_reads_only_owned_blocks(saved):
    root, arrays = saved
    meta = read_meta(root)
    target = meta.layout.relayout(3)
    for rank in range(3):
        params, optim, requested, on_disk = _read(root / "1", meta, target, rank)
        for c in target.chunks:
            np.testing.assert_array_equal(params[c.index], _expected_shard(arrays, target, ("params",), c.index, rank))
            np.testing.assert_array_equal(optim["exp_avg"][c.index],
                                          _expected_shard(arrays, target, ("optim", "exp_avg"), c.index, rank))
        owned = whole_shards = overlaps = 0
        for path in meta.expected_arrays():
            c = target.chunks[chunk_index(path[-1])]
            lo, hi = target.shard_range(c.index, rank)
            hi = min(hi, c.utilized)
            owned += max(0, hi - lo) * 4
            for _, a, e in meta.saved_shards(path):
                if a < hi and lo < e:
                    overlaps += 1
                    whole_shards += (e - a) * 4
        # whole blocks only: at most one block too many at each end of each overlap
        assert owned <= requested <= owned + 2 * overlaps * STORAGE_BLOCK_BYTES, (rank, owned, requested)
        assert requested <= on_disk <= requested + METADATA_SLACK_BYTES, (rank, requested, on_disk)
        if rank == 1:  # the middle rank straddles both saved shards: reading them whole would be ~3x its share
            assert whole_shards > 2.5 * owned and requested < 1.5 * owned, (owned, requested, whole_shards)


def test_same_world_size_reads_exactly_its_shards(saved):
    root, _ = saved
    meta = read_meta(root)
    for rank in range(2):
        _, _, requested, _ = _read(root / "1", meta, meta.layout, rank)
        assert requested == sum(e - a for p in meta.expected_arrays() for q, a, e in meta.saved_shards(p)
                                if q == rank or meta.layout.chunks[chunk_index(p[-1])].keep_gathered) * 4


def test_a_bad_block_fails_only_the_reads_that_touch_it(saved, tmp_path):
    root, _ = saved
    meta = read_meta(root)
    doc = meta.to_dict()
    sums = doc["checksums"]["blocks"]["params/chunk_0000"]["sums"][1]
    sums[-1] = "0" * 32  # the last block saved by rank 1
    bad = CheckpointMeta.from_dict(json.loads(json.dumps(doc)))
    target = meta.layout.relayout(3)
    _, a, e = meta.saved_shards(("params", "chunk_0000"))[1]
    start = a + (e - a - 1) // BLOCK * BLOCK
    with pytest.raises(
        CheckpointError,
        match=rf"'params.chunk_0000' in '.*/1/state' is corrupted: elements \[{start}, {e}\) saved by rank 1",
    ):
        read_shards(root / "1", bad, target, 2)  # rank 2 of 3 owns the end of chunk 0
    read_shards(root / "1", bad, target, 0)  # rank 0 of 3 reads none of rank 1's blocks of chunk 0


def test_checkpoints_without_blocks_read_whole_shards(saved):
    root, arrays = saved
    meta = read_meta(root)
    del meta.checksums["blocks"]
    target = meta.layout.relayout(3)
    params, _, requested, _ = _read(root / "1", meta, target, 1)
    for c in target.chunks:
        np.testing.assert_array_equal(params[c.index], _expected_shard(arrays, target, ("params",), c.index, 1))
    assert requested == sum((e - a) * 4 for p in meta.expected_arrays() for _, a, e in meta.saved_shards(p))
