"""The byte-level GPT's numpy initialization (:mod:`chunkzero.job.init`), which both engines load."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chunkzero.configs import GPT_CONFIGS, GPTConfig, model_specs
from chunkzero.job.init import gpt_initial_params


def test_gpt2_initialization_per_tensor():
    cfg = GPT_CONFIGS["gpt-mini"]
    params = gpt_initial_params(cfg, 0)
    specs = model_specs("gpt-mini")
    assert list(params) == [s.name for s in specs]  # parameter order, the tied head once
    assert all(params[s.name].shape == s.shape and params[s.name].dtype == np.float32 for s in specs)
    for name, v in params.items():
        if name.endswith(".bias"):
            assert not v.any(), name
        elif ".ln_" in name:
            assert (v == 1).all(), name
        else:  # GPT-2: std 0.02, the residual projections 0.02 / sqrt(2 n_layer)
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
            assert abs(float(v.mean())) < 3 * std / math.sqrt(v.size), name
            assert float(v.std()) == pytest.approx(std, rel=0.05), name


def test_a_seed_decides_every_tensor_alone():
    cfg = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=8)
    a, b, c = gpt_initial_params(cfg, 7), gpt_initial_params(cfg, 7), gpt_initial_params(cfg, 8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["transformer.wte.weight"], c["transformer.wte.weight"])
    w = [a[k] for k in a if k.endswith("c_attn.weight")]
    assert not np.array_equal(w[0], w[1])  # each tensor its own stream
    deeper = gpt_initial_params(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=8), 7)
    assert np.array_equal(deeper["transformer.wte.weight"], a["transformer.wte.weight"])
