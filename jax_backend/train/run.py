"""The launcher side of ``chunkzero train --backend jax``: check the run, then start the processes.

:func:`main` is the CLI's entry: it checks every input before anything starts
(:func:`jax_backend.train.checks.validate`); under an external launcher (:data:`chunkzero.workers.COORDINATOR_ENV`
… set) this process is one of the run; else it launches ``--nproc`` processes of :mod:`jax_backend.train.worker`.
Exit codes as for torch: 0 done, 1 a process failed (named), a save failed or the run cannot make progress,
2 bad input.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from chunkzero.errors import ChunkZeroError
from chunkzero.host_memory import huge_page_malloc_env
from chunkzero.run_dir import stopped_run_checkpoints
from chunkzero.train_config import TrainConfig
from chunkzero.workers import (
    COORDINATOR_ENV,
    CPU_THREADS_ENV,
    Stopped,
    WorkerFailure,
    launch_processes,
    stopped_message,
    threads_per_worker,
)

from .checks import validate

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ")
"""The line jaxlib's gloo prints on each process's stdout (C++ ``std::cout``, no option or environment variable
turns it off) when its first cross-process collective connects: left out of the run's output."""
PROG = "chunkzero train"
log = logging.getLogger("chunkzero.cli")


def under_external_launcher() -> bool:
    """Whether the environment already places this process in a multi-process run."""
    return bool(os.environ.get(COORDINATOR_ENV))


def outcome(results: list[dict]) -> tuple[int, str | None]:
    """The exit code and message of the processes' results: bad input first, then a failed run."""
    for status, code in (("error", EXIT_BAD_INPUT), ("failed", EXIT_FAILED)):
        for r in results:
            if r.get("status") == status:
                return code, r.get("message")
    return EXIT_OK, None


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return code


def process_env(cfg: TrainConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of ``cfg``'s JAX processes: ``environ`` (``XLA_FLAGS`` included: XLA's options reach every
    process; their device count is ``--devices-per-process``, set through ``jax_num_cpu_devices``, which wins over
    ``--xla_force_host_platform_device_count``), with :data:`CPU_THREADS_ENV` at cores / processes unless set (as
    torch's workers) and malloc on huge pages (:func:`huge_page_malloc_env`: the step's temp buffer faulted in
    2 MiB at a time, not 4 KiB, on every step)."""
    env = dict(environ)
    env.setdefault(CPU_THREADS_ENV, str(threads_per_worker(cfg.nproc)))
    huge_page_malloc_env(env)
    return env


def main(cfg: TrainConfig) -> int:
    """``chunkzero train --backend jax``: the exit code."""
    if under_external_launcher():
        from .worker import worker_main

        result = worker_main(cfg)
        code, message = outcome([result])
        if code != EXIT_OK and os.environ.get("JAX_PROCESS_ID") == "0":
            _fail(message, code)
        return code
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg, _ = validate(cfg)
    except ChunkZeroError as e:
        return _fail(str(e))
    out = Path(cfg.out).resolve()
    log.info("chunkzero train --backend jax: %d process(es) × %d CPU device(s), output in %s", cfg.nproc,
             cfg.devices_per_process, out)
    env = process_env(cfg, os.environ)
    with tempfile.TemporaryDirectory(prefix="chunkzero-jax-") as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(cfg.to_dict()), encoding="utf-8")
        try:
            results = launch_processes([sys.executable, "-m", "jax_backend.train.worker", str(cfg_path)], cfg.nproc,
                                       tmp, env=env, finish_timeout_s=max(60.0, 2 * cfg.timeout_s),
                                       peer_timeout_s=cfg.timeout_s, drop_stdout=GLOO_CONNECTED)
        except WorkerFailure as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return EXIT_FAILED
        except Stopped as e:  # the workers are stopped; the temp directory goes with this block
            print(f"\n{PROG}: {stopped_message(e.signum, stopped_run_checkpoints(out))}", file=sys.stderr)
            return 128 + e.signum
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    code, message = outcome(results)
    if code != EXIT_OK:
        return _fail(message, code)
    log.info("chunkzero train --backend jax: done; outputs in %s", out)
    return EXIT_OK
