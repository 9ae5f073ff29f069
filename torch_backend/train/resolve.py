"""Checking a run on this machine before any worker starts: devices, workers, precision, model, data.

:func:`validate` is the launcher's (and, under ``torchrun``, every worker's) check of every user input: first
:meth:`chunkzero.train_config.TrainConfig.check` (what is wrong on any machine), then what needs this one — a CUDA
device for ``--device cuda``, ``--nproc`` within the devices (or 8 per CPU core: beyond the cores the workers run
oversubscribed, with a warning: :func:`chunkzero.workers.check_cpu_workers`), the defaults of the device
(:func:`chunkzero.train_config.with_device_defaults`), a model that exists with a block size that holds ``--seq-len``,
kernels for ``--mixed-precision``, a usable ``--out`` and a corpus of at least one sequence; with ``--resume``, a
checkpoint whose step is below ``--steps`` and whose tensors are the model's, by name and shape
(:func:`chunkzero.job.checks.check_run_out`, from the checkpoint's metadata and a meta-device build of the model,
:func:`module_tensor_specs`: no array is read). It returns the config with its resolved fields (``device``,
``nproc``/``world_size``, ``out``, ``model_kind``, ``block_size``, ``schedule_steps``) and the corpus.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from chunkzero.errors import ConfigError
from chunkzero.job import data as data_mod
from chunkzero.job.checks import check_run_out
from chunkzero.job.models import check_hf_weights, load_run_corpus, model_block_size
from chunkzero.layout import TensorSpec
from chunkzero.train_config import TrainConfig, with_device_defaults
from chunkzero.workers import available_cpu_cores, check_cpu_workers, threads_per_worker

log = logging.getLogger("chunkzero.train")


def resolve_device(device: str) -> str:
    """``"cuda"`` or ``"cpu"``.

    Raises:
        ConfigError: ``--device cuda`` without a CUDA device.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible")
    return device


def precision_unsupported(precision: str, device: str) -> str | None:
    """Why ``device`` (``"cpu"`` or ``"cuda"``) cannot train in ``precision``, or ``None`` when it can.
    On CPU a small GPT-like forward and backward (linear, layer norm, causal attention, cross-entropy)
    in that dtype must run (it does with torch 2.13 on x86, fp16 included); on a GPU, bf16 needs compute
    capability 8.0 (Ampere) or newer."""
    if precision == "fp32":
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if device == "cuda":
        # No kernel probe on a GPU: the launcher must not hold a CUDA context while its workers run.
        major, minor = torch.cuda.get_device_capability(0)
        if precision == "bf16" and major < 8:
            return f"bfloat16 needs a GPU of compute capability 8.0 or newer, this one is {major}.{minor}"
        return None
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(2, 4, 8, generator=g).to(dtype).requires_grad_()
        lin = nn.Linear(8, 8).to(dtype)
        ln = nn.LayerNorm(8).to(dtype)
        h = ln(lin(x)).view(2, 4, 2, 4).transpose(1, 2)
        y = F.scaled_dot_product_attention(h, h, h, is_causal=True).transpose(1, 2).reshape(8, 8)
        F.cross_entropy(y.float(), torch.zeros(8, dtype=torch.long)).backward()
    except Exception as e:  # noqa: BLE001 - a probe: any kernel failure (RuntimeError, NotImplementedError) is the reason
        return str(e).splitlines()[0]
    return None


def check_precision(precision: str, device: str) -> None:
    """Refuse a mixed precision this device cannot train in (:func:`precision_unsupported`).

    Raises:
        ConfigError: naming the precision, the device and the reason.
    """
    reason = precision_unsupported(precision, device)
    if reason:
        raise ConfigError(f"--mixed-precision {precision} cannot run on {device}: {reason}")


