"""``examples/real_models.py`` runs as it is (one process, the tiny GPT-2 it configures), then is checked."""

from __future__ import annotations

import textwrap

import pytest
from examples_runner import run_example

CHECKS = """
import math
from safetensors.torch import load_file
from torch_backend import ZeroDDP

# full fine-tuning: materialized, loaded, two groups driven by the scheduler
assert isinstance(model, ZeroDDP) and not any(p.is_meta for p in hf.parameters())
saved, got = load_file("runs/gpt2/model.safetensors"), model.state_dict()
moved = max(float((got[k] - v).abs().max()) for k, v in saved.items())
assert 0 < moved < 1e-4, moved  # the pretrained values, moved by 3 warm-up steps (lr <= 9e-6)
assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]
assert all(math.isclose(g["lr"], want * 4 / 100) for g, want in zip(optim.param_groups, (3e-4, 1.5e-4)))
dims = {n: p.dim() for n, p in hf.named_parameters()}
assert optim.group_names[1] and {dims[n] >= 2 for n in optim.group_names[0]} == {True}
assert {dims[n] < 2 for n in optim.group_names[1]} == {True}
# LoRA: only the adapters hold an fp32 master (one rank: no padding); they trained
n_adapter = sum(p.numel() for p in lora.parameters() if p.requires_grad)
assert 0 < n_adapter < sum(p.numel() for p in lora.parameters()) // 10
assert lora_optim.memory_report().total("fp32_master") == 4 * n_adapter
assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters), sorted(adapters)
assert all(float(v.abs().max()) > 0 for k, v in adapters.items() if ".lora_B." in k)  # lora_B starts at zero
print("EXAMPLE OK")
"""


@pytest.mark.slow  # about 47 s on 2 cores
def test_real_models_example_runs(tmp_path):
    run_example("real_models.py", tmp_path, checks=textwrap.dedent(CHECKS))
