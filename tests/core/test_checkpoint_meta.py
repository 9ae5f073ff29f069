"""The checkpoint format's metadata methods, with numpy alone: saved-shard ranges, the checksum record
(per rank and from whole arrays, as the torch and JAX writers build it), verification, the saved-array
check, alias matching and the state tree."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from chunkzero.checkpoint import (
    CheckpointMeta,
    OptimizerMeta,
    chunk_index,
    chunk_key,
    flat_arrays,
    matching_names,
    saved_tensor,
    shard_arrays,
    shard_checksum,
    state_tree,
)
from chunkzero.errors import CheckpointError, CheckpointFormatError, ConfigError, ShapeMismatchError
from chunkzero.layout import ChunkLayout, TensorSpec

SPECS = [TensorSpec("a", (5, 7)), TensorSpec("b", (13,)), TensorSpec("c", (3, 3), aliases=("c2", "c3")),
         TensorSpec("d", (40,)), TensorSpec("e", (6,), keep_gathered=True)]


def _meta(world: int, chunk_size: int = 30) -> CheckpointMeta:
    return CheckpointMeta(step=1, layout=ChunkLayout.build(SPECS, chunk_size, world),
                          optimizer=OptimizerMeta("torch.optim.AdamW", {}, ["exp_avg"], 1))


def _reference_checksum(data: np.ndarray) -> str:
    """The documented algorithm in plain Python: little-endian uint64 words of the zero-padded bytes."""
    raw = np.ascontiguousarray(data).tobytes()
    raw += bytes(-len(raw) % 8)
    words = struct.unpack(f"<{len(raw) // 8}Q", raw)
    total, xor = sum(words) % 2**64, 0
    for w in words:
        xor ^= w
    return f"{total:016x}{xor:016x}"


@pytest.mark.parametrize("n", [0, 1, 7, 8, 13])
def test_shard_checksum_is_the_documented_algorithm(n):
    data = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    assert shard_checksum(data) == _reference_checksum(data)
    if n:
        flipped = data.copy()
        flipped.view(np.uint8)[n * 2] ^= 1
        assert shard_checksum(flipped) != shard_checksum(data)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_saved_shards_are_the_valid_elements_of_each_rank(world):
    meta = _meta(world)
    for c in meta.layout.chunks:
        path = ("params", chunk_key(c.index))
        utilized = np.arange(c.size) < c.utilized
        owners = [0] if c.keep_gathered else range(world)
        want = []
        for q in owners:
            lo, hi = (0, c.size) if c.keep_gathered else (q * c.size // world, (q + 1) * c.size // world)
            valid = np.flatnonzero(utilized[lo:hi]) + lo
            want.append((q, lo, int(valid[-1]) + 1 if valid.size else lo))
        assert meta.saved_shards(path) == want


@pytest.mark.parametrize("world", [1, 2, 3])
def test_per_rank_record_equals_the_whole_array_record(world):
    """What the torch ranks gather (each checksums its own shards) equals what JAX computes from the
    whole arrays: the two writers of the format agree."""
    meta = _meta(world)
    rng = np.random.default_rng(world)
    whole = {p: np.where(np.arange(shape[0]) < meta.layout.chunks[chunk_index(p[-1])].utilized,
                         rng.standard_normal(shape[0]), 0).astype(np.float32)
             for p, (shape, _) in meta.expected_arrays().items()}
    per_rank = []
    for r in range(world):
        shards = {}
        for p, a in whole.items():
            lo, hi = meta.layout.shard_range(chunk_index(p[-1]), r)
            shards[p] = a[lo:hi]
        per_rank.append(meta.shard_checksums(r, shards))
    record = meta.checksums_from_ranks(per_rank)
    assert record == meta.checksums_of_arrays(whole)
    assert sorted(record["arrays"]) == sorted("/".join(p) for p in meta.expected_arrays())
    doc = CheckpointMeta.from_dict({**meta.to_dict(), "checksums": record})  # the schema accepts it
    assert doc.checksums == record

    meta.checksums = record
    for p, a in whole.items():
        for q, lo, hi in meta.saved_shards(p):
            assert meta.verify_shard(p, q, a[lo:hi], step_dir="ck/1")
    p = ("optim", "exp_avg", "chunk_0000")
    q, lo, hi = meta.saved_shards(p)[-1]
    bad = whole[p][lo:hi].copy()
    bad[0] += 1
    with pytest.raises(CheckpointError, match=rf"array 'optim.exp_avg.chunk_0000' in 'ck/1/state' is corrupted: "
                                              rf"elements \[{lo}, {hi}\) saved by rank {q}"):
        meta.verify_shard(p, q, bad, step_dir="ck/1")
    with pytest.raises(CheckpointError, match="rank 0 computed no checksum for array 'params.chunk_0000'"):
        meta.checksums_from_ranks([{}] * world)


def test_verify_without_a_record_or_without_the_array():
    meta = _meta(2)
    assert meta.verify_shard(("params", "chunk_0000"), 0, np.zeros(3, np.float32), step_dir="x") is False
    meta.checksums = {"algorithm": "sum64+xor64", "arrays": {}}
    with pytest.raises(CheckpointFormatError, match=r"x/meta: no checksum for array 'params.chunk_0000'"):
        meta.verify_shard(("params", "chunk_0000"), 0, np.zeros(3, np.float32), step_dir="x")


def test_check_saved_arrays_names_the_array():
    meta = _meta(2)
    saved = dict(meta.expected_arrays())
    meta.check_saved_arrays(saved, source="s")
    meta.check_saved_arrays(dict.fromkeys(saved), source="s")  # presence only
    del saved[("optim", "exp_avg", "chunk_0001")]
    meta.check_saved_arrays(saved, source="s", with_optimizer=False)
    with pytest.raises(
        CheckpointFormatError,
        match=r"s: array 'optim.exp_avg.chunk_0001' listed by the checkpoint metadata is not saved$",
    ):
        meta.check_saved_arrays(saved, source="s")
    saved[("optim", "exp_avg", "chunk_0001")] = ((3,), "float32")
    with pytest.raises(
        CheckpointFormatError,
        match=r"'optim.exp_avg.chunk_0001' is float32\[3\], the metadata's layout says float32\[\d+\]",
    ):
        meta.check_saved_arrays(saved, source="s")


def test_matching_names_and_saved_tensor():
    saved = ChunkLayout.build(SPECS, 30, 1)
    tied = TensorSpec("c3", (3, 3), aliases=("x", "c2"))
    assert matching_names(tied, saved) == ["c3", "c2"]  # primary name first, then aliases in order
    assert matching_names(tied, {"x"}) == ["x"]
    assert saved_tensor(saved, tied).name == "c"
    with pytest.raises(CheckpointError, match="tensor 'z' of the model is not in the checkpoint here"):
        saved_tensor(saved, TensorSpec("z", (1,), aliases=("y",)), source="here")


def test_state_tree_and_shard_arrays():
    meta = _meta(3)
    arrays = {p: np.zeros(meta.layout.shard_numel(chunk_index(p[-1])), np.float32) for p in meta.expected_arrays()}
    tree = state_tree(arrays)
    assert sorted(tree) == ["optim", "params"] and sorted(tree["optim"]) == ["exp_avg"]
    assert flat_arrays(tree) == arrays
    params = {chunk_index(p[-1]): a for p, a in arrays.items() if p[0] == "params"}
    optim = {"exp_avg": {chunk_index(p[-1]): a for p, a in arrays.items() if p[0] == "optim"}}
    got = shard_arrays(meta, params, optim)
    assert list(got) == list(meta.expected_arrays()) and all(
        np.shares_memory(got[p], arrays[p]) for p in got
    )  # no copies
    with pytest.raises(ConfigError, match=r"optimizer shards for \[\] but meta lists state keys \['exp_avg'\]"):
        shard_arrays(meta, params)
    with pytest.raises(ConfigError, match="no params shard for chunk 1"):
        shard_arrays(meta, {0: params[0]}, optim)
    with pytest.raises(ShapeMismatchError, match="'params.chunk_0000'"):
        shard_arrays(meta, {**params, 0: np.zeros(1, np.float32)}, optim)
    as_f64 = shard_arrays(meta, {i: a.astype(np.float64) for i, a in params.items()}, optim)
    assert all(a.dtype == np.float32 for a in as_f64.values())  # cast to the saved dtype


def test_optimizer_groups_and_tensor_steps_round_trip_and_are_validated():
    groups = [
        {"lr": 0.1, "weight_decay": 0.1, "params": ["a", "c"]},
        {"lr": 0.05, "weight_decay": 0.0, "params": ["b", "d"]},
    ]
    meta = _meta(2)
    meta.optimizer = OptimizerMeta("torch.optim.AdamW", {"lr": 0.1, "max_norm": None}, ["exp_avg"], 3, groups, {"d": 0})
    back = CheckpointMeta.from_json(meta.to_json())
    assert back.optimizer == meta.optimizer
    # written without groups (older writers, JAX): the fields are absent and read back as None
    doc = _meta(2).to_dict()
    assert "param_groups" not in doc["optimizer"] and CheckpointMeta.from_dict(doc).optimizer.param_groups is None
    for field, value in (("param_groups", [{"lr": 0.1}]), ("param_groups", []), ("tensor_steps", {"d": -1}),
                         ("tensor_steps", {"d": True})):
        bad = meta.to_dict()
        bad["optimizer"][field] = value
        with pytest.raises(CheckpointFormatError, match=f"optimizer.{field}"):
            CheckpointMeta.from_dict(bad, source="m.json")
