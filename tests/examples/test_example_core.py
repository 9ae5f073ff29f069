"""The examples that need one process and a few seconds: ``examples/layout.py`` (the core, numpy only) and
``examples/placement_auto.py`` (auto placement on a simulated budget)."""

from __future__ import annotations

from examples_runner import run_example

LAYOUT_CHECKS = """
assert layout.world_size == 8 and layout.padding_numel == 0 and len(layout.chunks) == 44
start, stop = layout.owned_range("transformer.wte.weight", rank=3)
assert 0 <= start < stop
assert [c.strategy for c in compare_strategies(specs, 8, "bf16", layout=layout)] == ["chunk-zero3", "fsdp", "ddp"]
assert "torch" not in sys.modules and "jax" not in sys.modules  # the core imports no framework
print("EXAMPLE OK")
"""

PLACEMENT_CHECKS = """
assert ap.step_bytes_moved[0] == 0                   # the warm-up step only traces
assert all(b > 0 for b in ap.step_bytes_moved[1:])   # half the shards fit: the plan moves the others
assert ap.budget_bytes < ap.budget_for_fraction(1.0)
print("EXAMPLE OK")
"""


def test_layout_example_runs(tmp_path):
    proc = run_example("layout.py", tmp_path, checks=LAYOUT_CHECKS)
    assert "44 chunks" in proc.stdout


def test_placement_auto_example_runs(tmp_path):
    run_example("placement_auto.py", tmp_path, checks=PLACEMENT_CHECKS)
