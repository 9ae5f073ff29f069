"""Hugging Face GPT-2 under ZeroDDP at W = 1, 2, 3 against the single-process reference (gloo): peft LoRA
on a frozen base (only the adapters carry master, gradient and optimizer state), and the issue's
"Done when" run (gradient checkpointing, two param groups, a LambdaLR, autograd.grad)."""

import pytest
import real_model_cases

from torch_backend._testing import run_distributed


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lora_frozen_base(world):
    results = run_distributed(real_model_cases.worker_lora, world, timeout=600)
    for r in results:  # the worker asserts the exact bytes; here only that LoRA saves, in fp32 and bf16
        assert r["fp32/lora"] < r["fp32/full"] and r["bf16/lora"] < r["bf16/full"], r


@pytest.mark.parametrize("world", [1, 2, 3])
def test_checkpointed_gpt2_with_groups_and_lambdalr(world):
    run_distributed(real_model_cases.worker_checkpointed_groups_lambdalr, world, timeout=600)
