"""``examples/lightning_gpt.py`` runs as it is (Lightning's launcher starts the second rank), then resumes
at one rank; its checkpoint is checked; then the export command of docs/lightning.md and
``examples/lightning_load_export.py`` load it into a plain LightningModule. ``examples/lightning_ema.py``
trains at 4 ranks with hybrid sharding and the EMA callback, then resumes at 2, flat."""

from __future__ import annotations

import pytest
from examples_runner import ROOT, example_env, run_example, run_python

pytest.importorskip("lightning")

LOAD_CHECKS = """
import torch
got = lit.state_dict()
assert torch.equal(got["model.lm_head.weight"], got["model.transformer.wte.weight"])  # re-tied on load
assert any(float(v.abs().sum()) > 0 for v in got.values())
print("EXAMPLE OK")
"""


@pytest.mark.slow
def test_lightning_example_runs_resumes_and_exports(tmp_path):
    env = example_env(OMP_NUM_THREADS="1")
    for args in ([], ["resume"]):
        proc = run_example("lightning_gpt.py", tmp_path, *args, env=env)
    from chunkzero.checkpoint import latest_step, read_meta

    root = tmp_path / "runs" / "lit.ckpt"
    assert latest_step(root) == 4  # the W = 2 save; the resume saves nothing
    meta = read_meta(root / "4")
    assert meta.layout.world_size == 2 and meta.mixed_precision == "bf16"
    assert meta.extra["lightning"]["global_step"] == 4 and meta.optimizer.step == 4
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in proc.stdout + proc.stderr

    command = "chunkzero export runs/lit.ckpt --format safetensors runs/lit-export"
    assert command in (ROOT / "docs" / "lightning.md").read_text()
    proc = run_python(["-m", "chunkzero.cli", *command.split()[1:]], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_example("lightning_load_export.py", tmp_path, checks=LOAD_CHECKS)


@pytest.mark.slow
def test_lightning_ema_example_trains_hybrid_and_resumes_flat(tmp_path):
    env = example_env(OMP_NUM_THREADS="1")
    proc = run_example("lightning_ema.py", tmp_path, env=env)
    assert "step 4: EMA validation loss" in proc.stdout
    from chunkzero.checkpoint import latest_step, read_meta

    root = tmp_path / "runs" / "lit-ema.ckpt"
    assert latest_step(root) == 4
    meta = read_meta(root / "4")
    assert meta.replicas == 2 and meta.layout.world_size == 2  # 4 ranks: 2 shards x 2 replicas
    assert meta.ema is not None and meta.ema.decay == 0.9 and meta.ema.update_count == 4
    proc = run_example("lightning_ema.py", tmp_path, "resume", env=env)
    assert "step 6: EMA validation loss" in proc.stdout
