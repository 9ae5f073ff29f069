"""Storage blocks and their checksums, with numpy alone: the block size rule, block checksums that
combine into the shard's, verification of partial reads by block, validation of the record, and
checkpoints written before blocks (whole-shard checksums only)."""

from __future__ import annotations

import numpy as np
import pytest

from chunkzero.checkpoint import STORAGE_BLOCK_BYTES, CheckpointMeta, OptimizerMeta, chunk_index, shard_checksum
from chunkzero.checkpoint.checksums import block_checksums, combine_checksums, storage_block_numel
from chunkzero.errors import CheckpointError, CheckpointFormatError
from chunkzero.layout import ChunkLayout, TensorSpec

F32_BLOCK = STORAGE_BLOCK_BYTES // 4  # 262,144 fp32 elements


@pytest.mark.parametrize(
    "n", [1, 7, F32_BLOCK, F32_BLOCK + 1, 3 * F32_BLOCK, 5_000_000, 31_168_000, 2 * 1_000_003, 123_456_789]
)
@pytest.mark.parametrize("itemsize", [2, 4])
def test_storage_block_divides_the_write_and_fits_the_target(n, itemsize):
    b = storage_block_numel(n, itemsize)
    assert n % b == 0
    if n * itemsize <= STORAGE_BLOCK_BYTES:
        assert b == n  # small writes are one block
    elif b < n:
        assert (
            b * itemsize <= STORAGE_BLOCK_BYTES and b * itemsize % 8 == 0 and b * itemsize * 16 >= STORAGE_BLOCK_BYTES
        )
        better = [d for d in range(b + 1, STORAGE_BLOCK_BYTES // itemsize + 1) if n % d == 0 and d * itemsize % 8 == 0]
        assert not better, f"{better[-1]} is a larger block than {b}"
    else:  # no usable divisor (a large odd factor): the write stays one block
        assert not [d for d in range(STORAGE_BLOCK_BYTES // itemsize // 16, STORAGE_BLOCK_BYTES // itemsize + 1)
                    if n % d == 0 and d * itemsize % 8 == 0]


@pytest.mark.parametrize("n, block", [(0, 4), (10, 4), (13, 2), (64, 8), (65, 64)])
def test_block_checksums_combine_into_the_shard_checksum(n, block):
    data = np.random.default_rng(n).standard_normal(n).astype(np.float32)  # 4-byte elements, blocks of 8k bytes
    sums = block_checksums(data, block)
    assert len(sums) == -(-n // block)
    assert all(s == shard_checksum(data[i * block : (i + 1) * block]) for i, s in enumerate(sums))
    assert combine_checksums(sums) == shard_checksum(data)


SPECS = [
    TensorSpec("a", (6 * F32_BLOCK - 1,)),
    TensorSpec("b", (F32_BLOCK // 2, 6)),
    TensorSpec("c", (7,), keep_gathered=True),
]
"""Chunk 0 holds ``a`` alone: 1,572,863 elements, odd, so at world size 1 it has no usable block and stays
one; at 2 and 3 it is padded by one element and splits into blocks, the last rank's last block shorter."""


def _meta(world: int) -> tuple[CheckpointMeta, dict]:
    meta = CheckpointMeta(step=1, layout=ChunkLayout.build(SPECS, 3 * F32_BLOCK, world),
                          optimizer=OptimizerMeta("torch.optim.AdamW", {}, ["exp_avg"], 1))
    rng = np.random.default_rng(world)
    whole = {p: np.where(np.arange(shape[0]) < meta.layout.chunks[chunk_index(p[-1])].utilized,
                         rng.standard_normal(shape[0]), 0).astype(np.float32)
             for p, (shape, _) in meta.expected_arrays().items()}
    meta.checksums = meta.checksums_of_arrays(whole)
    return meta, whole


@pytest.mark.parametrize("world", [1, 2, 3])
def test_partial_reads_verify_by_block(world):
    meta, whole = _meta(world)
    CheckpointMeta.from_dict(meta.to_dict())  # the schema accepts the record
    path = ("params", "chunk_0000")
    unit = meta.verification_unit(path)
    assert unit == meta.storage_block_numel(path)
    assert unit == meta.layout.shard_numel(0) if world == 1 else unit < meta.layout.shard_numel(0)
    for q, a, e in meta.saved_shards(path):
        # every run of whole blocks verifies, and so does the last, shorter block
        for k in range(-(-(e - a) // unit)):
            lo, hi = a + k * unit, min(e, a + (k + 2) * unit)
            assert meta.verify_blocks(path, q, lo, whole[path][lo:hi], step_dir="ck/1")
        bad = whole[path][a:e].copy()
        k = (e - a - 1) // unit  # a corrupted element in the last block is named by that block's range
        bad[k * unit + 1] += 1
        with pytest.raises(
            CheckpointError,
            match=rf"'params.chunk_0000' in 'ck/1/state' is corrupted: elements "
            rf"\[{a + k * unit}, {min(e, a + (k + 1) * unit)}\) saved by rank {q}",
        ):
            meta.verify_blocks(path, q, a, bad, step_dir="ck/1")
        with pytest.raises(CheckpointError, match="not whole checksum units"):
            meta.verify_blocks(path, q, a + 1, whole[path][a + 1 : a + 1 + unit], step_dir="ck/1")
        assert meta.verify_shard(path, q, whole[path][a:e], step_dir="ck/1")  # whole-shard sums are still written


def test_checkpoints_without_blocks_verify_whole_shards():
    meta, whole = _meta(2)
    del meta.checksums["blocks"]
    meta = CheckpointMeta.from_dict(meta.to_dict())
    path = ("optim", "exp_avg", "chunk_0000")
    assert meta.verification_unit(path) == 0
    q, a, e = meta.saved_shards(path)[1]
    assert meta.verify_blocks(path, q, a, whole[path][a:e], step_dir="x")
    with pytest.raises(CheckpointError, match="not whole checksum units"):
        meta.verify_blocks(path, q, a, whole[path][a : a + 8], step_dir="x")
    meta.checksums = None
    assert (
        meta.verification_unit(path) is None
        and meta.verify_blocks(path, q, a, whole[path][a : a + 8], step_dir="x") is False
    )


@pytest.mark.parametrize(
    "damage, field",
    [
        (
            lambda b: b["params/chunk_0000"]["sums"][0].pop(),
            r"checksums.blocks.params/chunk_0000.sums\[0\]': expected \d+ block checksums",
        ),
        (
            lambda b: b["params/chunk_0000"]["sums"].pop(),
            r"checksums.blocks.params/chunk_0000': expected the blocks of 2",
        ),
        (
            lambda b: b["params/chunk_0000"].update(block_numel=0),
            r"checksums.blocks.params/chunk_0000': expected \{'block_numel'",
        ),
        (
            lambda b: b.update({"params/chunk_0099": b["params/chunk_0000"]}),
            r"checksums.blocks.params/chunk_0099': does not name a chunk",
        ),
        (
            lambda b: b["params/chunk_0000"]["sums"][1].__setitem__(0, "zz"),
            r"checksums.blocks.params/chunk_0000.sums\[1\]': expected a list",
        ),
    ],
)
def test_block_record_is_validated(damage, field):
    meta, _ = _meta(2)
    doc = meta.to_dict()
    damage(doc["checksums"]["blocks"])
    with pytest.raises(CheckpointFormatError, match=rf"m.json: field '{field}"):
        CheckpointMeta.from_dict(doc, source="m.json")
