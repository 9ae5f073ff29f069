"""Fixtures of the JAX tests (helpers in jaxtest_utils.py).

XLA_FLAGS (8 simulated CPU devices) is set by tests/conftest.py before anything imports jax.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from jaxtest_utils import TorchRun, make_torch_run
from jaxtest_utils import eval_tokens as _eval_tokens


@pytest.fixture(scope="session", autouse=True)
def compilation_cache():
    """JAX's persistent compilation cache, where ``chunkzero train --backend jax`` keeps it
    (:func:`jax_backend.processes.compilation_cache_dir`; ``CHUNKZERO_JAX_CACHE=off`` turns it off): a program
    compiled by an earlier test run, or by another worker of this one, is loaded instead of compiled again."""
    from jax_backend.processes import compilation_cache_dir, use_compilation_cache

    use_compilation_cache(compilation_cache_dir())


@pytest.fixture(scope="session")
def torch_run(tmp_path_factory) -> TorchRun:
    """gpt-tiny trained 3 AdamW steps in torch, checkpointed at world size 3 (step 3).

    Written once per test session: under pytest-xdist the first worker writes it into the session's
    shared temporary directory (a file lock keeps the others waiting), the rest reuse it.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return make_torch_run(tmp_path_factory.mktemp("torch_run"))
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp().parent / "jax_torch_run"  # shared by this session's workers
    base.mkdir(exist_ok=True)
    with FileLock(str(base) + ".lock"):
        return make_torch_run(base)


@pytest.fixture(scope="session")
def eval_tokens() -> np.ndarray:
    """``int64[2, 48]`` tokens the parity tests evaluate on."""
    return _eval_tokens()
