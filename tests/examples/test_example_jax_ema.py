"""``examples/jax_ema.py`` runs as it is (4 simulated devices), then is checked: the EMA it saved is the one
it kept (restored on 2 devices), and torch's ``load_checkpoint`` puts it in a ``ZeroEMA`` bit for bit."""

from __future__ import annotations

import pytest
from examples_runner import example_env, run_example

CHECKS = """
import numpy as np
import torch
from chunkzero.checkpoint import read_meta
from torch_backend import ZeroDDP, ZeroEMA, ZeroOptimizer, load_checkpoint
from torch_backend.train.gpt import GPT, GPT_CONFIGS
assert read_meta("runs/jax-ema/5").ema.to_dict() == {"decay": 0.99, "update_count": 5, "warmup": True}
kept = unflatten(ema.weights(state), layout, nested=False)
live = unflatten(trainer.chunks(state), layout, nested=False)
restored = unflatten(ema_chunks, layout.relayout(2), nested=False)
assert all(np.array_equal(np.asarray(restored[k]), np.asarray(kept[k])) for k in kept)
assert any(not np.array_equal(np.asarray(live[k]), np.asarray(kept[k])) for k in kept)
model = ZeroDDP(GPT(GPT_CONFIGS["gpt-tiny"]))
optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3)
torch_ema = ZeroEMA(optim, 0.5)
load_checkpoint("runs/jax-ema", model, optim, load_rng=False)
assert (torch_ema.decay, torch_ema.warmup, torch_ema.update_count) == (0.99, True, 5)
with torch_ema.ema_weights():
    loaded = model.state_dict()
    assert all(np.array_equal(loaded[k].numpy(), np.asarray(kept[k])) for k in kept)
print("EXAMPLE OK")
"""


@pytest.mark.slow  # about 25 s on 2 busy cores
def test_jax_ema_example_runs(tmp_path):
    env = example_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run_example("jax_ema.py", tmp_path, checks=CHECKS, env=env)
