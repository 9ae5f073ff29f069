"""The engine's memory discipline, frozen chunks and prefetch, at world sizes 1, 2 and 3 (gloo)."""

import pytest

import engine_cases
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
