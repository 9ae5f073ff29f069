"""Workers of the hybrid-sharding tests (``ZeroDDP(shard_group_size=S)``, W = S x R ranks, gloo).

References are single-process full-batch runs of an identical module (``zero_cases``)."""

from __future__ import annotations

import torch
from zero_cases import FP32, assert_state_close, gpt2_loss, hf_gpt2, mean_over_ranks, micro, reference_run

HYPER = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)
MAX_NORM = 0.05
CHUNK = 1500


def _data(steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (global_batch, 8), generator=g) for _ in range(steps)]


def _module():
    return hf_gpt2(n_layer=2, n_embd=16, frozen_blocks=(0,))


def _reference(data):
    ref = _module()
    losses, _ = reference_run(ref, gpt2_loss, data, torch.optim.AdamW, HYPER, MAX_NORM)
    return ref, losses


def _train(shard_group_size, data, rank, world):
    """3 AdamW steps (clipped) of the small GPT-2 with a frozen block and a keep-gathered ``ln_f``; each
    step two micro-batches, the first under ``no_sync``. Returns the model, the losses and the bytes
    each no_sync backward moved."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    model = ZeroDDP(_module(), chunk_size=CHUNK, prefetch=1, shard_group_size=shard_group_size,
                    keep_gathered=lambda n: n.startswith("transformer.ln_f"))
    optim = ZeroOptimizer(model, torch.optim.AdamW, max_norm=MAX_NORM, **HYPER)
    losses, no_sync_bytes = [], []
    model.last_sync_bytes = {}  # what the last step's synchronized micro-batch moved (forward, backward, reduce)
    for batch in data:
        mine = micro(batch, rank, world)
        first, second = mine[: len(mine) // 2], mine[len(mine) // 2 :]
        before = model.collective_stats
        with model.no_sync():
            a = gpt2_loss(model, first) / 2
            optim.backward(a)
        after = model.collective_stats
        no_sync_bytes.append({k: after[k] - before[k] for k in after if "bytes" in k and "gather" not in k})
        b = gpt2_loss(model, second) / 2
        optim.backward(b)
        assert optim.step()
        done = model.collective_stats
        model.last_sync_bytes = {k: done[k] - after[k] for k in done if k.startswith(("intra_", "inter_"))}
        assert optim.last_grad_norm > MAX_NORM, "clipping was not exercised"
        optim.zero_grad()
        losses.append(mean_over_ranks(a.item() + b.item()))
    return model, losses, no_sync_bytes


def worker_equivalence(rank: int, world: int, sizes: tuple[int, ...]):
    """For each S: equal to the reference after 3 steps; the layout is the core's at world size S; a
    no_sync backward reduces nothing on either level. Returns each run's collective stats."""
    data = _data(3, 2 * world)
    ref, ref_losses = _reference(data)
    report = {}
    for s in sizes:
        model, losses, no_sync_bytes = _train(s, data, rank, world)
        assert model.layout.world_size == s and model.replicas == world // s and model.shard_rank == rank % s
        assert model.layout.chunks[0].size % s == 0
        assert any(c.keep_gathered for c in model.layout.chunks) and any(
            not c.requires_grad for c in model.layout.chunks
        )
        assert not model.gathered_chunks()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        assert_state_close(model.state_dict(), ref.state_dict(), **FP32)
        # no_sync: only the parameter gathers ran, no reduction on either level
        for moved in no_sync_bytes:
            assert moved == {"intra_payload_bytes": moved["intra_payload_bytes"], "inter_payload_bytes": 0,
                             "intra_sent_bytes": moved["intra_sent_bytes"], "inter_sent_bytes": 0}, moved
        report[s] = {"stats": model.collective_stats, "step_bytes": model.last_sync_bytes,
                     "layout": model.layout.to_json()}
    return report


