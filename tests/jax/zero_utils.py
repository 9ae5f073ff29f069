"""Helpers of the ZeRO-3 / baseline / analysis tests."""

from __future__ import annotations

import numpy as np

from jax_backend.blocks import gpt_program, random_batch
from jax_backend.gpt import gpt_config

CHUNK_SIZE = 30_000
"""gpt-tiny (124,672 parameters) -> 6 chunks of several tensors, shard boundaries inside tensors."""
WORLD = 4
BATCH, SEQ = 8, 32
STEPS = 3
ADAMW = dict(learning_rate=1e-3, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.1)
"""AdamW of the equivalence tests (eps 1e-6 as in tests/torch/zero_cases.py: with 1e-8 an element whose
gradient is rounding noise moves by ~lr in a sign-dependent direction)."""
FP32_RTOL = 1e-5
"""fp32: normwise relative error of all parameters after K steps, ||got − ref|| / ||ref|| (DESIGN.md §7)."""


def tiny_program():
    return gpt_program(gpt_config("gpt-tiny"))


def batches(program, n: int = STEPS, seed: int = 0):
    return [random_batch(program, BATCH, SEQ, seed=seed + i) for i in range(n)]


def normwise_rel_err(got: dict, ref: dict) -> float:
    """``||got − ref||₂ / ||ref||₂`` over every tensor of ``ref`` (float64)."""
    num = sum(float(((np.asarray(got[n], np.float64) - np.asarray(ref[n], np.float64)) ** 2).sum()) for n in ref)
    den = sum(float((np.asarray(ref[n], np.float64) ** 2).sum()) for n in ref)
    return (num / den) ** 0.5


def max_rel_err(got: dict, ref: dict) -> float:
    """Largest per-tensor ``max|got − ref| / max|ref|``."""
    return max(
        float(np.abs(np.asarray(got[n]) - np.asarray(ref[n])).max() / np.abs(np.asarray(ref[n])).max()) for n in ref
    )
