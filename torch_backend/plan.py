"""The memory plan of a ``chunkzero train`` run, from the real model: :func:`plan` (the Python API),
:func:`plan_config` (a resolved :class:`~chunkzero.train_config.TrainConfig`), :func:`trace_activations`.

The model is built on the meta device and made of fake tensors (``FakeTensorMode``: shapes, dtypes and
strides, no memory); one micro-batch's forward, loss and backward run through it under a
``TorchDispatchMode`` that counts the bytes of every storage an op creates while it is alive (the
activations autograd saves and the temporaries of the moment), and the parameter elements whose gradients
have arrived. The layout is the one ``ZeroDDP`` builds (:func:`~torch_backend.zero.module_layout.build_module_layout`
over the same module). The arithmetic is the core's (:mod:`chunkzero.memory_plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from chunkzero.memory_plan import ActivationTrace, MemoryPlan, PlanSettings, plan_memory
from chunkzero.train_config import TrainConfig

from .train.models import build_meta_module, checkpoint_blocks
from .zero.config import MIXED_PRECISION_DTYPES
from .zero.module_layout import build_module_layout, collect_parameters

__all__ = ["available_bytes", "module_layout", "plan", "plan_config", "settings_of", "trace_activations",
           "trace_module"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops create while they are alive (excluded: ``skip``, the
    parameters', and the parameter gradients handed to :meth:`drop`), and records them after every op."""

    def __init__(self, skip: set[int]):
        super().__init__()
        self.skip = skip
        self.live: dict[int, tuple[int, int]] = {}  # storage -> (bytes, the op that created it)
        self.bytes = 0
        self.samples: list[int] = []

    def _freed(self, key: int) -> None:
        self.bytes -= self.live.pop(key, (0, 0))[0]

    def drop(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor``'s storage, also in the samples since it was created: a parameter's
        gradient, which ZeroDDP moves into its chunk's buffer (the plan counts that buffer)."""
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage).cdata
        if key not in self.skip:  # skipped while it lives: a later storage may take its address
            self.skip.add(key)
            weakref.finalize(storage, self.skip.discard, key)
        n, created = self.live.pop(key, (0, len(self.samples)))
        self.bytes -= n
        for i in range(created, len(self.samples)):
            self.samples[i] -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = StorageWeakRef(storage).cdata
                if key not in self.live and key not in self.skip:
                    self.live[key] = (storage.nbytes(), len(self.samples))
                    self.bytes += storage.nbytes()
                    weakref.finalize(storage, self._freed, key)
        self.samples.append(self.bytes)
        return out


def trace_module(meta_module: nn.Module, batch_size: int, seq_len: int, precision: str = "fp32",
                 activation_checkpointing: bool = False, loss_of=None) -> ActivationTrace:
    """One micro-batch (``int64[batch_size, seq_len]`` token ids) through ``meta_module`` (built on the meta
    device; consumed) in ``precision``'s dtype, forward, loss and backward, on fake tensors: no memory is
    allocated. ``loss_of(output, ids)``: the loss (default: next-token cross-entropy of the logits in fp32,
    as ``chunkzero train``'s; a module that returns its loss: ``lambda out, ids: out``)."""
    module = meta_module.to(_DTYPES[precision])  # the compute dtype ZeroDDP gathers chunks in
    tied = [names for _, names in collect_parameters(module).values() if len(names) > 1]
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        module = module.to_empty(device="cpu")
        idx = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for names in tied:  # to_empty gives each name its own tensor: tie them again, as the model is
        for alias in names[1:]:
            owner, _, attr = alias.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(names[0]))
    if activation_checkpointing:
        checkpoint_blocks(module)
    mode = _LiveBytes({StorageWeakRef(p.untyped_storage()).cdata for p in module.parameters()})
    last: dict[str, tuple[int, int]] = {}  # name -> (op index of its last gradient contribution, numel)

    def contributed(grad, name, numel):  # a tied weight's gradient is final at its last contribution
        last[name] = (len(mode.samples), numel)
        mode.drop(grad)  # ZeroDDP moves it into its chunk: counted by the plan, not as an activation
        return grad

    def drop(p):
        p.grad = None

    for p, names in collect_parameters(module).values():
        if p.requires_grad:
            p.register_hook(functools.partial(contributed, name=names[0], numel=p.numel()))
            p.register_post_accumulate_grad_hook(drop)
    with fake, mode:
        out = module(idx)
        (loss_of or _lm_loss)(out, idx).backward()
    events = sorted((i, name) for name, (i, _) in last.items())
    arrived, total, k = [], 0, 0
    for i in range(len(mode.samples)):
        while k < len(events) and events[k][0] <= i:
            total += last[events[k][1]][1]
            k += 1
        arrived.append(total)
    return ActivationTrace(tuple(mode.samples), tuple(arrived), tuple(events), batch_size, seq_len,
                           activation_checkpointing)


