"""``examples/memory_plan.py`` (docs/memory_plan.md): the memory plan from Python, one process, fake tensors."""

from __future__ import annotations

from examples_runner import run_example

CHECKS = """
assert p.peak_bytes_per_rank == sum(p.host.values()) and p.device is None
assert ckpt.peak_bytes_per_rank < p.peak_bytes_per_rank - p.host["activations"] / 2  # blocks recomputed
assert bf16.host["ema"] == bf16.host["fp32_master"] > 0           # the EMA: 4 bytes per element of the shard
print("EXAMPLE OK")
"""


def test_memory_plan_example_runs(tmp_path):
    proc = run_example("memory_plan.py", tmp_path, checks=CHECKS)
    assert "peak per rank" in proc.stdout and "activation checkpointing" in proc.stdout
