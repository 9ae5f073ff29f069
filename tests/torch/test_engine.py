"""The engine's memory discipline, frozen chunks and prefetch, at world sizes 1, 2 and 3 (gloo)."""

import engine_cases
import pytest

from torch_backend._testing import run_distributed


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_chunks_stay_within_in_use_plus_prefetch(world):
    """At every leaf module's forward and backward hooks, an 8-layer GPT-2 over ≥ 8 chunks holds at
    most the chunks in use plus prefetch (never more than 4), frozen chunks included; a
    never-releasing engine fails the same check."""
    results = run_distributed(engine_cases.worker_memory_discipline, world, timeout=600)
    for r in results:
        assert "never-release" in r and r["trainable"]["max_gathered"] <= 4


@pytest.mark.parametrize("world", [1, 2, 3])
def test_prefetch_follows_the_recorded_order_and_stays_exact(world):
    run_distributed(engine_cases.worker_prefetch_order, world, timeout=600)


def test_offload_decisions_apply_at_world_size_1():
    """A parameter-offloaded chunk is not resident even on one rank: gathered (copied to the device)
    for its use and released after; its master lives on the host; training is exact."""
    import copy

    import torch
    import zero_cases

    from chunkzero import Location, static_placement
    from torch_backend import ZeroDDP, ZeroOptimizer

    module = engine_cases.gpt2(n_layer=2)
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=6000, offload_param_frac=0.5, offload_optim_frac=0.5)
    assert model.placements == static_placement(model.layout.chunks, offload_optim_frac=0.5, offload_param_frac=0.5)
    offloaded = [p.index for p in model.placements if p.param_offloaded]
    assert offloaded and all(not model.chunks[i].resident for i in offloaded)
    assert all(model.placements[i].master is Location.HOST for i in offloaded)
    seen = set()
    hooks = [m.register_forward_hook(lambda *_: seen.update(model.gathered_chunks())) for m in module.modules()]
    optim = ZeroOptimizer(model, torch.optim.AdamW, **zero_cases.ADAMW)
    data = zero_cases.batches("gpt2", 2, 4)
    for batch in data:
        optim.backward(engine_cases.gpt2_loss(model, batch))
        optim.step()
        optim.zero_grad()
    for h in hooks:
        h.remove()
    assert set(offloaded) <= seen and model.gathered_chunks() == []
    zero_cases.reference_run(ref, engine_cases.gpt2_loss, data, torch.optim.AdamW, zero_cases.ADAMW)
    zero_cases.assert_state_close(model.state_dict(), ref.state_dict(), **zero_cases.FP32)
