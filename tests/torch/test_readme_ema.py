"""The README's "EMA weights" example runs as written: its python block, executed verbatim in a fresh
interpreter (one process), then checked; and its export command (``--ema``) on the checkpoint it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def readme_example() -> str:
    """The first python block after the "## EMA weights" heading."""
    text = README.read_text()
    after = text[text.index("\n## EMA weights"):]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


CHECKS = """
from chunkzero.checkpoint import read_meta
live = model.state_dict()
assert ema.update_count == 5 and optim.ema is ema
assert any(not torch.equal(ema_state[k], live[k]) for k in live)  # the block saw other weights ...
assert not torch.equal(ema_logits, model(x))                      # ... and computed with them
meta = read_meta("runs/ema-demo")
assert meta.ema.to_dict() == {"decay": 0.99, "update_count": 5, "warmup": False}
n = sum(p.numel() for p in model.module.parameters())
assert 4 * n <= optim.memory_report().total("ema") < 4 * n + 4 * 4096  # one rank: every shard, plus padding
print("EXAMPLE OK")
"""


def test_readme_ema_example_runs(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", readme_example() + CHECKS], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "EXAMPLE OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = README.read_text()
    command = "chunkzero export runs/ema-demo --format safetensors runs/ema-hf --ema"
    assert command in text
    proc = subprocess.run([sys.executable, "-m", "chunkzero.cli", *command.split()[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "(EMA weights)" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "runs" / "ema-hf" / "model.safetensors").is_file()
