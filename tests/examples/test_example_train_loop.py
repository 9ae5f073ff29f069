"""``examples/train_loop.py`` runs as it is (one process), then is checked against the checkpoint it wrote;
``examples/jax_restore.py`` then restores that checkpoint on 4 JAX devices, checked against a safetensors
export of it (torch's path, not JAX's)."""

from __future__ import annotations

import pytest
from examples_runner import example_env, run_example, run_python

CHECKS = """
from chunkzero.checkpoint import read_meta
meta = read_meta("runs/ckpt/3")
assert meta.step == 3 and meta.layout.world_size == 1 and meta.mixed_precision == "bf16"
assert [g["weight_decay"] for g in optim.param_groups] == [0.0, 0.01]  # the no-decay group, then the defaults
assert optim.param_groups[0]["lr"] < 3e-3 and step == 3                 # the scheduler drove the LR
assert optim.memory_report().total("fp32_master") >= 4 * sum(p.numel() for p in model.module.parameters())
print("EXAMPLE OK")
"""

JAX_CHECKS = """
import numpy as np
from safetensors.numpy import load_file
want = load_file("runs/export/model.safetensors")["transformer.wte.weight"]
got = params["transformer"]["wte"]["weight"]
assert got.shape == (256, 64) and len(mesh.devices.flat) == 4
assert np.array_equal(np.asarray(got, dtype=np.float32), want)
print("EXAMPLE OK")
"""


@pytest.mark.slow  # about 25 s on 2 cores
def test_train_loop_example_then_jax_restore(tmp_path):
    run_example("train_loop.py", tmp_path, checks=CHECKS)
    export = ["-m", "chunkzero.cli", "export", "runs/ckpt", "--format", "safetensors", "runs/export"]
    proc = run_python(export, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = example_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run_example("jax_restore.py", tmp_path, checks=JAX_CHECKS, env=env)
