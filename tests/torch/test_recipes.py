"""Real-model recipes under ZeroDDP at W = 1, 2, 3 against the single-process reference (gloo)."""

import pytest

import recipe_cases
from torch_backend._testing import run_distributed

WORLD_SIZES = [1, 2, 3]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_activation_checkpointing(world):
    run_distributed(recipe_cases.worker_activation_checkpointing, world, timeout=600)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_autograd_grad_with_respect_to_inputs(world):
    run_distributed(recipe_cases.worker_autograd_grad, world, timeout=600)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_use_different_experts(world):
    run_distributed(recipe_cases.worker_moe, world, timeout=600)


@pytest.mark.parametrize("world", [1, 2])
def test_plain_optimizer_or_clip_over_parameters_raises(world):
    run_distributed(recipe_cases.worker_no_silent_noops, world, timeout=600)
