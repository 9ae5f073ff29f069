"""The README's Lightning example runs as written: its python block, saved as a script and run in a
fresh interpreter (Lightning's launcher starts the second rank), then its checkpoint is checked."""

from __future__ import annotations

import pytest
from readme_blocks import example_env, python_block_after, run_python

pytest.importorskip("lightning")


def test_readme_lightning_example_runs(tmp_path):
    (tmp_path / "lit.py").write_text(python_block_after("## PyTorch Lightning"))
    env = example_env(OMP_NUM_THREADS="1")
    for args in ([], ["resume"]):
        proc = run_python(["lit.py", *args], tmp_path, env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    from chunkzero.checkpoint import latest_step, read_meta

    root = tmp_path / "runs" / "lit.ckpt"
    assert latest_step(root) == 4  # the W = 2 save; the resume saves nothing
    meta = read_meta(root / "4")
    assert meta.layout.world_size == 2 and meta.mixed_precision == "bf16"
    assert meta.extra["lightning"]["global_step"] == 4 and meta.optimizer.step == 4
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in proc.stdout + proc.stderr
