"""Test-suite set-up shared by every test directory.

JAX must see 8 simulated CPU devices, so XLA_FLAGS is set here, before anything imports jax. XLA:CPU ends the
process when a collective's devices have not all arrived after 40 s; on 2 busy cores running 8 simulated devices
that is allowed 10 minutes, and the warning it logs after 20 s stays.

Under pytest-xdist (``make test``: ``-n <cores + 1> --dist loadgroup``) the tests that share a module-scoped
fixture run on one worker (the fixture is built once), and the ``slow`` ones are handed out first,
so that no worker starts a long test while the other has nothing left to do.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=600",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402  (after the environment above)

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns xdist_group marks into scopes (`test@group`)
def pytest_collection_modifyitems(config, items):
    """Group each module's users of a module-scoped fixture (``xdist_group``, read by ``--dist
    loadgroup``); then order the work: groups and tests holding a ``slow`` test first, each kept
    together, the rest in collection order."""
    group_of = {}
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {d.scope for fixture_defs in (defs.name2fixturedefs.values() if defs else ()) for d in fixture_defs}
        if "module" in scopes and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        marks = [m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")]
        group_of[item] = "_".join(sorted(map(str, marks))) or item.nodeid
    slow_groups = {group_of[item] for item in items if item.get_closest_marker("slow")}
    first_index = {}
    for i, item in enumerate(items):
        first_index.setdefault(group_of[item], i)
    items.sort(key=lambda item: (group_of[item] not in slow_groups, first_index[group_of[item]]))


@pytest.fixture(scope="session", autouse=True)
def rank_pools():
    """``run_distributed`` reuses its ranks across the tests of this process (one pool per world size;
    under pytest-xdist, per worker): the processes' start (importing torch) is paid once, not per test.
    ``CHUNKZERO_RANK_POOLS=0`` spawns ranks for every call instead (to compare, or to rule pools out)."""
    from torch_backend._testing import close_rank_pools, enable_rank_pools

    if os.environ.get("CHUNKZERO_RANK_POOLS", "1") != "0":
        enable_rank_pools()
    yield
    close_rank_pools()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small real text corpus (~200 KB of standard-library source) for ``chunkzero train --data``."""
    from e2e.helpers import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus"))
