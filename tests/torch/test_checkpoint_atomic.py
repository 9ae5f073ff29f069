"""Atomic, asynchronous and bounded saves: kill -9 of one rank mid-save, async save committed at exit,
keep-last-N, no overwriting. Shard-level writers (``write_shards``) in fresh processes, so no model
is needed and the arrays can be big enough for a kill to land mid-write."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from chunkzero.checkpoint import CheckpointMeta
from chunkzero.errors import CheckpointError, ConfigError
from chunkzero.layout import ChunkLayout, TensorSpec
from torch_backend.checkpoint.sharded import (
    checkpoint_steps,
    latest_step,
    read_meta,
    read_shards,
    write_shards,
)

DEAD_RANK_TIMEOUT_S = 10
"""timeout_s of the save whose other rank is killed: long enough for a healthy write of these arrays
on a loaded machine, short enough for the test."""

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WRITER = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    from chunkzero.checkpoint import CheckpointMeta
    from chunkzero.layout import ChunkLayout, TensorSpec
    from torch_backend.checkpoint.sharded import checkpoint_steps, wait_until_finished, write_shards
    from chunkzero.checkpoint.orbax_store import read_array_metadata
    from torch_backend.checkpoint.parallel_write import process_mesh

    rank, world, coordinator, root, step, numel, kill = sys.argv[1:8]
    rank, world, step, numel, kill = int(rank), int(world), int(step), int(numel), kill == "1"
    timeout_s = float(os.environ.get("TIMEOUT_S", "300"))
    layout = ChunkLayout.build([TensorSpec(f"w{i}", (numel,)) for i in range(4)], numel, world)
    shards = {c.index: np.full(layout.shard_numel(c.index), 10 * step + rank, np.float32) for c in layout.chunks}
    t0 = time.perf_counter()

    def failed(e):
        print(f"{type(e).__name__} after {time.perf_counter() - t0:.0f} s: {e}", flush=True)

    if os.environ.get("IDLE_S"):  # this rank joins JAX's group, then never comes to the save
        process_mesh(rank, world, coordinator=coordinator, timeout_s=timeout_s)
        print("joined", flush=True)
        time.sleep(float(os.environ["IDLE_S"]))
        sys.exit(0)
    try:
        write_shards(root, CheckpointMeta(step=step, layout=layout), rank, shards, coordinator=coordinator,
                     async_save=True, timeout_s=timeout_s)
    except Exception as e:
        failed(e)
        sys.exit(0)
    returned = time.perf_counter() - t0
    print(f"handed over in {returned:.3f} s; committed already: {step in checkpoint_steps(root)}", flush=True)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-write: the shards are still being written
    if os.environ.get("WAIT") == "1":
        try:
            wait_until_finished()
            print("committed", flush=True)
        except Exception as e:
            failed(e)
    if os.environ.get("THEN_READ") == "1":  # rank 0 reads the step's array metadata alone; the others stay away
        if rank == 0:
            t1 = time.perf_counter()
            read_array_metadata(root)
            print(f"read alone in {time.perf_counter() - t1:.1f} s", flush=True)
        else:
            time.sleep(60)
    # else: exit at once; the pending save completes in the atexit handler
    """
)


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    return env


def _start(rank, world, port, root, step, numel, kill=False, wait=True, timeout_s=300, idle_s=None, then_read=False):
    env = _env()
    env["WAIT"] = "1" if wait else "0"
    env["THEN_READ"] = "1" if then_read else "0"
    env["TIMEOUT_S"] = str(timeout_s)
    if idle_s is not None:
        env["IDLE_S"] = str(idle_s)
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            WRITER,
            str(rank),
            str(world),
            f"127.0.0.1:{port}",
            str(root),
            str(step),
            str(numel),
            "1" if kill else "0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expected(root, step):
    meta = read_meta(root, step)
    target = meta.layout.relayout(1)
    params, _ = read_shards(root / str(step), meta, target, 0)
    return meta, params


