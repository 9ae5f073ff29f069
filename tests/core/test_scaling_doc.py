"""docs/scaling.md is what benchmarks/scaling_doc.py writes from the cost model (regenerate it when the
model changes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scaling_doc_is_current():
    spec = importlib.util.spec_from_file_location("scaling_doc", ROOT / "benchmarks" / "scaling_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.render()
    assert (ROOT / "docs" / "scaling.md").read_text() == text, "run: PYTHONPATH=. python benchmarks/scaling_doc.py"
    assert "| 1,024 |" in text and "## Where each strategy becomes communication-bound" in text
