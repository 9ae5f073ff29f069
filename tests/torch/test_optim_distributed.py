"""ZeroOptimizer on real gloo process groups (world sizes 1, 2, 3) against single-process references:
param groups, LR schedulers, skipped parameters, no_sync-only steps, low-precision updates and clipping.
The checks live in ``optim_cases.py`` (one spawned run does several; spawning is slow)."""

import optim_cases
import pytest

from torch_backend._testing import run_distributed

WORLD_SIZES = [1, 2, 3]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_param_groups_equal_torch(world):
    """HF GPT-2 (3 layers, tied), two nanoGPT groups (lr/2 on biases and LayerNorm), LambdaLR: 3 steps
    within 1e-5; the state dict goes to a plain torch AdamW over the same groups and back."""
    results = run_distributed(optim_cases.worker_param_groups, world, timeout=300)
    assert results[0] == results[-1] == 1e-3 / 8


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_schedulers_skipping_and_no_sync(world):
    """LambdaLR, CosineAnnealingLR, OneCycleLR (with a state-dict round trip); a parameter without a
    gradient is skipped; zero_grad(set_to_none=False); a step after only-no_sync backwards."""
    lrs = run_distributed(optim_cases.worker_schedulers_and_skipping, world, timeout=300)
    assert lrs[0] == lrs[-1]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_low_precision_updates_and_clipping(world):
    """bf16 / fp16 updates within 5% of the low-precision reference (and lr x 0.5 or no clipping is
    not), clipping with offload; an unscaled fp16 backward is refused."""
    out = run_distributed(optim_cases.worker_low_precision, world, timeout=300)
    assert out[0] == out[-1]