@pytest.mark.slow
def test_kill9_of_one_rank_mid_save_keeps_previous_step(tmp_path):
    root = tmp_path / "ckpt"
    numel = 4_000_000  # 4 arrays x 2 ranks x 8 MB: the write outlives the kill
    port = _free_port()
    ranks = [_start(r, 2, port, root, 1, numel) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert checkpoint_steps(root) == [1]

    port = _free_port()
    ranks = [_start(0, 2, port, root, 2, numel, timeout_s=DEAD_RANK_TIMEOUT_S),
             _start(1, 2, port, root, 2, numel, kill=True, timeout_s=DEAD_RANK_TIMEOUT_S)]
    ranks[1].wait(timeout=240)
    assert ranks[1].returncode == -signal.SIGKILL
    # rank 0 can never commit without rank 1: its wait ends with an error after timeout_s, and the
    # process ends (JAX's shutdown barrier at exit is bounded by timeout_s too)
    out0 = ranks[0].communicate(timeout=240)[0]
    assert "committed" not in out0.splitlines(), out0
    assert re.search(
        rf"CheckpointSaveError after \d+ s: (step 2|a pending save) was not saved under "
        rf"'{re.escape(str(root.resolve()))}': "
        rf"another process did not arrive within timeout_s={DEAD_RANK_TIMEOUT_S} s",
        out0,
    ), out0

    assert checkpoint_steps(root) == [1] and latest_step(root) == 1
    assert not (root / "2").exists()
    meta, params = _expected(root, 1)  # the previous step loads, resharded to one rank
    for c in meta.layout.chunks:
        half = meta.layout.shard_numel(c.index)
        assert np.all(params[c.index][:half] == 10) and np.all(params[c.index][half:] == 11)

    # the interrupted step can be written afterwards (here by a world of one)
    meta = _tiny_meta(2)
    write_shards(root, meta, 0, _shards(meta, 2.0))
    assert checkpoint_steps(root) == [1, 2]


@pytest.mark.slow
def test_a_rank_that_never_comes_to_the_save_ends_it_with_an_error(tmp_path):
    """Rank 1 joins JAX's group but never saves: rank 0 waits in Orbax's first barrier (the manager's,
    on the main thread, which Orbax bounds by a module constant of 300 s) only ``timeout_s``, then
    raises; nothing of the step is committed."""
    root = tmp_path / "ckpt"
    port = _free_port()
    idle_s = 240  # outlives the bound below: a save that waited for this rank would fail the test
    ranks = [_start(0, 2, port, root, 1, 1000, timeout_s=DEAD_RANK_TIMEOUT_S),
             _start(1, 2, port, root, 1, 1000, timeout_s=DEAD_RANK_TIMEOUT_S, idle_s=idle_s)]
    try:
        out0 = ranks[0].communicate(timeout=idle_s - 30)[0]
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    found = re.search(rf"CheckpointSaveError after (\d+) s: step 1 was not saved under "
                      rf"'{re.escape(str(root.resolve()))}': another process did not arrive within "
                      rf"timeout_s={DEAD_RANK_TIMEOUT_S} s", out0)
    assert found, out0
    assert int(found[1]) < DEAD_RANK_TIMEOUT_S + 60, out0  # its bound, plus the start of JAX on a loaded machine
    assert checkpoint_steps(root) == []


def test_a_read_under_jax_distributed_waits_for_no_other_process(tmp_path):
    """After a save the ranks are JAX processes; Orbax's read-only manager would make each read a
    collective of all of them. Rank 0 reads alone while rank 1 stays away."""
    root = tmp_path / "ckpt"
    port = _free_port()
    ranks = [_start(r, 2, port, root, 1, 1000, timeout_s=DEAD_RANK_TIMEOUT_S, then_read=True) for r in range(2)]
    try:
        out0 = ranks[0].communicate(timeout=200)[0]
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    found = re.search(r"read alone in ([0-9.]+) s", out0)
    assert "committed" in out0.splitlines() and found, out0
    assert float(found[1]) < DEAD_RANK_TIMEOUT_S, out0


def test_async_save_returns_before_commit_and_exit_waits(tmp_path):
    root = tmp_path / "ckpt"
    p = _start(0, 1, 0, root, 7, 8_000_000, wait=False)  # 4 x 32 MB, then exit immediately
    out = p.communicate(timeout=240)[0]
    assert p.returncode == 0, out
    assert "committed already: False" in out  # training could continue while Orbax wrote
    assert checkpoint_steps(root) == [7]  # the exit handler waited for the commit
    _, params = _expected(root, 7)
    assert all(np.all(a == 70) for a in params.values())


def _tiny_meta(step, world=1):
    return CheckpointMeta(
        step=step, layout=ChunkLayout.build([TensorSpec("w", (10,)), TensorSpec("b", (3,))], 8, world)
    )


def _shards(meta, value):
    return {c.index: np.full(meta.layout.shard_numel(c.index), value, np.float32) for c in meta.layout.chunks}


def test_keep_last_n_and_never_overwrite(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3, 4):
        meta = _tiny_meta(step)
        write_shards(root, meta, 0, _shards(meta, step), max_to_keep=2)
    assert checkpoint_steps(root) == [3, 4]
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    meta = _tiny_meta(4)
    with pytest.raises(CheckpointError, match="step 4 already exists"):
        write_shards(root, meta, 0, _shards(meta, 99), max_to_keep=2)
    meta = _tiny_meta(2)
    with pytest.raises(CheckpointError, match="before the latest step 4"):
        write_shards(root, meta, 0, _shards(meta, 99), max_to_keep=2)
    with pytest.raises(ConfigError, match="max_to_keep"):
        write_shards(root, _tiny_meta(9), 0, _shards(_tiny_meta(9), 1), max_to_keep=0)
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert after == before
    _, params = _expected(root, 4)
    assert all(np.all(a == 4) for a in params.values())


def test_async_save_keeps_the_values_it_was_handed(tmp_path):
    """Changing the live shards right after an async save returns must not leak into the checkpoint
    (JAX on CPU may alias an aligned numpy buffer instead of copying it)."""
    numel = 1 << 20
    layout = ChunkLayout.build([TensorSpec("w", (numel,))], numel, 1)
    import torch

    shard = torch.ones(numel)  # torch's allocations are aligned, so JAX could alias them
    write_shards(tmp_path, CheckpointMeta(step=1, layout=layout), 0, {0: shard.numpy()}, async_save=True)
    shard.add_(1.0)  # training goes on and updates the shard in place
    from torch_backend.checkpoint.sharded import wait_until_finished

    wait_until_finished()
    params, _ = read_shards(tmp_path / "1", read_meta(tmp_path, 1), layout, 0)
    np.testing.assert_array_equal(params[0], np.full(numel, 1.0, np.float32))


def test_step_removed_outside_the_writer_can_be_written_again(tmp_path):
    """The writer of a root is kept for the process; a step deleted by hand (a bad save thrown away)
    can be saved again, and ``max_to_keep`` counts only the steps on disk."""
    import shutil

    meta = _tiny_meta(1)
    write_shards(tmp_path, meta, 0, _shards(meta, 1.0), max_to_keep=2)
    shutil.rmtree(tmp_path / "1")
    write_shards(tmp_path, meta, 0, _shards(meta, 2.0), max_to_keep=2)
    for step in (2, 3):
        write_shards(tmp_path, _tiny_meta(step), 0, _shards(_tiny_meta(step), float(step)), max_to_keep=2)
    assert checkpoint_steps(tmp_path) == [2, 3]
    _, params = _expected(tmp_path, 3)
    assert all(np.all(a == 3) for a in params.values())
