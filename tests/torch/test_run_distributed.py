"""``run_distributed``: how a spawned rank ends, and the rank pools the test suite runs on.

A rank must not go through interpreter finalization: gloo's worker threads outlive
``destroy_process_group()``, and one that frees a Python tensor while the interpreter finalizes
aborts the rank (SIGABRT, "terminate called without an active exception"; see
``torch_backend.train.process_exit``). The exit hooks of a normal exit must still run: pending
checkpoint saves are committed in a ``threading`` exit hook, ``jax.distributed`` and logging shut
down in ``atexit``.

A pooled rank (``enable_rank_pools``, on for the whole suite in ``tests/conftest.py``) must look to each
call like a spawned one: its own group, the caller's environment and working directory, torch's defaults.
"""

import os
import threading

import pytest
import torch
import torch.distributed as dist
from e2e.exit_probe import clean_exits, install_exit_probe, markers

from torch_backend._testing import run_distributed


def exit_probe_rank(rank: int, world: int, marker_dir: str) -> int:
    install_exit_probe(marker_dir, str(rank))
    return rank


def test_rank_runs_exit_hooks_and_skips_finalization(tmp_path):
    assert run_distributed(exit_probe_rank, 2, str(tmp_path), timeout=120, fresh=True) == [0, 1]
    assert markers(tmp_path) == clean_exits(["0", "1"])


def test_retired_pooled_rank_runs_exit_hooks_and_skips_finalization(tmp_path):
    """A call that leaves a thread running retires its pooled ranks: they end as a spawned rank does
    (the probe's exit hooks have run when ``run_distributed`` returns)."""
    assert run_distributed(exit_probe_with_thread, 2, str(tmp_path), timeout=120) == [0, 1]
    assert markers(tmp_path) == clean_exits(["0", "1"])


def exit_probe_with_thread(rank: int, world: int, marker_dir: str) -> int:
    threading.Thread(target=threading.Event().wait, args=(0.5,)).start()
    return exit_probe_rank(rank, world, marker_dir)


def state_rank(rank: int, world: int, mess: bool) -> dict:
    """What a rank sees of its process; with ``mess``, it changes all of it afterwards."""
    seen = {"pid": os.getpid(), "cwd": os.getcwd(), "probe": os.environ.get("POOL_PROBE"),
            "given": os.environ.get("POOL_GIVEN"),
            "dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
            "threads": torch.get_num_threads(), "world": dist.get_world_size(), "rank": dist.get_rank()}
    if mess:
        os.environ["POOL_PROBE"] = "left behind"
        os.chdir("/")
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.set_num_threads(2)
        dist.new_group([0])
    return seen


def fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 waits for a rank that never comes: the pool must be killed
    return rank