def _lm_loss(out, idx):
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), idx.reshape(-1))


def _meta(model: str, model_kind: str) -> nn.Module:
    cfg = TrainConfig(model=model)
    cfg.model_kind = model_kind
    return build_meta_module(cfg)


@functools.lru_cache(maxsize=64)
def _trace(model: str, model_kind: str, batch_size: int, seq_len: int, precision: str,
           activation_checkpointing: bool) -> ActivationTrace:
    return trace_module(_meta(model, model_kind), batch_size, seq_len, precision, activation_checkpointing)


def trace_activations(cfg: TrainConfig, batch_size: int | None = None,
                      activation_checkpointing: bool | None = None) -> ActivationTrace:
    """One rank's micro-batch (``batch_size`` × ``cfg.seq_len`` tokens; default ``cfg.batch_size``) through
    ``cfg``'s model in its compute dtype, forward, loss and backward, traced on fake tensors (no memory is
    allocated). ``cfg.model_kind`` must be resolved."""
    ac = cfg.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    return _trace(cfg.model, cfg.model_kind, batch_size or cfg.batch_size, cfg.seq_len, cfg.mixed_precision, ac)


@functools.lru_cache(maxsize=16)
def _layout(model: str, model_kind: str, precision: str, shard_group_size: int, chunk_size: int | None):
    return module_layout(_meta(model, model_kind), precision, shard_group_size, chunk_size)


def module_layout(module: nn.Module, precision: str, shard_group_size: int, chunk_size: int | None = None):
    """The layout ``ZeroDDP(module, mixed_precision=precision, chunk_size=chunk_size)`` builds over a shard
    group of ``shard_group_size`` ranks (the module may be on the meta device)."""
    return build_module_layout(collect_parameters(module), MIXED_PRECISION_DTYPES[precision], shard_group_size,
                               chunk_size, None)


def settings_of(cfg: TrainConfig) -> PlanSettings:
    """The plan's settings of a resolved ``cfg``."""
    return PlanSettings(
        world_size=cfg.world_size, precision=cfg.mixed_precision, shard_group_size=cfg.shard_group_size,
        prefetch=cfg.prefetch, offload_optim_frac=cfg.offload_optim_frac, offload_param_frac=cfg.offload_param_frac,
        batch_size=cfg.batch_size, seq_len=cfg.seq_len, grad_accum=cfg.grad_accum,
        activation_checkpointing=cfg.activation_checkpointing, ema=cfg.ema_decay is not None, device=cfg.device,
        build_copies=1 if cfg.model_kind == "hf" else 2, checkpoints=cfg.save_interval > 0 or cfg.resume)


def plan_settings(cfg: TrainConfig, settings: PlanSettings) -> MemoryPlan:
    """The plan of ``settings`` for ``cfg``'s model (the model and chunk size are ``cfg``'s)."""
    s = settings.shard_group_size or settings.world_size
    layout = _layout(cfg.model, cfg.model_kind, settings.precision, s, cfg.chunk_size)
    trace = _trace(cfg.model, cfg.model_kind, settings.batch_size, settings.seq_len, settings.precision,
                   settings.activation_checkpointing)
    return plan_memory(layout, trace, settings)


def plan_config(cfg: TrainConfig) -> MemoryPlan:
    """The plan of a resolved ``cfg`` (``torch_backend.train.resolve.validate``'s, or :func:`plan`'s)."""
    return plan_settings(cfg, settings_of(cfg))