def worker_no_replica_all_reduce(rank: int, world: int):
    """Mutant: hybrid sharding without the replica all-reduce (each shard group averages only its own
    ranks' gradients) must fail the reference comparison."""
    from torch_backend.zero import chunks, collectives

    def first_level_only(output, full, shard_group, replica_group, *, world_size, divide_first=False, async_op=False,
                         tracker=None):
        if output is full:
            return collectives.all_reduce_avg(full, shard_group, divide_first=divide_first, async_op=async_op)
        return collectives.reduce_scatter_avg(output, full, shard_group, divide_first=divide_first, async_op=async_op)

    real = chunks.collectives.reduce_hybrid
    chunks.collectives.reduce_hybrid = first_level_only
    try:
        data = _data(3, 2 * world)
        ref, _ = _reference(data)
        model, _, _ = _train(2, data, rank, world)
        try:
            assert_state_close(model.state_dict(), ref.state_dict(), **FP32)
        except AssertionError:
            return "failed"
        return "passed"
    finally:
        chunks.collectives.reduce_hybrid = real


def worker_bad_shard_group_size(rank: int, world: int):
    """A shard group size that does not divide W (or is not a positive int) is a ConfigError naming it."""
    from chunkzero.errors import ConfigError
    from torch_backend import ZeroDDP

    for bad in (3, 0, True, 2.0, world + 1):
        try:
            ZeroDDP(_module(), chunk_size=CHUNK, shard_group_size=bad)
        except ConfigError as e:
            assert "shard_group_size" in str(e) and str(bad) in str(e), str(e)
        else:
            raise AssertionError(f"shard_group_size={bad!r} at W={world} was accepted")
    return True


def worker_moe_idle_expert(rank: int, world: int, shard_group_size: int):
    """An expert idle on one rank (rank 0: its micro-batch routes only to expert 0) under hybrid sharding."""
    from recipe_cases import moe_idle_expert_run

    moe_idle_expert_run(rank, world, shard_group_size)
    return True


RESUME_BATCH = 12  # divisible by 4 and by 3


def worker_save(rank: int, world: int, root: str, shard_group_size: int):
    """2 steps at (S, W/S), then a checkpoint; returns the full state dict and optimizer state."""
    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.checkpoint import save_checkpoint

    data = _data(3, RESUME_BATCH)
    model = ZeroDDP(_module(), chunk_size=CHUNK, shard_group_size=shard_group_size,
                    keep_gathered=lambda n: n.startswith("transformer.ln_f"))
    optim = ZeroOptimizer(model, torch.optim.AdamW, max_norm=MAX_NORM, **HYPER)
    for batch in data[:2]:
        optim.backward(gpt2_loss(model, micro(batch, rank, world)))
        assert optim.step()
        optim.zero_grad()
    save_checkpoint(root, model, optim, step=2)
    return {"params": model.state_dict(), "optim": _optim_tensors(optim)}


def _optim_tensors(optim) -> dict[str, torch.Tensor]:
    sd = optim.state_dict()
    return {f"{k}/{name}": v.clone() for k, state in sd["state"].items() for name, v in state.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0}


def worker_resume(rank: int, world: int, root: str, saved: dict):
    """Load at flat W: parameters and optimizer state equal the saved ones bit for bit; the third step
    equals the reference's."""
    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.checkpoint import load_checkpoint

    data = _data(3, RESUME_BATCH)
    model = ZeroDDP(_module(), chunk_size=CHUNK, keep_gathered=lambda n: n.startswith("transformer.ln_f"))
    optim = ZeroOptimizer(model, torch.optim.AdamW, max_norm=MAX_NORM, **HYPER)
    meta = load_checkpoint(root, model, optim)
    assert meta.replicas == 2 and meta.world_size == 2 and len(meta.rng_states) == 4, (meta.replicas, meta.world_size)
    assert_state_close(model.state_dict(), saved["params"], rtol=0, atol=0)
    got = _optim_tensors(optim)
    assert got.keys() == saved["optim"].keys() and got, (sorted(got), sorted(saved["optim"]))
    assert_state_close(got, saved["optim"], rtol=0, atol=0)
    optim.backward(gpt2_loss(model, micro(data[2], rank, world)))
    assert optim.step()
    ref, _ = _reference(data)
    assert_state_close(model.state_dict(), ref.state_dict(), **FP32)
    return True
