"""Running ``chunkzero train`` as a user would, for the end-to-end tests: with its launcher a process of its own
(:func:`run_train`), or, for a torch run whose processes the test does not look at, with its workers on the test
run's rank pools (:func:`run_train_pooled`)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

SMALL = ["--model", "gpt-tiny", "--seq-len", "32", "--batch-size", "4", "--warmup", "2", "--eval-batches", "2",
         "--sample-tokens", "16", "--lr", "3e-3"]
"""A run small enough for 2 CPU cores: gpt-tiny, 32-token sequences, 4 per worker."""

CORPUS_FILES = ["argparse.py", "textwrap.py", "string.py", "shlex.py", "json/decoder.py", "json/encoder.py"]


def make_corpus(dest: Path) -> Path:
    """A small real corpus (~200 KB of standard-library source) in ``dest``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dest.mkdir(parents=True, exist_ok=True)
    for rel in CORPUS_FILES:
        shutil.copy(stdlib / rel, dest / rel.replace("/", "_"))
    return dest


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh shell: no torchrun variables inherited, the repository importable."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                        "MASTER_PORT") and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def chunkzero_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "chunkzero.cli", *args]


def run_train(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``chunkzero train ARGS`` in ``cwd`` as a shell runs it, as ``subprocess.run(..., capture_output=True,
    text=True)`` returns it. With the default environment (:func:`clean_env`) the launcher is forked from a server
    that imported it once (:mod:`.launcher_fork`: a process of its own, about 2.4 s less CPU a run); with ``env``
    it is ``python -m chunkzero.cli train``."""
    if env is None:
        from chunkzero.cli import build_parser

        from .launcher_fork import run_forked

        try:
            with contextlib.redirect_stderr(io.StringIO()):
                engine = build_parser().parse_args(["train", *args]).backend
        except SystemExit:  # refused by argparse: the command's own refusal is the test's
            engine = None
        if engine is not None:
            return run_forked(["train", *args], engine, cwd, clean_env(), timeout)
    return subprocess.run(chunkzero_cmd("train", *args), cwd=cwd, env=env or clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def run_train_pooled(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``chunkzero train ARGS`` as :func:`run_train` runs it, but the command in this process and its workers on
    the test run's rank pools (``run_distributed``): no launcher or worker process starts, so none imports torch
    (the launcher and each worker import it and ``torch._dynamo``: about 2 s of CPU each). Each worker runs
    ``worker_main``, as a launched one does; its output comes back in the result's ``stdout`` and ``stderr``,
    between the command's lines. A stop signal that reached the command raises ``KeyboardInterrupt`` here.

    For torch runs, and tests of what a run computes and writes, not of its processes: the workers' pids, peak
    RSS (a pooled rank's is its whole life's), collective timeout (``run_distributed``'s ``timeout``, not
    ``--timeout``) and checkpoint runtime (``jax.distributed``, started by the pool's first save at W > 1 and
    reused by its later ones, with that save's timeout) are the pool's, and what native code prints is not
    captured. A JAX run (its engine has no torch launcher to stand in for) runs as :func:`run_train` runs it.
    """
    import logging

    import torch_backend.train.launch as launcher
    from chunkzero.cli import build_parser, main
    from chunkzero.workers import STOP_SIGNALS

    if build_parser().parse_args(["train", *args]).backend != "torch":
        return run_train(*args, cwd=cwd, timeout=timeout)

    def pooled_launch(entrypoint, launch_args, nproc, timeout_s=None):
        from torch_backend._testing import run_distributed

        cfg, hooks = launch_args
        if hooks:
            raise AssertionError("step hooks cannot reach pooled workers: use run_train")
        workers = run_distributed(_pooled_worker, nproc, json.dumps(cfg.to_dict()), timeout=timeout)
        for w in workers:  # where a launched worker's output falls: between the command's lines
            sys.stdout.write(w["stdout"])
            sys.stderr.write(w["stderr"])
        return {rank: json.loads(w["result"]) for rank, w in enumerate(workers)}

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()  # the command's logging.basicConfig then logs to the stderr captured here, as in a shell
    launcher_vars = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    out, err = io.StringIO(), io.StringIO()
    real_launch = launcher.launch
    launcher.launch = pooled_launch
    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["train", *args])
            except SystemExit as e:  # argparse's own checks
                code = e.code
    finally:
        launcher.launch = real_launch
        os.environ.update(launcher_vars)
        for h in root.handlers:
            h.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    if code in {128 + s for s in STOP_SIGNALS}:  # the command stopped on SIGINT, SIGTERM or SIGHUP: the run stops
        raise KeyboardInterrupt(err.getvalue()[-2000:])
    return subprocess.CompletedProcess(["chunkzero", "train", *args], code, out.getvalue(), err.getvalue())


