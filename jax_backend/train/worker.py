"""What one process of ``chunkzero train --backend jax`` runs: :func:`worker_main`.

Started by :mod:`jax_backend.train.run` (``python -m jax_backend.train.worker CONFIG.json``, the place in
the environment) or run in-process under an external launcher. The process joins the others
(:func:`jax_backend.processes.join_processes`, every wait bounded by ``--timeout``), checks its inputs
with them (all train or all stop with one message) and runs :func:`jax_backend.train.loop.train`, which
builds the engine and loads a resumed checkpoint before :func:`open_out` first writes into ``--out``
(process 0 prepares it; every process writes ``pids/process<i>.pid``). A collective that fails because
another process vanished ends it with :data:`chunkzero.workers.EXIT_PEER_LOST`, a consequence the
launcher never names as the cause. SIGTERM, SIGINT and SIGHUP end the process at once, and so does its
launcher's end (:func:`chunkzero.workers.exit_on_stop_signals`, :func:`~chunkzero.workers.watch_launcher`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from chunkzero.errors import CheckpointSaveError, ChunkZeroError, LossScaleError
from chunkzero.job.guards import stop_message
from chunkzero.process_exit import exit_without_finalization
from chunkzero.run_dir import write_run_config
from chunkzero.train_config import TrainConfig
from chunkzero.workers import (
    EXIT_PEER_LOST,
    exit_on_stop_signals,
    remove_orphaned_launch_dir,
    watch_launcher,
    write_result,
)

log = logging.getLogger("chunkzero.train")

PEER_LOST_GRACE_S = 3.0
"""How long a process that lost a peer waits before exiting, so the launcher sees the cause first."""

_PEER_LOST_SIGNS = ("heartbeat", "unavailable", "connection", "broken pipe", "socket closed", "deadline exceeded",
                    "gloo", "timed out", "timeout")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says another process vanished (a failed or timed-out collective or barrier)."""
    text = str(exc).lower()
    return not isinstance(exc, ChunkZeroError) and any(s in text for s in _PEER_LOST_SIGNS)


def _check_together(cfg: TrainConfig, place):
    """Each process checks its inputs (a launched run's were checked by the launcher: only the corpus is
    loaded); process 0 alone checks ``--out`` and the checkpoint, and its ``out`` and ``schedule_steps`` are
    every process's. Returns ``(error or None, config, corpus)``."""
    from chunkzero.job.models import load_run_corpus
    from jax_backend.processes import all_gather_json

    from .checks import validate

    error, corpus = None, None
    try:
        if cfg.validated:
            corpus = load_run_corpus(cfg)
        else:
            cfg, corpus = validate(cfg, check_out=place.process_id == 0, num_processes=place.num_processes)
    except ChunkZeroError as e:
        error = str(e)
    verdicts = all_gather_json([error, cfg.out, cfg.schedule_steps, cfg.resume_changes, cfg.val_sequences])
    errors = [v[0] for v in verdicts if v[0] is not None]
    if not errors:
        cfg.out, cfg.schedule_steps, cfg.resume_changes, cfg.val_sequences = verdicts[0][1:]
    return (errors[0] if errors else None), cfg, corpus


def open_out(cfg: TrainConfig, corpus, process_id: int, error: str | None) -> None:
    """The first writes of a run into ``--out``, once every process checked everything it can (the resumed
    checkpoint loaded): with an ``error`` on any process, every process raises it and ``--out`` is left as
    it was; else process 0 prepares ``--out`` and writes ``config.json`` and ``train.log``, and every
    process its pid.

    Raises:
        ChunkZeroError: the first process's error, on every process.
    """
    from chunkzero.job.report import setup_logging
    from jax_backend.processes import all_gather_json

    errors = [e for e in all_gather_json(error) if e is not None]
    if errors:
        raise ChunkZeroError(errors[0])
    out = Path(cfg.out)
    if process_id == 0:
        write_run_config(cfg, corpus, cfg.world_size)
        setup_logging(0, out)
    all_gather_json(None)  # --out exists before anyone writes into it
    pid_dir = out / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"process{process_id}.pid").write_text(f"{os.getpid()}\n")


def worker_main(cfg: TrainConfig) -> dict:
    """What one process runs. Returns ``{"status": "ok", "summary": ...}``, ``{"status": "error",
    "message": ...}`` (bad input: the CLI prints it once and exits 2) or ``{"status": "failed", "message": ...}``
    (the run cannot make progress, :class:`chunkzero.job.guards.NonFiniteStop`: exit 1); exits with
    :data:`~chunkzero.workers.EXIT_PEER_LOST` when another process vanished mid-run."""
    from chunkzero.job.report import setup_logging
    from jax_backend.processes import (
        all_gather_json,
        compilation_cache_dir,
        cpu_threads,
        join_processes,
        process_place,
        use_compilation_cache,
    )

    place = process_place()
    setup_logging(place.process_id, None)
    # Every process stops in its handler, between two calls: a process ended by the signal itself (as a torch
    # worker's but rank 0 are) can leave the others blocked in a JAX collective with it, until the coordination
    # service sees it gone and aborts them with absl's fatal lines.
    exit_on_stop_signals()
    watch_launcher()
    try:
        join_processes(cfg.devices_per_process, cfg.timeout_s, place, threads=cpu_threads())
        use_compilation_cache(compilation_cache_dir())  # a restarted run loads its step instead of compiling it
        exit_on_stop_signals()  # again: jax.distributed.initialize's preemption notifier took SIGTERM
        error, cfg, corpus = _check_together(cfg, place)
        if error is not None:
            return {"status": "error", "message": error}
        from .loop import train

        summary = train(cfg, corpus, place, open_out=lambda error: open_out(cfg, corpus, place.process_id, error))
        all_gather_json(None)  # process 0 wrote the outputs: all reach jax.distributed's shutdown barrier together
        return {"status": "ok", "summary": summary}
    except LossScaleError as e:  # the run started and cannot make progress: a failure, not bad input
        return {"status": "failed", "message": stop_message(e, cfg)}
    except CheckpointSaveError as e:  # a save failed mid-run (a full disk ...): a failure too, exit 1
        return {"status": "failed", "message": str(e)}
    except ChunkZeroError as e:
        return {"status": "error", "message": str(e)}
    except Exception as e:
        if is_peer_failure(e):
            log.error("process %d: a collective failed, another process has stopped (%s)", place.process_id,
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
            write_result({"status": "peer_lost", "message": str(e)})
            sys.stderr.flush()
            time.sleep(PEER_LOST_GRACE_S)
            remove_orphaned_launch_dir()  # a peer lost because the launcher died (kill -9): its temp directory too
            os._exit(EXIT_PEER_LOST)
        raise


def _main(argv: list[str]) -> None:
    cfg = TrainConfig(**json.loads(Path(argv[1]).read_text(encoding="utf-8")))
    try:
        result = worker_main(cfg)
    except BaseException as e:
        write_result({"status": "crashed", "message": f"{type(e).__name__}: {e}"})
        raise
    write_result({k: v for k, v in result.items() if k != "summary"})
    exit_without_finalization(0)


if __name__ == "__main__":
    _main(sys.argv)
