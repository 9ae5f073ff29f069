"""Giving a process's freed heap memory back to the operating system.

glibc's ``malloc`` keeps memory that a program freed inside the process (for its next allocations), so a
burst of short-lived allocations — loading a compiled XLA program, tracing a step — leaves the resident set
that high until something reuses it. :func:`release_free_memory` returns those free pages at once
(``malloc_trim(0)``), so that the next large allocation (a training step's working memory) comes on top of
what is live, not of what was freed. Standard library only.
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
