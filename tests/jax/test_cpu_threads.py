"""XLA:CPU's threads per JAX process: ``CHUNKZERO_CPU_THREADS`` read by ``cpu_threads``, the launcher's
default (cores / processes, as torch's workers), and ``bound_cpu_threads`` (fewer pool threads, none left pinned)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkzero.workers import CPU_THREADS_ENV, available_cpu_cores, threads_per_worker
from jax_backend.processes import cpu_threads

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os, sys
from jax_backend.processes import bound_cpu_threads
import jax
jax.config.update("jax_platforms", "cpu")
bounded = bound_cpu_threads(int(sys.argv[1])) if int(sys.argv[1]) else False
import jax.numpy as jnp
jax.block_until_ready(jax.jit(lambda x: (x @ x).sum())(jnp.ones((256, 256))))
masks = []
for t in os.listdir("/proc/self/task"):
    try:
        masks.append(sorted(os.sched_getaffinity(int(t))))
    except OSError:
        pass
print(json.dumps({"bounded": bounded, "threads": len(masks), "masks": masks, "all": sorted(os.sched_getaffinity(0))}))
"""


def test_cpu_threads_reads_the_environment():
    assert cpu_threads({CPU_THREADS_ENV: "1"}) == 1
    assert cpu_threads({CPU_THREADS_ENV: " 3 "}) == 3
    for off in ("0", "", "auto", "-2"):
        assert cpu_threads({CPU_THREADS_ENV: off}) is None, off
    assert cpu_threads({}) is None


def test_threads_per_worker_splits_the_cores():
    cores = available_cpu_cores()
    assert threads_per_worker(1) == cores
    assert threads_per_worker(cores) == 1
    assert threads_per_worker(2 * cores) == 1  # never 0
    assert threads_per_worker(2) == max(1, cores // 2)


def test_the_jax_processes_get_the_users_xla_flags_threads_and_huge_pages():
    """``chunkzero train --backend jax``'s process environment: XLA_FLAGS passes through (dropping it made a
    user's XLA:CPU options a silent no-op), the thread count defaults to cores / processes unless set, and
    malloc's huge pages are added."""
    from chunkzero.train_config import TrainConfig
    from jax_backend.train.run import process_env

    flags = "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8"
    env = process_env(TrainConfig(backend="jax", nproc=2), {"XLA_FLAGS": flags, "HOME": "/h"})
    assert env["XLA_FLAGS"] == flags and env["HOME"] == "/h"
    assert env[CPU_THREADS_ENV] == str(threads_per_worker(2))
    assert "glibc.malloc.hugetlb=1" in env["GLIBC_TUNABLES"]
    assert process_env(TrainConfig(backend="jax", nproc=2), {CPU_THREADS_ENV: "0"})[CPU_THREADS_ENV] == "0"


def _probe(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROBE, str(threads)], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or available_cpu_cores() < 2, reason="needs 2+ cores")
def test_bound_cpu_threads_makes_fewer_threads_and_pins_none():
    """A process bound to 1 thread starts fewer threads than XLA's default, and every thread may run on all
    the cores afterwards (the bound is on the pool's size, not a pinning)."""
    free, bound = _probe(0), _probe(1)
    assert bound["bounded"] and not free["bounded"]
    assert bound["threads"] < free["threads"], (bound["threads"], free["threads"])
    assert all(m == bound["all"] for m in bound["masks"]), bound["masks"]
