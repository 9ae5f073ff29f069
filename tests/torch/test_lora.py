"""peft LoRA on a frozen Hugging Face GPT-2 under ZeroDDP at W = 1, 2, 3 against the single-process
reference (gloo); only the adapters carry master, gradient and optimizer state."""

import pytest

import lora_cases
from torch_backend._testing import run_distributed


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lora_frozen_base(world):
    results = run_distributed(lora_cases.worker_lora, world, timeout=600)
    for r in results:  # the worker asserts the exact bytes; here only that LoRA saves, in fp32 and bf16
        assert r["fp32/lora"] < r["fp32/full"] and r["bf16/lora"] < r["bf16/full"], r