def test_pooled_ranks_are_reused_and_look_fresh(tmp_path, monkeypatch):
    """Two calls run in the same processes; the second sees a spawned rank's state (the caller's
    environment with ``env=`` over it, the caller's directory, torch's default dtype, grad mode and
    thread count), not the first's changes; a spawned run is the reference."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POOL_PROBE", "caller's")
    given = {"POOL_GIVEN": "by env="}
    want = run_distributed(state_rank, 2, False, fresh=True, env=given)
    first = run_distributed(state_rank, 2, True, env=given)
    second = run_distributed(state_rank, 2, False, env=given)
    assert [r["pid"] for r in first] == [r["pid"] for r in second] != [r["pid"] for r in want]
    for got in (first, second):
        for rank in range(2):
            g, w = dict(got[rank]), dict(want[rank])
            g.pop("pid"), w.pop("pid")
            assert g == w == {"cwd": str(tmp_path), "probe": "caller's", "given": "by env=", "dtype": "torch.float32",
                              "grad": True, "threads": 1, "world": 2, "rank": rank}
    assert os.environ["POOL_PROBE"] == "caller's" and os.getcwd() == str(tmp_path)


def test_failed_call_raises_and_discards_the_pool():
    before = run_distributed(state_rank, 2, False)
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        run_distributed(fail_on_rank_1, 2, timeout=60)
    after = run_distributed(state_rank, 2, False)
    assert {r["pid"] for r in before}.isdisjoint(r["pid"] for r in after)
    assert [r["rank"] for r in after] == [0, 1]


def sleep_rank(rank: int, world: int) -> int:
    threading.Event().wait(60)
    return rank


def test_pooled_call_past_its_timeout_raises():
    with pytest.raises(TimeoutError, match="sleep_rank"):
        run_distributed(sleep_rank, 2, timeout=3)
    assert run_distributed(state_rank, 2, False)[1]["rank"] == 1


def echo_rank(rank: int, world: int, *args) -> dict:
    """The arguments as the rank got them, with the process that ran it."""
    return {"pid": os.getpid(), "args": [repr(a) for a in args], "types": [type(a).__name__ for a in args]}


def test_pooled_call_gets_its_arguments_by_value_and_falls_back_to_spawn_for_other_types(tmp_path):
    """A pooled call's arguments travel as results do (never pickled): tensors, arrays, nested tuples, paths
    arrive equal and of their type; an argument of another type (a ``Namespace``) runs on spawned ranks,
    so it arrives too, in other processes."""
    import argparse

    import numpy as np

    args = (tmp_path, (1, "a", None), {"t": torch.arange(3.0)}, np.arange(2, dtype=np.int32))
    pooled = run_distributed(echo_rank, 2, *args)
    again = run_distributed(echo_rank, 2, *args)
    assert [r["pid"] for r in pooled] == [r["pid"] for r in again]  # the pool served both
    assert pooled[0]["args"] == [repr(a) for a in args]
    assert pooled[0]["types"] == ["PosixPath", "tuple", "dict", "ndarray"]
    ns = argparse.Namespace(steps=3)
    spawned = run_distributed(echo_rank, 2, ns)
    assert spawned[0]["args"] == [repr(ns)]
    assert {r["pid"] for r in spawned}.isdisjoint(r["pid"] for r in pooled)


def pid_after_jax(rank: int, world: int, how: str, root: str, step: int) -> int:
    """This rank's pid, after importing JAX (``"import"``, as a checkpoint read does), also making its CPU backend
    (``"backend"``), saving step ``step`` of a checkpoint under ``root`` (``"save"``: ``jax.distributed``
    started, or reused), or, with ``"progress"``, after a progress bar (whose monitor thread would outlive it)."""
    if how == "progress":
        from tqdm import tqdm

        for _ in tqdm(range(2), disable=False):
            pass
        return os.getpid()
    import jax

    if how == "backend":
        jax.devices()
    if how == "save":
        import numpy as np

        from chunkzero.checkpoint import CheckpointMeta
        from chunkzero.layout import ChunkLayout, TensorSpec
        from torch_backend.checkpoint.sharded import write_shards

        layout = ChunkLayout.build([TensorSpec("w", (8,))], 8, world)
        shards = {c.index: np.full(layout.shard_numel(c.index), rank, np.float32) for c in layout.chunks}
        write_shards(root, CheckpointMeta(step=step, layout=layout), rank, shards)
    return os.getpid()


@pytest.mark.parametrize(("how", "kept"), [("import", True), ("progress", True), ("save", True), ("backend", False)])
def test_a_pool_is_kept_while_a_later_save_can_run_in_it(how, kept, tmp_path):
    """JAX imported keeps a pool, and so do a progress bar and a checkpoint save (``jax.distributed`` started for
    these ranks, which their next save reuses); a JAX backend made without it retires the pool
    (``jax.distributed`` could no longer start in it). The next call, a save, runs in the same processes, or in
    new ones."""
    from torch_backend.checkpoint.sharded import checkpoint_steps

    own = {"POOL_CASE": how}  # a pool of its own: not one an earlier case left JAX started in
    first = run_distributed(pid_after_jax, 3, how, str(tmp_path), 1, env=own)
    second = run_distributed(pid_after_jax, 3, "save", str(tmp_path), 2, env=own)
    assert (first == second) == kept, (first, second)
    assert checkpoint_steps(tmp_path) == ([1, 2] if how == "save" else [2])
