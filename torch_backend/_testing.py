"""Run a function on ``world_size`` spawned processes with a gloo process group (tests, benchmarks).

``run_distributed(fn, world_size, *args)`` spawns one process per rank, initializes
``torch.distributed`` with gloo through a file store (no port to pick, no race), calls
``fn(rank, world_size, *args)`` and returns every rank's return value in rank order. Return values
travel through ``torch.save`` / ``torch.load(weights_only=True)`` (never unpickled): they may nest
dicts, lists and tuples of tensors, numpy arrays, numbers, strings and ``None``. A failing rank's traceback is re-raised in the caller; a run that takes longer than
``timeout`` seconds is killed and raises :class:`TimeoutError`, so a hung collective never hangs
the test suite.

A rank that succeeded ends without interpreter finalization
(:func:`torch_backend.train.process_exit.exit_without_finalization`): gloo's worker threads outlive
``destroy_process_group()`` and abort a process that finalizes under them.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.multiprocessing as mp

from .train.process_exit import exit_without_finalization

__all__ = ["run_distributed"]


def _entry(rank: int, fn: Callable, world_size: int, init_file: str, out_dir: str, args: tuple, env: dict, timeout: float,
           backend: str = "gloo"):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(env.get("CHUNKZERO_TEST_THREADS", "1")))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    from torch_backend.zero import collectives

    try:
        result = fn(rank, world_size, *args)
        collectives.barrier(collectives.world_group())
    finally:
        dist.destroy_process_group()
    torch.save(_encode(result), os.path.join(out_dir, f"{rank}.pt"))
    exit_without_finalization(0)


def _encode(obj: Any) -> Any:
    """``obj`` in the types ``torch.load(weights_only=True)`` accepts (numpy arrays become tensors)."""
    import torch

    if isinstance(obj, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.array(obj, copy=True))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    raise TypeError(f"run_distributed: a rank returned a {type(obj).__name__}, which cannot travel without pickle")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.keys() == {"__ndarray__"}:
            return obj["__ndarray__"].numpy()
        if obj.keys() == {"__tuple__"}:
            return tuple(_decode(v) for v in obj["__tuple__"])
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0, env: dict | None = None,
                    backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.

    Args:
        fn: a module-level function (spawn imports it by name).
        timeout: seconds for the whole run; the processes are killed past it.
        env: extra environment variables for the children (``HF_HUB_OFFLINE=1`` is always set).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank ``r`` uses GPU ``r % device_count``).

    Raises:
        TimeoutError: the run exceeded ``timeout``.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the message).
    """
    child_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="chunkzero-dist-") as tmp:
        init_file = os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, init_file, tmp, args, child_env, timeout, backend),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join(5)
                raise TimeoutError(f"distributed run of {getattr(fn, '__name__', fn)} (world size {world_size}) exceeded {timeout}s")
        import torch

        return [_decode(torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=True)) for rank in range(world_size)]
