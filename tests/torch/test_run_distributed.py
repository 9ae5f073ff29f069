"""How a rank of ``run_distributed`` ends once its function returned.

A rank must not go through interpreter finalization: gloo's worker threads outlive
``destroy_process_group()``, and one that frees a Python tensor while the interpreter finalizes
aborts the rank (SIGABRT, "terminate called without an active exception"; see
``torch_backend.train.process_exit``). The exit hooks of a normal exit must still run: pending
checkpoint saves are committed in a ``threading`` exit hook, ``jax.distributed`` and logging shut
down in ``atexit``.
"""

from e2e.exit_probe import clean_exits, install_exit_probe, markers

from torch_backend._testing import run_distributed


def exit_probe_rank(rank: int, world: int, marker_dir: str) -> int:
    install_exit_probe(marker_dir, str(rank))
    return rank


def test_rank_runs_exit_hooks_and_skips_finalization(tmp_path):
    assert run_distributed(exit_probe_rank, 2, str(tmp_path), timeout=120) == [0, 1]
    assert markers(tmp_path) == clean_exits(["0", "1"])
