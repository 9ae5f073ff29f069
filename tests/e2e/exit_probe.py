"""A probe of how a worker process ends: which exit hooks ran, and whether interpreter finalization did.

:func:`install_exit_probe` registers three markers in the calling process: ``<name>.threading`` (a
``threading`` exit hook: where pending checkpoint saves are committed), ``<name>.atexit`` (an ``atexit``
function: ``jax.distributed`` and logging shut down there) and ``<name>.finalized`` (created when a module
that only interpreter finalization deletes goes away). A worker that ends as
``torch_backend.train.process_exit`` means it to leaves the first two and not the third.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import types
from pathlib import Path


class _MarkOnDelete:
    """Creates ``path`` when deleted. Only C functions are kept: module globals may be gone by then."""

    def __init__(self, path: str):
        self.path, self.open, self.close, self.flags = path, os.open, os.close, os.O_CREAT | os.O_WRONLY

    def __del__(self):
        self.close(self.open(self.path, self.flags))


def _mark(path: str) -> None:
    with open(path, "w"):
        pass


def install_exit_probe(marker_dir: str, name: str) -> None:
    """Register the three markers ``<marker_dir>/<name>.{threading,atexit,finalized}`` in this process."""
    threading._register_atexit(_mark, os.path.join(marker_dir, f"{name}.threading"))
    atexit.register(_mark, os.path.join(marker_dir, f"{name}.atexit"))
    probe = types.ModuleType(f"_exit_probe_{name}")
    probe.marker = _MarkOnDelete(os.path.join(marker_dir, f"{name}.finalized"))
    sys.modules[probe.__name__] = probe


def clean_exits(names: list[str]) -> list[str]:
    """The markers that processes ``names`` leave when each ran its exit hooks and skipped finalization."""
    return sorted(f"{n}.{hook}" for n in names for hook in ("atexit", "threading"))


def markers(marker_dir: Path) -> list[str]:
    return sorted(p.name for p in Path(marker_dir).iterdir())
