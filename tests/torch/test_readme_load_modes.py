"""The README's load-mode example runs as written: its python block (after "### Load modes"), executed
verbatim in a fresh interpreter (one process), then checked against the checkpoint it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def readme_example() -> str:
    """The first python block after the "### Load modes" heading."""
    text = README.read_text()
    after = text[text.index("\n### Load modes"):]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


CHECKS = """
assert missing == ["cls_head.weight", "cls_head.bias"] and unexpected == [], (missing, unexpected)
want, got = pretrained.state_dict(), model.state_dict()
assert all(torch.equal(got[k], want[k]) for k in want)  # the pre-trained part exactly
assert set(got) - set(want) == {"cls_head.weight", "cls_head.bias"} and got["cls_head.weight"].abs().sum() > 0
print("EXAMPLE OK")
"""


def test_readme_load_mode_example_runs(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", readme_example() + CHECKS], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EXAMPLE OK" in proc.stdout and "['cls_head.weight', 'cls_head.bias']" in proc.stdout