def resolve_workers(cfg: TrainConfig) -> int:
    """The world size: ``WORLD_SIZE`` under ``torchrun`` (``--nproc`` is then ignored, with a warning on
    rank 0), else ``--nproc`` (default one per GPU, or 2 on CPU) for ``cfg.device`` (resolved).

    Raises:
        ConfigError: ``--nproc`` beyond the visible GPUs or the allowed CPU workers.
    """
    if "WORLD_SIZE" in os.environ:  # under torchrun: the world is given
        world = int(os.environ["WORLD_SIZE"])
        if cfg.nproc is not None and int(os.environ.get("RANK", 0)) == 0:
            log.warning("--nproc %d ignored: running under torchrun with world size %d", cfg.nproc, world)
        return world
    if cfg.device == "cuda":
        nproc = cfg.nproc if cfg.nproc is not None else torch.cuda.device_count()
        if nproc > torch.cuda.device_count():
            raise ConfigError(f"--nproc {nproc} is more than this machine allows: {torch.cuda.device_count()} CUDA "
                              "device(s) visible")
        return nproc
    nproc = cfg.nproc if cfg.nproc is not None else 2
    check_cpu_workers(nproc, f"--nproc {nproc}", cores=available_cpu_cores(), threads_each=threads_per_worker(nproc))
    return nproc


def module_tensor_specs(cfg: TrainConfig) -> list[TensorSpec]:
    """The model's parameters as :class:`chunkzero.TensorSpec` (names, tied names as aliases, shapes), from a
    build on the meta device: no memory, no weights read; any Hugging Face causal LM. ``cfg.model_kind``
    must be resolved. (:func:`chunkzero.job.models.model_tensor_specs` gives them from the config alone for
    the byte-level GPTs and Hugging Face GPT-2.)"""
    from .models import build_meta_module

    module = build_meta_module(cfg)
    names: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    return [TensorSpec(ns[0], tuple(p.shape), aliases=tuple(ns[1:])) for p, ns in names.values()]


def validate(cfg: TrainConfig, *, check_out: bool = True) -> tuple[TrainConfig, data_mod.Corpus]:
    """Check every user input before any worker starts; return the resolved config and the corpus.

    Resolves ``device``, ``nproc``/``world_size`` (from the environment under ``torchrun``), ``out``
    (``runs/<timestamp>`` by default; only with ``check_out``, which also checks it and, with ``--resume``,
    the checkpoint's step and tensors and the kept ``schedule_steps``), ``model_kind`` and ``block_size``,
    and sets ``validated``.

    Raises:
        ConfigError / DataError: one line naming the input at fault.
    """
    cfg = dataclasses.replace(cfg)
    cfg.check()
    cfg.device = resolve_device(cfg.device)
    bf16_supported = cfg.device != "cuda" or precision_unsupported("bf16", "cuda") is None
    cfg = with_device_defaults(cfg, cfg.device, bf16_supported=bf16_supported)
    cfg.world_size = resolve_workers(cfg)
    if "WORLD_SIZE" not in os.environ:
        cfg.nproc = cfg.world_size
    if cfg.shard_group_size is not None and cfg.world_size % cfg.shard_group_size:
        raise ConfigError(f"--shard-group-size {cfg.shard_group_size} does not divide the world size {cfg.world_size}")
    cfg.model_kind, cfg.block_size, _ = model_block_size(cfg.model)
    if cfg.model_kind == "hf":
        check_hf_weights(cfg.model)
    if cfg.seq_len > cfg.block_size:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the block size {cfg.block_size} of model {cfg.model}")
    check_precision(cfg.mixed_precision, cfg.device)
    for flag, frac in (("--offload-optim-frac", cfg.offload_optim_frac),
                       ("--offload-param-frac", cfg.offload_param_frac)):
        if frac and cfg.device != "cuda":
            raise ConfigError(f"{flag} {frac:g} offloads to the host from a GPU; this run is on {cfg.device}")
    corpus = load_run_corpus(cfg)
    if check_out:
        check_run_out(cfg, module_tensor_specs, data_summary=corpus.summary())
    cfg.validated = True
    return cfg, corpus
