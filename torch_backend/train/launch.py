"""Starting the workers of a run, with torch's elastic launch API (what ``torchrun`` itself uses).

``chunkzero train`` calls :func:`launch` when it is not already a worker: it starts ``nproc`` local
workers through :func:`torch.distributed.launcher.api.elastic_launch` with a ``c10d`` rendezvous on a
free local port (``torchrun --standalone``'s set-up), ``max_restarts=0``, and the agent polling its
workers every ``monitor_interval_s`` seconds. When one worker dies (killed, out of memory, crashed)
the agent stops the others and :func:`launch` raises :class:`WorkerFailure` whose message names the
rank that failed first.

The workers' environment gets ``MALLOC_MMAP_THRESHOLD_`` (:data:`WORKER_MALLOC_MMAP_THRESHOLD_BYTES`)
unless a threshold is set already, so glibc returns freed gradient-sized buffers to the system.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are set) nothing is launched:
:func:`running_under_torchrun` tells the CLI to run the worker in-process.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Callable

from chunkzero.workers import EXIT_PEER_LOST, WorkerFailure, describe_exit, last_line

__all__ = ["EXIT_PEER_LOST", "WorkerFailure", "describe_failure", "launch", "running_under_torchrun"]

_describe_exit = describe_exit
_first_line = last_line

WORKER_MALLOC_MMAP_THRESHOLD_BYTES = 1 << 20
"""glibc's ``M_MMAP_THRESHOLD`` for the workers (``MALLOC_MMAP_THRESHOLD_``, 1 MiB): every allocation of
at least this size is its own ``mmap``, returned to the system when freed. glibc's default threshold
rises with the blocks freed (up to 32 MiB), after which gradient-sized buffers come from the heap and
stay there once freed: at 0.5B, W = 2 fp32 that held a rank's RSS at the step 1.2 GiB above what the
engine itself holds. Only set for workers whose environment has no threshold of its own."""


def worker_malloc_env(env: dict[str, str]) -> None:
    """Set ``MALLOC_MMAP_THRESHOLD_`` in ``env`` (a worker's environment, before it starts) unless it,
    or ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``, is set already. glibc reads it at start-up;
    other C libraries ignore it."""
    if "MALLOC_MMAP_THRESHOLD_" in env or "glibc.malloc.mmap_threshold" in env.get("GLIBC_TUNABLES", ""):
        return
    env["MALLOC_MMAP_THRESHOLD_"] = str(WORKER_MALLOC_MMAP_THRESHOLD_BYTES)


def running_under_torchrun() -> bool:
    """Whether this process is already a worker of a launched group (``torchrun`` or an agent)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def describe_failure(failures: dict[int, Any], timeout_s: float | None = None) -> WorkerFailure:
    """One message naming the rank that failed first, from elastic's ``{global rank: ProcessFailure}``.

    A rank that exited with :data:`EXIT_PEER_LOST` only saw another one vanish, so it is never the
    cause when another failure is known; among the rest, the earliest wins, then the lowest rank.
    """
    def key(item):
        rank, f = item
        return (f.exitcode == EXIT_PEER_LOST, f.timestamp, rank)

    rank, f = min(failures.items(), key=key)
    msg = f"worker rank {rank} (local rank {f.local_rank}, pid {f.pid}) {_describe_exit(f.exitcode, timeout_s)}"
    detail = ""
    if f.exitcode > 0 and f.exitcode != EXIT_PEER_LOST:
        message = getattr(f, "message", "")
        if isinstance(message, dict):  # elastic's error file: {"message": "...", "extraInfo": {...}}
            message = message.get("message", "")
        detail = _first_line(message if isinstance(message, str) else str(message or ""))
        if detail and detail != "<N/A>":
            msg += f": {detail}"
    others = sorted(r for r in failures if r != rank)
    if others:
        msg += f"; then rank(s) {', '.join(map(str, others))} stopped"
    return WorkerFailure(msg + "; the run was stopped", rank=rank, exitcode=f.exitcode)


def launch(entrypoint: Callable[..., Any], args: tuple, nproc: int, *, monitor_interval_s: float = 0.5,
           shutdown_timeout_s: int = 10, timeout_s: float | None = None) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` local worker processes; ``{rank: return value}``.

    ``entrypoint`` must be a module-level function (workers are started with ``spawn``). Each worker
    finds ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment.

    ``timeout_s``: the workers' collective timeout (``--timeout``), named when the only failure is a lost peer.

    Raises:
        WorkerFailure: a worker failed; the message names the first failing rank.
    """
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from chunkzero.workers import launch_env

    # we report failures and stops ourselves, once; elastic's modules set their own loggers' levels (its
    # get_logger), so each is quietened, not only their parent
    quiet = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*quiet, *(n for n in logging.root.manager.loggerDict if n.startswith(quiet))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # A worker killed by a signal leaves its multiprocessing semaphore to the resource tracker, which
    # would warn about it at exit; the failure is already reported above.
    os.environ.setdefault("PYTHONWARNINGS", "ignore:resource_tracker:UserWarning")
    worker_malloc_env(os.environ)  # the workers inherit it (this process's allocator has started already)
    # elastic's log and error files go to a temp directory of ours, removed after the run (elastic's default,
    # torchelastic_*, is never removed); should this process die first, the workers remove it
    logs = tempfile.TemporaryDirectory(prefix="chunkzero-torch-")
    os.environ.update(launch_env(logs.name))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"chunkzero-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # a free port, like torchrun --standalone
        max_restarts=0,
        monitor_interval=monitor_interval_s,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs.name),
    )
    if hasattr(config, "shutdown_timeout"):
        config.shutdown_timeout = shutdown_timeout_s
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        raise describe_failure(e.failures, timeout_s) from None
    finally:
        logs.cleanup()
