"""Issue 33's host-cost bound: one steady training step of a 4-layer GPT-2 under ZeroDDP +
ZeroOptimizer(AdamW) at W = 1 runs through at most 8 project files, the ones ``docs/ARCHITECTURE.md`` walks
through, in its order, and at most 3,000 project Python calls (``step_trace.py``)."""

from __future__ import annotations

from step_trace import trace_step

STEP_FILES = ["torch_backend/zero/ddp.py", "torch_backend/zero/runtime.py", "torch_backend/zero/schedule.py",
              "torch_backend/zero/chunks.py", "chunkzero/states.py", "torch_backend/zero/memory.py",
              "torch_backend/zero/chunk_gradient.py", "torch_backend/zero/optim.py"]
"""The files of a step at W = 1, in the order ``docs/ARCHITECTURE.md`` names them (no collective and
no stream runs on one CPU rank)."""


def test_a_step_runs_through_few_files_and_calls():
    counts = trace_step()
    # the trace sees the engine (a tracer that counted nothing would pass the bounds)
    assert counts["torch_backend/zero/runtime.py"] > 100 and counts["torch_backend/zero/chunks.py"] > 50, counts
    assert set(counts) <= set(STEP_FILES), sorted(set(counts) - set(STEP_FILES))
    assert len(counts) <= 8
    assert sum(counts.values()) <= 3000, counts.most_common()


def test_the_architecture_doc_names_the_step_files_in_order():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    walk = doc[doc.index("## One training step (torch)"):]
    walk = walk[: walk.index("\n## ", 5)]
    positions = [walk.find(f"`{f}`") for f in STEP_FILES]
    assert -1 not in positions, [f for f, p in zip(STEP_FILES, positions) if p == -1]
    assert positions == sorted(positions), "the walk names the step's files out of order"
