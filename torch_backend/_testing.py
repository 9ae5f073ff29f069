"""Run a function on ``world_size`` processes with a gloo process group (tests, benchmarks).

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on ``world_size``
ranks, each in a process of its own with ``torch.distributed`` initialized (gloo, through a file
store: no port to pick, no race), and returns every rank's return value in rank order. Return values
travel through ``torch.save`` / ``torch.load(weights_only=True)`` (never unpickled): they may nest
dicts, lists and tuples of tensors, numpy arrays, numbers, strings and ``None``. A failing rank's
traceback is re-raised in the caller; a run that takes longer than ``timeout`` seconds is killed and
raises :class:`TimeoutError`, so a hung collective never hangs the test suite.

By default each call spawns its ranks. After :func:`enable_rank_pools` (the test suite's
``conftest.py``), a call reuses the idle ranks of an earlier call at the same world size, backend and
``env`` (a *rank pool*) and so skips the processes' start (importing torch costs seconds per rank):
each call gets a new default process group, the caller's ``os.environ``, working directory and
``sys.path``, and a fresh process's torch default dtype, grad mode, thread count and (random) seed. The
function travels by name and its arguments as the return values do (``Path`` s too); a closure or an
argument of another type runs on spawned ranks instead. A
pool is discarded, its processes ended, when a call fails or times out, and its processes exit (as a
spawned rank would, running their exit hooks) before the call returns when the call left state behind
that the next one could trip on: JAX in a state a later checkpoint save cannot use (a backend made at W > 1
without ``jax.distributed``, which starts once per process and only before any backend; or ``jax.distributed``
started other than by a save of this rank and world size) or a thread still running (an asynchronous
checkpoint save). JAX imported (a checkpoint read) or started by a save (which later saves of the same ranks
reuse, as a training job's saves do) keeps the pool. ``fresh=True`` always spawns.

A rank that ends does so without interpreter finalization
(:func:`torch_backend.train.process_exit.exit_without_finalization`): gloo's worker threads outlive
``destroy_process_group()`` and abort a process that finalizes under them.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from importlib import import_module
from multiprocessing.connection import wait
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch.multiprocessing as mp

from .train.process_exit import exit_without_finalization

__all__ = ["close_rank_pools", "enable_rank_pools", "run_distributed"]


def _entry(rank: int, fn: Callable, world_size: int, init_file: str, out_dir: str, args: tuple, env: dict,
           timeout: float, backend: str = "gloo"):
    os.environ.update(env)
    import torch

    _start_rank(rank, env, backend)
    try:
        result = _call(fn, rank, world_size, args, init_file, timeout, backend)
    finally:
        _end_group()
    torch.save(_encode(result), os.path.join(out_dir, f"{rank}.pt"))
    exit_without_finalization(0)


def _start_rank(rank: int, env: dict, backend: str) -> None:
    import torch

    torch.set_num_threads(int(env.get("CHUNKZERO_TEST_THREADS", "1")))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def _call(fn: Callable, rank: int, world_size: int, args: tuple, init_file: str, timeout: float, backend: str) -> Any:
    """``fn``'s result on a new default process group, after a barrier of every rank."""
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    from torch_backend.zero import collectives

    result = fn(rank, world_size, *args)
    collectives.barrier(collectives.world_group())
    return result


