"""The workers of ``chunkzero train`` start with glibc's mmap threshold set (``MALLOC_MMAP_THRESHOLD_``),
unless the user's environment sets one."""

from __future__ import annotations

import os

import pytest

from torch_backend.train import launch as launcher


def test_sets_the_threshold_when_none_is_set():
    env = {"PATH": "/bin"}
    launcher.worker_malloc_env(env)
    assert env == {"PATH": "/bin", "MALLOC_MMAP_THRESHOLD_": str(launcher.WORKER_MALLOC_MMAP_THRESHOLD_BYTES)}
    assert launcher.WORKER_MALLOC_MMAP_THRESHOLD_BYTES == 1 << 20


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=4096"}])
def test_keeps_the_users_threshold(env):
    before = dict(env)
    launcher.worker_malloc_env(env)
    assert env == before


def test_launch_gives_the_workers_the_threshold(monkeypatch):
    import torch.distributed.launcher.api as api

    seen = {}

    def fake_elastic_launch(config, entrypoint):
        seen["start_method"] = config.start_method
        seen["threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")  # what the spawned workers would inherit
        return lambda *args: {0: entrypoint(*args)}

    for name in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):  # absent now, and as they were after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(api, "elastic_launch", fake_elastic_launch)
    assert launcher.launch(abs, (-3,), 1) == {0: 3}
    assert seen == {"start_method": "spawn", "threshold": str(launcher.WORKER_MALLOC_MMAP_THRESHOLD_BYTES)}
