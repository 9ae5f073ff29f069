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


@pytest.mark.parametrize("world", [1, 2])
def test_error_raised_in_forward_or_backward_leaves_the_engine_usable(world):
    run_distributed(recipe_cases.worker_error_in_backward, world, timeout=600)


# compiled code sees whole gathered tensors: W = 3's uneven shards change nothing it compiles, and cost each of its
# ranks ~10 s of CPU
@pytest.mark.parametrize("world", [1, 2])
def test_torch_compile(world):
    run_distributed(recipe_cases.worker_compile, world, timeout=900)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_meta_device_init(world, tmp_path):
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(1)
    weights = {k: v.contiguous() for k, v in recipe_cases.Tied().state_dict().items() if k != "head.weight"}
    path = tmp_path / "tied.safetensors"
    save_file(weights, str(path))
    run_distributed(recipe_cases.worker_meta_init, world, str(path), timeout=600)
