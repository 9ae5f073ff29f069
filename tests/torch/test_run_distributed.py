"""How a rank of ``run_distributed`` ends once its function returned.

A rank must not go through interpreter finalization: gloo's worker threads outlive
``destroy_process_group()``, and one that frees a Python tensor while the interpreter finalizes
aborts the rank (SIGABRT, "terminate called without an active exception"; see
``torch_backend._testing._exit_rank``). The exit hooks of a normal exit must still run: pending
checkpoint saves are committed in a ``threading`` exit hook, ``jax.distributed`` and logging shut
down in ``atexit``.
"""

import atexit
import os
import sys
import threading
import types

from torch_backend._testing import run_distributed


class _MarkOnDelete:
    """Creates ``path`` when deleted. Only C functions are kept: module globals may be gone by then."""

    def __init__(self, path: str):
        self.path, self.open, self.close, self.flags = path, os.open, os.close, os.O_CREAT | os.O_WRONLY

    def __del__(self):
        self.close(self.open(self.path, self.flags))


def _mark(path: str) -> None:
    with open(path, "w"):
        pass


def exit_probe_rank(rank: int, world: int, marker_dir: str) -> int:
    """Marks ``<rank>.threading`` / ``<rank>.atexit`` from the exit hooks, ``<rank>.finalized`` from
    a module that only interpreter finalization deletes."""
    threading._register_atexit(_mark, os.path.join(marker_dir, f"{rank}.threading"))
    atexit.register(_mark, os.path.join(marker_dir, f"{rank}.atexit"))
    probe = types.ModuleType("_exit_probe")
    probe.marker = _MarkOnDelete(os.path.join(marker_dir, f"{rank}.finalized"))
    sys.modules[probe.__name__] = probe
    return rank


def test_rank_runs_exit_hooks_and_skips_finalization(tmp_path):
    assert run_distributed(exit_probe_rank, 2, str(tmp_path), timeout=120) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.atexit", "0.threading", "1.atexit", "1.threading"]