def _end_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _encode(obj: Any) -> Any:
    """``obj`` in the types ``torch.load(weights_only=True)`` accepts (numpy arrays become tensors)."""
    import torch

    if isinstance(obj, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.array(obj, copy=True))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, PurePath):
        return {"__path__": str(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    raise TypeError(f"run_distributed: a {type(obj).__name__} cannot travel without pickle")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.keys() == {"__ndarray__"}:
            return obj["__ndarray__"].numpy()
        if obj.keys() == {"__tuple__"}:
            return tuple(_decode(v) for v in obj["__tuple__"])
        if obj.keys() == {"__path__"}:
            return Path(obj["__path__"])
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def _load_results(out_dir: str, world_size: int) -> list[Any]:
    import torch

    paths = [os.path.join(out_dir, f"{rank}.pt") for rank in range(world_size)]
    return [_decode(torch.load(path, weights_only=True)) for path in paths]


def _timeout_error(fn: Callable, world_size: int, timeout: float) -> TimeoutError:
    name = getattr(fn, "__name__", fn)
    return TimeoutError(f"distributed run of {name} (world size {world_size}) exceeded {timeout}s")


# ------------------------------------------------------------------------------------------ rank pools

def _pool_rank(rank: int, world_size: int, conn, env: dict, backend: str) -> None:
    """A pooled rank: runs the calls its pool sends, one at a time, until told to exit.

    Each call is a JSON head: ``sys.path``, environment, working directory, store and output paths, and the
    function by name (``module:qualname``); its arguments wait in the output directory, saved as
    :func:`run_distributed`'s results are (``torch.load(weights_only=True)``). The reply is JSON only.
    """
    os.environ.update(env)
    import torch

    _start_rank(rank, env, backend)
    from tqdm.std import tqdm

    tqdm.monitor_interval = 0  # a progress bar's monitor thread (torch.compile's) outlives it: it would retire us
    fresh_dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    while True:
        try:
            head = json.loads(conn.recv_bytes())
        except EOFError:  # the test process is gone
            break
        if head["op"] == "exit":
            break
        sys.path[:] = head["sys_path"]
        os.environ.clear()
        os.environ.update(head["environ"])
        os.environ.update(env)  # run_distributed's env= wins over the caller's, as in a spawned rank
        os.chdir(head["cwd"])
        torch.seed()  # a spawned process starts from a nondeterministic seed too
        torch.set_default_dtype(fresh_dtype)
        torch.set_grad_enabled(True)
        torch.set_num_threads(threads)
        threads_before = set(threading.enumerate())
        try:
            fn = _named_function(head["fn"])
            args = _decode(torch.load(os.path.join(head["out_dir"], "args.pt"), weights_only=True))
            result = _call(fn, rank, world_size, args, head["init_file"], head["timeout"], backend)
            _end_group()
            torch.save(_encode(result), os.path.join(head["out_dir"], f"{rank}.pt"))
        except BaseException:  # noqa: BLE001  (reported to the test process, which discards the pool)
            conn.send_bytes(json.dumps({"error": traceback.format_exc()}).encode())
            break  # the group may be broken: the pool is discarded
        del fn, args, result
        lingering = [t for t in threading.enumerate()
                     if t not in threads_before and t.is_alive() and not t.name.startswith(_IDLE_THREAD_PREFIXES)]
        retire = _jax_unusable(rank, world_size) or bool(lingering)
        conn.send_bytes(json.dumps({"error": None, "retire": retire}).encode())
    exit_without_finalization(0)


_IDLE_THREAD_PREFIXES = ("metadata_store",)
"""Threads that outlive a call without leaving work behind: Orbax's metadata store keeps a one-thread executor
for each checkpoint write manager (which :mod:`chunkzero.checkpoint.orbax_store` caches per root), idle once
the save it wrote for is committed. A save still in flight has threads of its own, which retire the pool."""


def _jax_unusable(rank: int, world_size: int) -> bool:
    """Whether this process's JAX state could trip a later call's checkpoint save: a backend made at W > 1
    without ``jax.distributed`` (which then can no longer start), or ``jax.distributed`` started other than by
    :func:`torch_backend.checkpoint.parallel_write.process_mesh` as rank ``rank`` of ``world_size`` (whose
    runtime later saves of these ranks reuse). Unsure (JAX's internals moved): ``True``."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import distributed, xla_bridge

        state = distributed.global_state
        if state.service is not None or state.client is not None:
            from .checkpoint.parallel_write import current_process_mesh

            mesh = current_process_mesh()
            return mesh is None or (mesh.rank, mesh.world_size) != (rank, world_size)
        return world_size > 1 and xla_bridge.backends_are_initialized()
    except Exception:  # noqa: BLE001 (retiring is always safe)
        return True


class _RankPool:
    """``world_size`` spawned ranks that run :func:`run_distributed`'s calls one after another."""

    def __init__(self, world_size: int, env: dict, backend: str):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.conns, self.procs = [], []
        try:
            for rank in range(world_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_pool_rank, args=(rank, world_size, theirs, env, backend),
                                   name=f"chunkzero-rank-pool-{world_size}-{rank}")
                proc.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)
        except BaseException:
            self.kill()
            raise

    def run(self, fn_name: str, encoded_args: Any, timeout: float) -> tuple[list[Any], bool]:
        """``(results by rank, whether the ranks asked to retire)``; on any failure the pool is killed.
        ``fn_name``: :func:`_function_name`'s; ``encoded_args``: the arguments, :func:`_encode`'d."""
        import torch

        fn = fn_name
        with tempfile.TemporaryDirectory(prefix="chunkzero-dist-") as tmp:
            torch.save(encoded_args, os.path.join(tmp, "args.pt"))
            head = json.dumps({"op": "run", "sys_path": list(sys.path), "environ": dict(os.environ),
                               "cwd": os.getcwd(), "init_file": os.path.join(tmp, "store"), "out_dir": tmp,
                               "timeout": timeout, "fn": fn_name}).encode()
            deadline = time.monotonic() + timeout
            replies: dict[int, dict] = {}
            try:
                for conn in self.conns:
                    conn.send_bytes(head)
                while len(replies) < self.world_size:
                    waiting = {c: r for r, c in enumerate(self.conns) if r not in replies}
                    sentinels = {self.procs[r].sentinel: r for r in waiting.values()}
                    ready = wait([*waiting, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
                    if not ready:
                        raise _timeout_error(fn, self.world_size, timeout)
                    for obj in ready:
                        if obj in waiting:
                            rank = waiting[obj]
                            try:
                                replies[rank] = json.loads(obj.recv_bytes())
                            except EOFError:
                                replies[rank] = {"error": f"rank {rank} ended without a reply"}
                        elif sentinels[obj] not in replies and not self.conns[sentinels[obj]].poll():
                            rank = sentinels[obj]
                            replies[rank] = {"error": f"rank {rank} exited with code {self.procs[rank].exitcode}"}
                        failed = [(r, rep["error"]) for r, rep in replies.items() if rep["error"]]
                        if failed:
                            rank, error = failed[0]
                            raise mp.ProcessRaisedException(
                                f"\n\n-- Process {rank} terminated with the following error:\n{error}", rank,
                                self.procs[rank].pid)
                results = _load_results(tmp, self.world_size)
            except BaseException:
                self.kill()
                raise
            retire = any(rep["retire"] for rep in replies.values())
            if retire:
                self.close(timeout=max(5.0, deadline - time.monotonic()))
        return results, retire

    def close(self, timeout: float = 30.0) -> None:
        """Ask every rank to exit (they run their exit hooks together), then kill what is left."""
        for conn in self.conns:
            try:
                conn.send_bytes(json.dumps({"op": "exit"}).encode())
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


_POOLS: OrderedDict[tuple, _RankPool] | None = None
"""The live pools, least recently used first; ``None``: pools are off and every call spawns."""
_POOL_MAX_RANKS = 0


def enable_rank_pools(max_ranks: int = 9) -> None:
    """From now on, :func:`run_distributed` reuses ranks (at most ``max_ranks`` idle processes kept).

    Pools are per process: under pytest-xdist each worker has its own.
    """
    global _POOLS, _POOL_MAX_RANKS
    if _POOLS is None:
        _POOLS = OrderedDict()
        atexit.register(close_rank_pools)
    _POOL_MAX_RANKS = max_ranks


def close_rank_pools() -> None:
    """End every pooled rank; later calls spawn again until :func:`enable_rank_pools`."""
    global _POOLS
    pools, _POOLS = _POOLS, None
    for pool in (pools or {}).values():
        pool.close()


def _function_name(fn: Callable) -> str | None:
    """``module:qualname`` of a module-level function that importing its module gives back, else ``None``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    try:
        return f"{module}:{qualname}" if _named_function(f"{module}:{qualname}") is fn else None
    except (ImportError, AttributeError):
        return None


def _named_function(name: str) -> Callable:
    """The function :func:`_function_name` named."""
    module, qualname = name.split(":", 1)
    obj: Any = import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _pooled_run(fn: Callable, world_size: int, args: tuple, timeout: float, env: dict, backend: str) -> list[Any]:
    """:func:`run_distributed` on a pool's ranks; a function or arguments that cannot travel by name and
    ``torch.save`` (a closure, an ``argparse.Namespace``) are run on spawned ranks instead."""
    fn_name = _function_name(fn)
    try:
        encoded_args = _encode(args)
    except TypeError:
        fn_name = None
    if fn_name is None:
        return _spawned_run(fn, world_size, args, timeout, env, backend)
    key = (world_size, backend, tuple(sorted(env.items())))
    pool = _POOLS.pop(key, None)
    if pool is None:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > _POOL_MAX_RANKS:
            _POOLS.popitem(last=False)[1].close()
        pool = _RankPool(world_size, env, backend)
    results, retired = pool.run(fn_name, encoded_args, timeout)  # a pool that failed is killed, not put back
    if not retired:
        _POOLS[key] = pool
    return results


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0, env: dict | None = None,
                    backend: str = "gloo", fresh: bool = False) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.

    Args:
        fn: a module-level function (the ranks import it by name).
        timeout: seconds for the whole run; the processes are killed past it.
        env: extra environment variables for the children (``HF_HUB_OFFLINE=1`` is always set); a
            pooled rank gets them at its start, so pools are kept per ``env``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank ``r`` uses GPU ``r % device_count``).
        fresh: spawn new processes even when rank pools are enabled (a test of a process's start or end).

    Raises:
        TimeoutError: the run exceeded ``timeout``.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the message).
    """
    child_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if _POOLS is not None and not fresh:
        return _pooled_run(fn, world_size, args, timeout, child_env, backend)
    return _spawned_run(fn, world_size, args, timeout, child_env, backend)


def _spawned_run(fn: Callable, world_size: int, args: tuple, timeout: float, child_env: dict,
                 backend: str) -> list[Any]:
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
                raise _timeout_error(fn, world_size, timeout)
        return _load_results(tmp, world_size)
