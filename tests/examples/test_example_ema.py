"""``examples/ema.py`` runs as it is (one process), then is checked; and the export command its docs give
(``--ema``, in docs/checkpoints.md) runs on the checkpoint it wrote."""

from __future__ import annotations

import pytest
from examples_runner import ROOT, run_example, run_python

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


@pytest.mark.slow  # about 37 s on 2 busy cores
def test_ema_example_runs(tmp_path):
    run_example("ema.py", tmp_path, checks=CHECKS)
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    command = "chunkzero export runs/ema-demo --format safetensors runs/ema-hf --ema"
    assert command in text
    proc = run_python(["-m", "chunkzero.cli", *command.split()[1:]], tmp_path)
    assert proc.returncode == 0 and "(EMA weights)" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "runs" / "ema-hf" / "model.safetensors").is_file()
