"""What one worker of ``chunkzero train`` runs: :func:`worker_main`.

Started by :func:`torch_backend.train.launch.launch` (``nproc`` local processes) or run directly under
``torchrun``; either way ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
are in the environment. The worker joins the process group (:func:`init_distributed`), checks its
inputs with the others (all train or all stop with one message) and runs :func:`torch_backend.train.loop.train`,
which builds the model and loads a resumed checkpoint before :func:`open_out` first writes into ``--out``
(rank 0 prepares it; every rank writes ``pids/rank<r>.pid``).

A worker ends without interpreter finalization, where gloo's threads could abort it
(:mod:`torch_backend.train.process_exit`): :func:`launched_worker` is the entry point the launcher starts,
and under ``torchrun`` the CLI arranges the same exit (:func:`exit_without_finalization_at_exit`).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from chunkzero.errors import CheckpointSaveError, ChunkZeroError, LossScaleError
from chunkzero.job.guards import stop_message
from chunkzero.job.models import load_run_corpus
from chunkzero.job.report import setup_logging
from chunkzero.run_dir import write_run_config
from chunkzero.train_config import TrainConfig
from chunkzero.workers import (
    LAUNCHER_EXIT_WAIT_S,
    exit_on_stop_signals,
    outlive_on_stop,
    remove_orphaned_launch_dir,
)

from ..zero.collectives import all_gather_json, barrier, world_group
from .launch import EXIT_PEER_LOST
from .loop import StepHook, train
from .process_exit import exit_without_finalization_at_exit
from .resolve import resolve_device, threads_per_worker, validate

log = logging.getLogger("chunkzero.train")

PEER_LOST_GRACE_S = 3.0
"""How long a worker that lost a peer waits before exiting (the agent polls every 0.5 s)."""


def init_distributed(cfg: TrainConfig) -> tuple[int, int, int, torch.device]:
    """``(rank, world_size, local_rank, device)``; joins the process group given by the environment
    (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``… set by ``torchrun`` or our launcher) with a collective
    timeout of ``cfg.timeout_s``, so a vanished peer ends the run instead of hanging for 30 minutes. Every
    worker, CPU or CUDA, runs ``cores // local workers`` intra-op threads (:func:`threads_per_worker`)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device_type = resolve_device(cfg.device)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # CUDA workers too: each runs its offloaded optimizer on the host, and 8 ranks each using every core
    # would oversubscribe the machine 8 times
    torch.set_num_threads(threads_per_worker(local_world))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=_dt.timedelta(seconds=cfg.timeout_s), **kwargs)
    return rank, world, local_rank, device


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says another worker vanished (a broken or timed-out collective)."""
    if isinstance(exc, getattr(dist, "DistBackendError", ())) or isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("connection closed by peer", "connection reset", "broken pipe", "timed out",
                            "timeout", "read error"))


def _check_together(cfg: TrainConfig, rank: int, group):
    """Every rank checks its inputs at once (under torchrun nobody did yet; a launched run's were checked
    by the launcher, so only the corpus is loaded); rank 0 alone resolves and checks ``--out`` (and, with
    ``--resume``, the checkpoint), and its ``out`` and ``schedule_steps`` are every rank's. The
    verdicts are exchanged, so either all ranks train or all stop with one error.

    Returns ``(error message or None, resolved config, corpus)``."""
    error, corpus = None, None
    try:
        if cfg.validated:
            corpus = load_run_corpus(cfg)
        else:
            cfg, corpus = validate(cfg, check_out=rank == 0)
    except ChunkZeroError as e:
        error = str(e)
    verdicts = all_gather_json([error, cfg.out, cfg.schedule_steps, cfg.resume_changes, cfg.val_sequences], group)
    errors = [v[0] for v in verdicts if v[0] is not None]
    if not errors:  # rank 0 resolved them (with the checkpoint)
        cfg.out, cfg.schedule_steps, cfg.resume_changes, cfg.val_sequences = verdicts[0][1:]
    return (errors[0] if errors else None), cfg, corpus


def open_out(cfg: TrainConfig, corpus, rank: int, world: int, group, error: str | None) -> None:
    """The first writes of a run into ``--out``, once every rank checked everything it can (the resumed
    checkpoint loaded): with an ``error`` on any rank, every rank raises it and ``--out`` is left as it
    was; else rank 0 prepares ``--out`` and writes ``config.json`` and ``train.log``, and every rank its pid.

    Raises:
        ChunkZeroError: the first rank's error, on every rank.
    """
    errors = [e for e in all_gather_json(error, group) if e is not None]
    if errors:
        raise ChunkZeroError(errors[0])
    out = Path(cfg.out)
    if rank == 0:
        write_run_config(cfg, corpus, world)
        setup_logging(rank, out)
    barrier(group)
    pid_dir = out / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")


def worker_main(cfg: TrainConfig, on_step_end: Sequence[StepHook] = ()) -> dict:
    """What one worker runs. Returns ``{"status": "ok", "summary": ...}``, ``{"status": "error",
    "message": ...}`` for bad input (the CLI prints it once and exits 2) or ``{"status": "failed",
    "message": ...}`` for a run that cannot make progress (fp16 skipping every step: the CLI prints it
    once and exits 1); exits with
    :data:`torch_backend.train.launch.EXIT_PEER_LOST` when another worker vanished mid-run.
    ``on_step_end``: hooks for :func:`torch_backend.train.loop.train`."""
    rank = int(os.environ.get("RANK", 0))
    setup_logging(rank, None)
    # SIGTERM/SIGINT (also the launcher's death: spawn's PR_SET_PDEATHSIG) end it quietly; rank 0, which hosts
    # JAX's coordination service once it saved, last (a JAX client that loses the service aborts, printing
    # absl's fatal lines), so the others end at the signal itself, whatever their main thread is doing
    exit_on_stop_signals(at_once=rank != 0, launcher_exit_wait_s=LAUNCHER_EXIT_WAIT_S)
    try:
        rank, world, _, device = init_distributed(cfg)
        group = world_group()
        host = socket.gethostname()
        peers = all_gather_json([host, os.getpid()], group)
        if rank == 0:
            outlive_on_stop(pid for peer_host, pid in peers if peer_host == host)  # (another node's: out of reach)
        error, cfg, corpus = _check_together(cfg, rank, group)
        if error is not None:
            return {"status": "error", "message": error}
        summary = train(cfg, corpus, rank, world, device, on_step_end=on_step_end,
                        open_out=lambda error: open_out(cfg, corpus, rank, world, group, error))
        return {"status": "ok", "summary": summary}
    except LossScaleError as e:  # the run started and cannot make progress: a failure, not bad input
        return {"status": "failed", "message": stop_message(e, cfg)}
    except CheckpointSaveError as e:  # a save failed mid-run (a full disk ...): a failure too, exit 1
        return {"status": "failed", "message": str(e)}
    except ChunkZeroError as e:
        return {"status": "error", "message": str(e)}
    except Exception as e:
        if is_peer_failure(e):
            log.error("rank %d: a collective failed, another worker has stopped (%s)", rank, str(e).splitlines()[0])
            sys.stderr.flush()
            # Give the agent time to see the worker that died first (it reports one failure per poll and
            # stops the rest), so the run names the cause and not this consequence.
            time.sleep(PEER_LOST_GRACE_S)
            remove_orphaned_launch_dir()  # a peer lost because the launcher died (kill -9): its temp directory too
            os._exit(EXIT_PEER_LOST)
        raise
    finally:
        remove_orphaned_launch_dir()  # only where the launcher is gone (kill -9), whatever ended this worker
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # pragma: no cover - best effort at exit  # noqa: BLE001 - process exit: must not raise
                pass


def launched_worker(cfg: TrainConfig, on_step_end: Sequence[StepHook] = ()) -> dict:
    """:func:`worker_main` as started by :func:`torch_backend.train.launch.launch`: returns its result (which the
    launcher collects after this returns) and makes the process then exit with status 0 without
    interpreter finalization (:func:`torch_backend.train.process_exit.exit_without_finalization_at_exit`)."""
    result = worker_main(cfg, on_step_end)
    exit_without_finalization_at_exit(0)
    return result
