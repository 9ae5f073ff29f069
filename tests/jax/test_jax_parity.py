"""Parity: the Flax GPT restored from a torch-trained chunkzero checkpoint gives the torch model's
logits on 1, 3, 4 and 8 simulated devices."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jaxtest_utils import rel_err

import jax_backend as jb

FP32_RTOL = 1e-5
"""fp32: max |logits_jax - logits_torch| / max |logits_torch| (DESIGN.md §7)."""


@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_restored_flax_gpt_matches_torch_logits(torch_run, eval_tokens, n):
    model, restored = jb.restore_gpt(torch_run.root, jb.make_mesh(n))  # config from meta.model_config
    assert restored.meta.layout.world_size == 3 and restored.layout.world_size == n
    ref = torch_run.logits  # the torch model's own logits on eval_tokens
    out = np.asarray(jb.logits(model, jnp.asarray(eval_tokens)))
    err = rel_err(out, ref)
    print(f"parity n={n} writer={torch_run.writer} rel_err={err:.3e}")
    assert err < FP32_RTOL, f"{n} devices: relative logit error {err:.3e}"
