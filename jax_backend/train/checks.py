"""Checking a ``chunkzero train --backend jax`` run before any process starts (the launcher's check, and
each process's under an external launcher), as :func:`torch_backend.train.resolve.validate` does for torch;
what a machine cannot change is :meth:`chunkzero.train_config.TrainConfig.check`'s: CPU only, ``--nproc``
processes × ``--devices-per-process`` devices (as many CPU workers as torch allows, with its
oversubscription warning: :func:`chunkzero.workers.check_cpu_workers`), the CPU defaults, the model (a byte-level GPT,
or a Hugging Face GPT-2 directory: :func:`check_hf_model`) and ``--seq-len``, ``--out``, ``--resume``'s checkpoint (its
step and tensors, :func:`chunkzero.job.checks.check_run_out`) and the corpus.
"""

from __future__ import annotations

import dataclasses

from chunkzero.errors import ConfigError
from chunkzero.job.checks import check_run_out
from chunkzero.job.models import check_hf_weights, hf_config, load_run_corpus, model_block_size, model_tensor_specs
from chunkzero.train_config import TrainConfig, with_device_defaults
from chunkzero.workers import available_cpu_cores, check_cpu_workers

from ..blocks import HF_MODEL_TYPES


def validate(cfg: TrainConfig, *, check_out: bool = True, num_processes: int | None = None):
    """The resolved config and the corpus; ``world_size`` = processes × ``--devices-per-process``.

    Raises:
        ConfigError / DataError: one line naming the input at fault.
    """
    cfg = dataclasses.replace(cfg)
    cfg.check()
    cfg.device = "cpu"
    cfg = with_device_defaults(cfg, "cpu")
    if cfg.mixed_precision == "fp16":
        raise ConfigError("--mixed-precision fp16 is not supported by --backend jax (fp32 or bf16)")
    nproc = num_processes if num_processes is not None else (cfg.nproc or 2)
    cfg.nproc = nproc
    cfg.world_size = nproc * cfg.devices_per_process
    check_cpu_workers(
        cfg.world_size,
        f"--nproc {nproc}"
        + (
            f" × --devices-per-process {cfg.devices_per_process} ({cfg.world_size} devices)"
            if cfg.devices_per_process > 1
            else ""
        ),
        cores=available_cpu_cores(),
    )
    cfg.model_kind, cfg.block_size, _ = model_block_size(cfg.model)
    if cfg.model_kind == "hf":
        check_hf_model(cfg)
        check_hf_weights(cfg.model, safetensors_only=True)
    if cfg.seq_len > cfg.block_size:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the block size {cfg.block_size} of model {cfg.model}")
    corpus = load_run_corpus(cfg)
    if check_out:
        meta = check_run_out(cfg, data_summary=corpus.summary())
        if meta is not None and meta.mixed_precision == "fp16":
            raise ConfigError(f"--resume: the checkpoint in {cfg.out} was trained in fp16, which --backend jax "
                              "does not run")
    cfg.validated = True
    return cfg, corpus


HF_DROPOUT_KEYS = ("embd_pdrop", "attn_pdrop", "resid_pdrop")
"""The dropout rates of a Hugging Face GPT-2 config, which the JAX program does not apply."""


def check_hf_model(cfg: TrainConfig) -> None:
    """Refuse a Hugging Face ``--model`` directory the JAX engine cannot train as the torch engine does: a
    ``model_type`` without a JAX program (:data:`jax_backend.blocks.HF_MODEL_TYPES`), a variant the program
    does not compute (:func:`jax_backend.blocks.hf_program`), dropout (torch trains with it, the JAX program
    has none), or tensors other than the torch engine's (names, shapes, tied names).

    Raises:
        ConfigError: one line naming the directory and the field at fault.
    """
    from .adapter import run_program

    c = hf_config(cfg.model)
    if c["model_type"] not in HF_MODEL_TYPES:
        raise ConfigError(f"--backend jax trains the byte-level GPTs and Hugging Face {', '.join(HF_MODEL_TYPES)} "
                          f"directories; --model {cfg.model} is a {c['model_type']!r} model, which only --backend "
                          "torch trains")
    dropout = {k: c.get(k, 0.0) for k in HF_DROPOUT_KEYS if c.get(k, 0.0)}
    if dropout:
        raise ConfigError(f"--backend jax trains without dropout; --model {cfg.model} sets "
                          f"{', '.join(f'{k}={v}' for k, v in dropout.items())} (set them to 0 in its config.json, "
                          "or train it with --backend torch)")
    try:
        program = run_program(cfg)
    except ConfigError as e:
        raise ConfigError(f"--backend jax: --model {cfg.model}: {e}") from None
    torch_specs = [(s.name, s.shape, s.aliases) for s in model_tensor_specs(cfg)]  # the torch engine's tensors
    jax_specs = [(s.name, s.shape, s.aliases) for s in program.specs]
    if torch_specs != jax_specs:
        i = next(i for i in range(max(len(torch_specs), len(jax_specs)))
                 if torch_specs[i:i + 1] != jax_specs[i:i + 1])
        raise ConfigError(f"--backend jax: --model {cfg.model} has tensors the JAX program does not (tensor {i}: "
                          f"torch {torch_specs[i:i + 1] or 'none'}, JAX {jax_specs[i:i + 1] or 'none'})")
