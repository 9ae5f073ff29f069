"""A worker process's host memory under glibc's ``malloc``: freed memory given back, large buffers on huge pages.

glibc's ``malloc`` keeps memory that a program freed inside the process (for its next allocations), so a
burst of short-lived allocations — loading a compiled XLA program, tracing a step — leaves the resident set
that high until something reuses it. :func:`release_free_memory` returns those free pages at once
(``malloc_trim(0)``), so that the next large allocation (a training step's working memory) comes on top of
what is live, not of what was freed.

A buffer above glibc's mmap threshold (32 MiB at most) is mapped on each allocation and unmapped when freed,
so a step that allocates one (XLA:CPU's temp buffer, ~90 MiB on the CPU default job) faults every 4 KiB page
of it in again on every step. :func:`huge_page_malloc_env` sets glibc's ``glibc.malloc.hugetlb=1`` tunable
for a worker (transparent huge pages for malloc's mappings, where the kernel offers them): 2 MiB per fault.
Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def release_free_memory() -> bool:
    """Return the pages the C heap holds free to the operating system (glibc's ``malloc_trim(0)``): the
    process's resident set drops by them; live memory is untouched. Returns whether it ran (``False`` where
    the C library has no ``malloc_trim``: not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc's tunable (2.35 and later) that madvises malloc's mappings for transparent huge pages."""


def huge_page_malloc_env(env: dict[str, str]) -> None:
    """Add :data:`HUGE_PAGE_TUNABLE` to ``GLIBC_TUNABLES`` in ``env`` (a worker's environment, before it starts)
    unless it sets ``glibc.malloc.hugetlb`` already. glibc reads it at start-up; older glibc and other C
    libraries ignore it, and so does a kernel whose transparent huge pages are off."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_TUNABLE}" if tunables else HUGE_PAGE_TUNABLE
