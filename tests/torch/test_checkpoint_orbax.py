"""A plain ``orbax.checkpoint`` user restores a chunkzero checkpoint without chunkzero:
``examples/read_with_orbax.py``, run unchanged in a fresh interpreter (8 simulated devices) that never
imports chunkzero."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from chunkzero.checkpoint import CheckpointMeta, OptimizerMeta
from chunkzero.layout import ChunkLayout, TensorSpec
from torch_backend.checkpoint.sharded import write_shards

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "read_with_orbax.py"


def orbax_example() -> str:
    """The text of ``examples/read_with_orbax.py`` (it reads ``runs/ckpt`` under the working directory)."""
    return EXAMPLE.read_text()


CHECKS = """
import sys
assert not any(m == "chunkzero" or m.startswith(("chunkzero.", "torch_backend", "torch")) for m in sys.modules)
assert len(jax.devices()) == 8 and step == 5
want = np.load("expected.npz", allow_pickle=False)
for key in [k for k in want.files if k != "wte"]:
    kind, *rest = key.split("__")
    got = state["params"][rest[0]] if kind == "params" else state["optim"][rest[0]][rest[1]]
    assert isinstance(got, np.ndarray) and np.array_equal(got.astype(np.float32), want[key]), key
    sh = sharded["params"][rest[0]] if kind == "params" else sharded["optim"][rest[0]][rest[1]]
    assert sh.sharding.spec == P("shard") and sh.shape[0] % 8 == 0 and len(sh.addressable_shards) == 8, key
    full = np.asarray(sh).astype(np.float32)
    assert np.array_equal(full[: want[key].size], want[key]) and not full[want[key].size :].any(), key
assert wte.shape == (37, 3) and np.array_equal(wte, want["wte"])
print("SNIPPET OK")
"""


def test_plain_orbax_restores_without_chunkzero(tmp_path):
    specs = [TensorSpec("transformer.wte.weight", (37, 3)), TensorSpec("transformer.h.0.b", (13,)),
             TensorSpec("frozen", (5,), dtype="bfloat16", requires_grad=False)]
    layout = ChunkLayout.build(specs, 100, 1)  # odd sizes: 124 and 5 elements, padded to 128 and 8 on 8 devices
    rng = np.random.default_rng(0)
    params = {c.index: rng.standard_normal(c.size).astype(np.float32) for c in layout.chunks}
    frozen = layout.tensor("frozen").chunk
    import ml_dtypes

    params[frozen] = params[frozen].astype(ml_dtypes.bfloat16)
    optim = {
        "exp_avg": {c.index: rng.standard_normal(c.size).astype(np.float32) for c in layout.chunks if c.requires_grad}
    }
    meta = CheckpointMeta(
        step=5, layout=layout, optimizer=OptimizerMeta("torch.optim.AdamW", {"lr": 0.1}, ["exp_avg"], 5)
    )
    write_shards(tmp_path / "runs" / "ckpt", meta, 0, params, optim)

    want = {f"params__chunk_{i:04d}": a.astype(np.float32) for i, a in params.items()}
    want |= {f"optim__exp_avg__chunk_{i:04d}": a for i, a in optim["exp_avg"].items()}
    t = layout.tensor("transformer.wte.weight")
    want["wte"] = params[t.chunk][t.offset : t.end].reshape(t.shape)
    np.savez(tmp_path / "expected.npz", **want)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    code = orbax_example() + textwrap.dedent(CHECKS)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "SNIPPET OK" in r.stdout, r.stdout + r.stderr