def resolve_for_plan(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with what a plan needs resolved, without data or ``--out``: the device and its defaults, the
    world size (``--nproc``, default one per GPU or 2), the model's kind and block size. Unlike
    ``chunkzero train``'s checks, ``--device cuda`` needs no GPU here: a GPU run can be planned anywhere.

    Raises:
        ConfigError: a value wrong on any machine, or a model that does not exist or is too short.
    """
    from chunkzero.errors import ConfigError
    from chunkzero.job.models import model_block_size
    from chunkzero.train_config import with_device_defaults

    from .train.resolve import resolve_device

    cfg = dataclasses.replace(cfg)
    cfg.check()
    cfg.device = "cuda" if cfg.device == "cuda" else resolve_device(cfg.device)
    cfg = with_device_defaults(cfg, cfg.device)
    cfg.world_size = cfg.nproc or (torch.cuda.device_count() if cfg.device == "cuda" else 2)
    if not cfg.world_size:
        raise ConfigError("--nproc: no GPU is visible to count the ranks of a --device cuda run; give --nproc")
    if cfg.shard_group_size is not None and cfg.world_size % cfg.shard_group_size:
        raise ConfigError(f"--shard-group-size {cfg.shard_group_size} does not divide the world size {cfg.world_size}")
    cfg.model_kind, cfg.block_size, _ = model_block_size(cfg.model)
    if cfg.seq_len > cfg.block_size:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the block size {cfg.block_size} of model {cfg.model}")
    return cfg


def plan(model: str | None = None, **options) -> MemoryPlan:
    """The memory plan of ``chunkzero train --model MODEL`` with ``options`` (any
    :class:`~chunkzero.train_config.TrainConfig` field: ``nproc=2, batch_size=4, seq_len=256,
    mixed_precision="bf16", activation_checkpointing=True, ema_decay=0.999`` …), for notebooks.

    Raises:
        ConfigError: an option ``chunkzero train`` would refuse (named as its flag).
    """
    return plan_config(resolve_for_plan(TrainConfig(model=model, **options)))


def available_bytes(device: str) -> tuple[int, str]:
    """``(bytes, what)``: the host's ``MemAvailable`` on CPU, or the first GPU's free memory on CUDA (from
    ``nvidia-smi``, so this process holds no CUDA context)."""
    if device == "cuda":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            return int(out.split()[0]) * 2**20, "free on the GPU"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            free, _ = torch.cuda.mem_get_info()
            return int(free), "free on the GPU"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available on this machine (MemAvailable)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "available on this machine"


CPU_FLOPS_PER_S = 50e9
"""What the fit search assumes a CPU rank computes per second (only the ranking of settings uses it)."""


def fit_settings(cfg: TrainConfig, fits, *, max_world_size: int | None = None):
    """:func:`chunkzero.memory_plan.fit` around ``cfg``'s settings: the step's communication priced by the
    core's two-level model on one node of ``W`` GPUs (:func:`chunkzero.network_cost.step_comm`), compute
    at 40% of an H200's bf16 peak on a GPU, :data:`CPU_FLOPS_PER_S` on CPU."""
    from chunkzero.memory_plan import fit
    from chunkzero.network_cost import H200_BF16_FLOPS, Topology, step_comm

    def comm_s(s: PlanSettings) -> float:
        if s.world_size == 1:
            return 0.0
        layout = _layout(cfg.model, cfg.model_kind, s.precision, s.world_size, cfg.chunk_size)
        hybrid = s.shard_group_size not in (None, s.world_size)
        return step_comm("hybrid" if hybrid else "zero3", layout, Topology(1, s.world_size),
                         shard_group_size=s.shard_group_size if hybrid else None, precision=s.precision).time_s

    flops = H200_BF16_FLOPS * 0.4 if cfg.device == "cuda" else CPU_FLOPS_PER_S
    return fit(settings_of(cfg), lambda s: plan_settings(cfg, s), fits, comm_s, flops, max_world_size=max_world_size)


def machine_fits(plan: MemoryPlan, available: int, local_ranks: int) -> bool:
    """Whether ``plan`` fits ``available`` bytes: on CPU the ``local_ranks`` ranks' host peaks together, on
    a GPU one rank's device peak (each rank has its GPU)."""
    if plan.device is None:
        return plan.host_peak_bytes * local_ranks <= available
    return plan.device_peak_bytes <= available


def refuse_if_too_big(cfg: TrainConfig) -> tuple[MemoryPlan, str | None]:
    """``cfg``'s plan, and the line ``chunkzero train`` refuses it with where it does not fit this machine
    (:func:`available_bytes`; on CPU all ``--nproc`` ranks together), or ``None``."""
    from chunkzero.memory_plan import nearest, refusal

    p = plan_config(cfg)
    available, where = available_bytes(cfg.device)
    if machine_fits(p, available, cfg.world_size):
        return p, None
    if cfg.device == "cpu":
        _, fitting = fit_settings(cfg, lambda q: machine_fits(q, available, q.settings.world_size),
                                  max_world_size=4 * cfg.world_size)
    else:
        _, fitting = fit_settings(cfg, lambda q: machine_fits(q, available, 1))
    need = p.host_peak_bytes * cfg.world_size if p.device is None else p.device_peak_bytes
    return p, refusal(p, need, available, where, nearest(p.settings, fitting))
