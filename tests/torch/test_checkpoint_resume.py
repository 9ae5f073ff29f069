"""Resume from Orbax checkpoints: bitwise at the same world size, resharded at another world size or
chunk size (2→3, 3→1, 1→2, 2→1), with RNG states, data position, optimizer state and every param
group's hyper-parameters (changed mid-run, so only a restore gives the saved ones back).

One test runs the phases in order, each in fresh processes (real gloo groups):

A. world size 2: 3 steps, async save (step 3), RNG draws, 2 more steps, save (step 5).
W1. this process (world size 1): load step 5 (2→1), compare, one step, save (root1, step 6).
B. world size 2, new processes: resume step 3 → the same RNG draws, losses of steps 4-5 and final
   state bitwise; load root1 step 6 (1→2) into another chunk size and compare.
C. world size 3: load step 5 (2→3) at the same and at another chunk size, and import its safetensors
   export into a third chunk size; compare, train, save (root3, step 6).
W1b. this process: load root3 step 6 (3→1) and compare.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from checkpoint_harness import assert_same_state, build, full_state, train_step

from chunkzero.layout import ChunkLayout, TensorSpec
from torch_backend._testing import run_distributed
from torch_backend.checkpoint.export import export_checkpoint, load_pretrained
from torch_backend.checkpoint.sharded import (
    latest_step,
    load_checkpoint,
    read_meta,
    read_plan,
    save_checkpoint,
)


def _seed_rank(rank: int) -> None:
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)


def _draws() -> list:
    return [torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random()]


def _phase_a(rank, world, root):
    model, optim = build()
    _seed_rank(rank)
    losses = [train_step(model, optim, s, rank) for s in (1, 2)]
    optim.param_groups[1]["lr"] = 2e-3  # what a scheduler would do: every resume must restore it
    optim.max_norm = 0.7
    losses.append(train_step(model, optim, 3, rank))
    save_checkpoint(root, model, optim, step=3, async_save=True, data_position={"next_step": 4}, extra={"phase": "A"})
    draws = _draws()
    losses += [train_step(model, optim, s, rank) for s in (4, 5)]
    save_checkpoint(root, model, optim, step=5, data_position={"next_step": 6})
    state = full_state(model, optim)
    return {"losses": losses, "draws": draws, "state": state if rank == 0 else None}


def _phase_b(rank, world, root, root1, want5, want6_w1):
    model, optim = build(seed=7)  # other initial values: everything must come from the checkpoint
    _seed_rank(rank + 50)
    meta = load_checkpoint(root, model, optim, step=3)
    out = {"data_position": meta.data_position, "extra": meta.extra, "draws": _draws()}
    out["losses"] = [train_step(model, optim, s, rank) for s in (4, 5)]
    state = full_state(model, optim)
    if rank == 0:
        assert_same_state(state, want5, "resumed at step 3, trained to 5")
    train_step(model, optim, 6, rank)
    load_checkpoint(root, model, optim, step=5)  # into live shards and optimizer state, in place
    state = full_state(model, optim)
    if rank == 0:
        assert_same_state(state, want5, "step 5 loaded in place over step 6")
    m2, o2 = build(chunk_size=5000, seed=8)
    load_checkpoint(root1, m2, o2)  # 1 -> 2, another chunk size
    state = full_state(m2, o2)
    if rank == 0:
        assert_same_state(state, want6_w1, "1->2")
    train_step(m2, o2, 7, rank)
    return out


def _phase_c(rank, world, root, root3, want5, exported):
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("chunkzero.checkpoint").addHandler(Capture())
    model, optim = build(seed=9)
    other, other_optim = build(chunk_size=7000, seed=10)  # different packing: shards map by tensor name
    meta = load_checkpoint(root, model, optim)  # latest = step 5
    load_checkpoint(root, other, other_optim, step=5)
    s1, s2 = full_state(model, optim), full_state(other, other_optim)
    if rank == 0:
        assert_same_state(s1, want5, "2->3")
        assert_same_state(s2, want5, "2->3, other chunk size")
    imported, _ = build(chunk_size=4000, seed=11)
    report = load_pretrained(imported, exported)  # each rank reads only its ranges of the safetensors
    assert report.missing_keys == [] and report.unexpected_keys == []
    s3 = full_state(imported, _)
    if rank == 0:
        assert_same_state({k: v for k, v in s3.items() if k.startswith("param/")},
                          {k: v for k, v in want5.items() if k.startswith("param/")}, "import 2->3")
    loss = train_step(model, optim, 6, rank)
    train_step(other, other_optim, 6, rank)
    save_checkpoint(root3, model, optim, step=6)
    state = full_state(model, optim)
    load_checkpoint(root, other, other_optim, step=5)  # resharded, into live state
    s2 = full_state(other, other_optim)
    if rank == 0:
        assert_same_state(s2, want5, "2->3 in place over a trained model")
    return {"step": meta.step, "loss": loss, "warnings": records, "state": state if rank == 0 else None}


@pytest.mark.slow
def test_resume_bitwise_and_reshard(tmp_path, caplog):
    root, root1, root3 = tmp_path / "w2", tmp_path / "w1", tmp_path / "w3"

    a = run_distributed(_phase_a, 2, str(root))
    want5 = a[0]["state"]
    assert latest_step(root) == 5
    meta = read_meta(root, 3)
    assert meta.world_size == 2 and meta.data_position == {"next_step": 4} and len(meta.rng_states) == 2
    assert meta.optimizer.class_name == "torch.optim.AdamW" and meta.optimizer.step == 3
    assert meta.optimizer.state_keys == ["exp_avg", "exp_avg_sq"]
    groups = meta.optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-2, 2e-3] and [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert (
        "transformer.h.0.attn.c_attn.weight" in groups[0]["params"] and "transformer.ln_f.weight" in groups[1]["params"]
    )
    assert meta.optimizer.hyperparameters["max_norm"] == 0.7 and meta.optimizer.tensor_steps is None

    # W1: 2 -> 1 in this process
    model, optim = build(seed=3)
    with caplog.at_level(logging.WARNING, logger="chunkzero.checkpoint"):
        load_checkpoint(root, model, optim)
    assert any("re-seeding" in r.getMessage() for r in caplog.records), "RNG of 2 ranks must not be reused by 1"
    assert_same_state(full_state(model, optim), want5, "2->1")
    train_step(model, optim, 6, 0)
    save_checkpoint(root1, model, optim, step=6)
    want6_w1 = full_state(model, optim)

    # B: same world size, new processes: bitwise
    b = run_distributed(_phase_b, 2, str(root), str(root1), want5, want6_w1)
    for rank in range(2):
        assert b[rank]["data_position"] == {"next_step": 4} and b[rank]["extra"] == {"phase": "A"}
        assert b[rank]["draws"] == a[rank]["draws"], f"rank {rank}: RNG states not restored"
        assert b[rank]["losses"] == a[rank]["losses"][3:5], f"rank {rank}: losses after resume differ"

    # C: 2 -> 3 (same and other chunk size), then save at world size 3
    exported = tmp_path / "exported"
    export_checkpoint(root, exported, format="safetensors", max_shard_size="40KB")
    c = run_distributed(_phase_c, 3, str(root), str(root3), want5, str(exported))
    assert all(r["step"] == 5 and np.isfinite(r["loss"]) for r in c)
    assert all(any("re-seeding" in w for w in r["warnings"]) for r in c)

    # W1b: 3 -> 1
    model, optim = build(seed=4)
    load_checkpoint(root3, model, optim)
    assert_same_state(full_state(model, optim), c[0]["state"], "3->1")
    assert np.isfinite(train_step(model, optim, 7, 0))


@pytest.mark.parametrize("chunk_size", [30, 17])
@pytest.mark.parametrize("old_world,new_world", [(2, 3), (3, 1), (1, 2), (3, 2)])
def test_read_plan_reads_only_owned_ranges(old_world, new_world, chunk_size):
    specs = [
        TensorSpec("a", (5, 7)),
        TensorSpec("b", (13,)),
        TensorSpec("c", (3, 3), aliases=("c2",)),
        TensorSpec("d", (40,)),
        TensorSpec("e", (6,), keep_gathered=True),
    ]
    saved = ChunkLayout.build(specs, 30, old_world)
    target = ChunkLayout.build(specs, chunk_size, new_world)
    for rank in range(new_world):
        for c in target.chunks:
            plan = read_plan(saved, target, c.index, rank)
            assert sum(p.numel for p in plan) == target.valid_length(c.index, rank)  # exactly the owned elements
            covered = np.zeros(target.shard_numel(c.index), dtype=int)
            for p in plan:
                covered[p.dst_offset : p.dst_offset + p.numel] += 1
            assert covered.max(initial=0) <= 1
            if chunk_size == 30:  # same packing: one contiguous read per shard
                assert len(plan) <= 1
