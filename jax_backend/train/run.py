"""The launcher side of ``chunkzero train --backend jax``: check the run, then start the processes.

:func:`validate` checks every input before anything starts (as :func:`torch_backend.train.resolve.validate`
does for torch; what a machine cannot change is :meth:`chunkzero.train_config.TrainConfig.check`'s):
CPU only, ``--nproc`` processes × ``--devices-per-process`` devices, the CPU defaults, the model (a
byte-level GPT, or a Hugging Face GPT-2 directory: :func:`check_hf_model`) and ``--seq-len``, ``--out``, ``--resume``'s checkpoint (its step and tensors) and the corpus. :func:`main`
is the CLI's entry: under an external launcher (:data:`chunkzero.workers.COORDINATOR_ENV` … set) this
process is one of the run; else it launches ``--nproc`` processes of :mod:`jax_backend.train.worker`.
Exit codes as for torch: 0 done, 1 a process failed (named) or the run cannot make progress, 2 bad input.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from chunkzero.errors import ChunkZeroError, ConfigError
from chunkzero.train_config import TrainConfig, with_device_defaults
from chunkzero.workers import COORDINATOR_ENV, WorkerFailure, available_cpu_cores, check_cpu_workers, launch_processes

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
PROG = "chunkzero train"
log = logging.getLogger("chunkzero.cli")


def under_external_launcher() -> bool:
    """Whether the environment already places this process in a multi-process run."""
    return bool(os.environ.get(COORDINATOR_ENV))


def validate(cfg: TrainConfig, *, check_out: bool = True, num_processes: int | None = None):
    """The resolved config and the corpus; ``world_size`` = processes × ``--devices-per-process``.

    Raises:
        ConfigError / DataError: one line naming the input at fault.
    """
    from torch_backend.train.models import load_run_corpus, model_block_size
    from torch_backend.train.resolve import check_run_out

    cfg = dataclasses.replace(cfg)
    cfg.check()
    cfg.device = "cpu"
    cfg = with_device_defaults(cfg, "cpu")
    if cfg.mixed_precision == "fp16":
        raise ConfigError("--mixed-precision fp16 is not supported by --backend jax (fp32 or bf16)")
    nproc = num_processes if num_processes is not None else (cfg.nproc or 2)
    cfg.nproc = nproc
    cfg.world_size = nproc * cfg.devices_per_process
    check_cpu_workers(cfg.world_size, f"--nproc {nproc}" + (f" × --devices-per-process {cfg.devices_per_process} "
                      f"({cfg.world_size} devices)" if cfg.devices_per_process > 1 else ""), cores=available_cpu_cores())
    cfg.model_kind, cfg.block_size, _ = model_block_size(cfg.model)
    if cfg.model_kind == "hf":
        check_hf_model(cfg)
    if cfg.seq_len > cfg.block_size:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the block size {cfg.block_size} of model {cfg.model}")
    corpus = load_run_corpus(cfg)
    if check_out:
        meta = check_run_out(cfg, corpus.summary())
        if meta is not None and meta.mixed_precision == "fp16":
            raise ConfigError(f"--resume: the checkpoint in {cfg.out} was trained in fp16, which --backend jax "
                              "does not run")
    cfg.validated = True
    return cfg, corpus


HF_DROPOUT_KEYS = ("embd_pdrop", "attn_pdrop", "resid_pdrop")
"""The dropout rates of a Hugging Face GPT-2 config, which the JAX program does not apply."""


def check_hf_model(cfg: TrainConfig) -> None:
    """Refuse a Hugging Face ``--model`` directory the JAX engine cannot train as the torch engine does: any
    ``model_type`` but ``"gpt2"``, a GPT-2 variant the JAX GPT does not compute, dropout (torch trains with
    it, the JAX program has none), or tensors other than the torch engine's (names, shapes, tied names).

    Raises:
        ConfigError: one line naming the directory and the field at fault.
    """
    from torch_backend.train.models import hf_config
    from torch_backend.train.resolve import model_tensor_specs

    from .engine import run_program

    c = hf_config(cfg.model)
    if c.model_type != "gpt2":
        raise ConfigError(f"--backend jax trains the byte-level GPTs and Hugging Face GPT-2 directories; --model "
                          f"{cfg.model} is a {c.model_type!r} model, which only --backend torch trains")
    dropout = {k: getattr(c, k, 0.0) for k in HF_DROPOUT_KEYS if getattr(c, k, 0.0)}
    if dropout:
        raise ConfigError(f"--backend jax trains without dropout; --model {cfg.model} sets "
                          f"{', '.join(f'{k}={v}' for k, v in dropout.items())} (set them to 0 in its config.json, "
                          "or train it with --backend torch)")
    try:
        program = run_program(cfg)
    except ConfigError as e:
        raise ConfigError(f"--backend jax: --model {cfg.model}: {e}") from None
    torch_specs = [(s.name, s.shape, s.aliases) for s in model_tensor_specs(cfg)]
    jax_specs = [(s.name, s.shape, s.aliases) for s in program.specs]
    if torch_specs != jax_specs:
        i = next(i for i in range(max(len(torch_specs), len(jax_specs)))
                 if torch_specs[i:i + 1] != jax_specs[i:i + 1])
        raise ConfigError(f"--backend jax: --model {cfg.model} has tensors the JAX GPT-2 does not (tensor {i}: "
                          f"torch {torch_specs[i:i + 1] or 'none'}, JAX {jax_specs[i:i + 1] or 'none'})")


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
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process sets its own devices
    with tempfile.TemporaryDirectory(prefix="chunkzero-jax-") as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(cfg.to_dict()), encoding="utf-8")
        try:
            results = launch_processes([sys.executable, "-m", "jax_backend.train.worker", str(cfg_path)], cfg.nproc,
                                       tmp, env=env, finish_timeout_s=max(60.0, 2 * cfg.timeout_s))
        except WorkerFailure as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    code, message = outcome(results)
    if code != EXIT_OK:
        return _fail(message, code)
    log.info("chunkzero train --backend jax: done; outputs in %s", out)
    return EXIT_OK
