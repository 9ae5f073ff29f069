"""Test-suite set-up shared by every test directory.

JAX must see 8 simulated CPU devices, so XLA_FLAGS is set here, before anything imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402  (after the environment above)


@pytest.fixture(scope="session", autouse=True)
def rank_pools():
    """``run_distributed`` reuses its ranks across the tests of this process (one pool per world size;
    under pytest-xdist, per worker): the processes' start (importing torch) is paid once, not per test."""
    from torch_backend._testing import close_rank_pools, enable_rank_pools

    enable_rank_pools()
    yield
    close_rank_pools()
