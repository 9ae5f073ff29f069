"""chunkzero.host_memory: the C heap's free pages go back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest

from chunkzero.host_memory import huge_page_malloc_env, release_free_memory

BLOCK_BYTES = 64 * 1024  # below glibc's mmap threshold: from the heap, which free() alone does not shrink
BLOCKS = 1024


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux") or "glibc" not in " ".join(__import__("platform").libc_ver()),
                    reason="glibc's malloc_trim")
def test_release_free_memory_returns_freed_heap_pages():
    """64 MiB of small blocks, touched, then freed but for the last one (which pins the heap's top, so free()
    cannot shrink it): the pages stay resident until :func:`release_free_memory`, after which most are gone."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK_BYTES) for _ in range(BLOCKS)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, BLOCK_BYTES)
    for b in blocks[:-1]:
        libc.free(b)
    before = _rss_anon_kib()
    assert release_free_memory() is True
    after = _rss_anon_kib()
    libc.free(blocks[-1])
    freed_kib = BLOCK_BYTES * (BLOCKS - 1) // 1024
    print(f"RssAnon {before} KiB -> {after} KiB (freed blocks: {freed_kib} KiB)")
    assert before - after > freed_kib // 2


def test_huge_page_malloc_env_adds_the_tunable_unless_set():
    env = {}
    huge_page_malloc_env(env)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    huge_page_malloc_env(env)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    env = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # the user's own choice stays
    huge_page_malloc_env(env)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