def _pooled_worker(rank: int, world_size: int, cfg_json: str) -> dict:
    """One pooled worker of :func:`run_train_pooled`: ``worker_main`` with ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` set (the rest of the environment is the test process's), its output
    captured. What a run sets for its process (logging, the stop-signal handlers and state) is put back after
    it, for the pool's next call. At world size 1 it runs without a process group, as a launched worker does."""
    import logging
    import signal

    import torch.distributed as dist

    import chunkzero.workers as workers
    from chunkzero.train_config import TrainConfig
    from torch_backend.train.worker import worker_main

    if world_size == 1:
        dist.destroy_process_group()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))

    def loggers() -> list[logging.Logger]:
        return [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                        if isinstance(lg, logging.Logger))]

    kept = {lg: (lg.handlers[:], lg.level) for lg in loggers()}
    signals = {s: signal.getsignal(s) for s in workers.STOP_SIGNALS}
    stop_state = workers._stop_signals_owned, workers._outlived
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = worker_main(TrainConfig(**json.loads(cfg_json)))
    finally:
        for lg in loggers():
            if lg not in kept:  # a library's, made during the run: its console handler back on the real stderr
                for h in lg.handlers:
                    if isinstance(h, logging.StreamHandler) and h.stream in (out, err):
                        h.setStream(sys.stderr)
                continue
            handlers, level = kept[lg]
            for h in lg.handlers:
                if h not in handlers:
                    h.close()
            lg.handlers[:] = handlers
            lg.setLevel(level)
        for s, h in signals.items():
            signal.signal(s, h)
        workers._stop_signals_owned, workers._outlived = stop_state
    return {"result": json.dumps(result), "stdout": out.getvalue(), "stderr": err.getvalue()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    """``(train records, val records)`` of ``out/metrics.jsonl``."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "val"]


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def _no_workers(*a, **k):
    raise AssertionError("a worker was launched for a run that should have been refused")


def refused_line(args: list[str], backend: str, monkeypatch, capsys) -> str:
    """``chunkzero train --backend BACKEND ARGS`` in-process, with launchers that fail the test: its one
    error line, after checking exit code 2."""
    import jax_backend.train.run
    import torch_backend.train.launch

    monkeypatch.setattr(torch_backend.train.launch, "launch", _no_workers)
    monkeypatch.setattr(jax_backend.train.run, "launch_processes", _no_workers)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    from chunkzero.cli import main

    try:
        code = main(["train", "--backend", backend, *args])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith("chunkzero train: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def saved_tensors(step_dir: Path, item: str = "params") -> dict[str, np.ndarray]:
    """A checkpoint step's tensors by name, fp32 numpy: the weights (``item="params"``) or their EMA (``"ema"``),
    read with the JAX restore (one device)."""
    import jax_backend as jb

    r = jb.restore_checkpoint(step_dir, jb.make_mesh(1), item=item)
    return {k: np.asarray(v) for k, v in jb.unflatten(r.chunks, r.layout, nested=False).items()}


def normwise_rel_err(got: dict, ref: dict) -> float:
    """``||got − ref||₂ / ||ref||₂`` over every tensor of ``ref`` (float64)."""
    num = sum(float(((np.asarray(got[n], np.float64) - np.asarray(ref[n], np.float64)) ** 2).sum()) for n in ref)
    return (num / sum(float((np.asarray(ref[n], np.float64) ** 2).sum()) for n in ref)) ** 0.5


def flip_saved_bit(step_dir, path):
    """Flip one bit inside the saved bytes of array ``path`` (found on disk by its values)."""
    from chunkzero.checkpoint import read_meta
    from chunkzero.checkpoint.reader import ChunkReader

    values = ChunkReader(step_dir, read_meta(step_dir)).read(path, 1000, 1004)
    needle = np.asarray(values, np.float32).tobytes()
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d" and needle in (b := bytearray(f.read_bytes())):
            b[b.find(needle) + 1] ^= 0x10
            f.write_bytes(bytes(b))
            return
    raise AssertionError(f"the bytes of {path} were not found on disk")
