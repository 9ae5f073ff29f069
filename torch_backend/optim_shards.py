"""A ZeroOptimizer's state as numpy shards for the checkpoint format, and back.

Per-element state (``exp_avg``, ``exp_avg_sq`` …) becomes one fp32 shard per trainable chunk; the step
count and the hyper-parameters go into :class:`~chunkzero.checkpoint.OptimizerMeta`. On load, live CPU
state tensors are offered as destination buffers, so the read lands in them without a second copy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from chunkzero.checkpoint import OPTIM_KEY, PARAMS_KEY, ArrayPath, OptimizerMeta, chunk_key
from chunkzero.errors import CheckpointError
from chunkzero.layout import ChunkLayout

from .numpy_bridge import to_numpy, to_torch

logger = logging.getLogger("chunkzero.checkpoint")

IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Optimizer param-group entries that choose a kernel, not the math: recorded, never restored."""


def jsonable(value: Any) -> Any:
    """``value`` with tensors as numbers or lists and anything else unknown as its ``repr``."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def class_name(obj: Any) -> str:
    """Fully qualified class name, ``torch.optim.AdamW`` for torch's optimizers (their public name)."""
    cls = type(obj)
    module = cls.__module__
    if module.startswith("torch.optim."):  # torch.optim.adamw.AdamW -> torch.optim.AdamW
        if getattr(torch.optim, cls.__name__, None) is cls:
            module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def optimizer_shards(model, optimizer) -> tuple[OptimizerMeta, dict[str, dict[int, np.ndarray]]]:
    """The optimizer's metadata and its state as ``state key -> chunk index -> fp32 shard`` (views
    of the live state where it is a contiguous fp32 CPU tensor).

    Raises:
        CheckpointError: a state entry is neither a per-element shard nor the step count.
    """
    layout: ChunkLayout = model.layout
    per_chunk: dict[int, dict[str, torch.Tensor]] = {}
    keys: list[str] = []
    step: int | None = None
    for c in layout.chunks:
        if not c.requires_grad:
            continue
        state = optimizer.shard_state(c.index)
        per_chunk[c.index] = {}
        for key, value in state.items():
            value = torch.as_tensor(value)
            if value.dim() == 1 and value.numel() == layout.shard_numel(c.index):
                per_chunk[c.index][key] = value
                if key not in keys:
                    keys.append(key)
            elif key == "step" and value.numel() == 1:
                s = int(value.item())
                if step is not None and s != step:
                    logger.warning("optimizer 'step' differs between chunks (%d vs %d); saving %d", step, s, max(step, s))
                step = s if step is None else max(step, s)
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of chunk {c.index} (shape {tuple(value.shape)}) is neither a per-element "
                    f"shard of {layout.shard_numel(c.index)} elements nor the step count; the chunkzero format cannot hold it"
                )
    optim: dict[str, dict[int, np.ndarray]] = {k: {} for k in keys}
    for i, state in per_chunk.items():
        for k in keys:
            if k in state:
                optim[k][i] = to_numpy(state[k].to(torch.float32), copy=False)
            else:
                logger.warning("chunk %d has no optimizer state %r (saved as zeros)", i, k)
                optim[k][i] = np.zeros(layout.shard_numel(i), dtype=np.float32)
    hypers = {k: jsonable(v) for k, v in optimizer.hyperparameters().items()}
    inner = getattr(optimizer, "optimizer", optimizer)
    meta = OptimizerMeta(
        class_name=class_name(inner),
        hyperparameters=hypers,
        state_keys=keys,
        step=int(step if step is not None else getattr(optimizer, "step_count", 0)),
    )
    return meta, optim


def _cpu_view(t: torch.Tensor | None, numel: int, dtype: torch.dtype) -> np.ndarray | None:
    if (t is None or t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != (numel,)
            or not t.is_contiguous() or dtype == torch.bfloat16):
        return None
    return t.detach().numpy()


def live_buffers(model, optimizer, optim_keys: list[str]) -> tuple[dict[ArrayPath, np.ndarray], dict[int, dict[str, torch.Tensor]]]:
    """Numpy views of the live CPU shards that a load can overwrite in place, by array path, and the
    live optimizer-state dicts whose tensors those views are (chunks with a complete Adam-style state)."""
    layout: ChunkLayout = model.layout
    into: dict[ArrayPath, np.ndarray] = {}
    live_state: dict[int, dict[str, torch.Tensor]] = {}
    for c in layout.chunks:
        n = layout.shard_numel(c.index)
        if c.requires_grad:  # frozen chunks are saved in their own dtype: read, then cast
            view = _cpu_view(model.master_shard(c.index), n, torch.float32)
            if view is not None:
                into[(PARAMS_KEY, chunk_key(c.index))] = view
        if optimizer is None or not c.requires_grad or not optim_keys:
            continue
        state = optimizer.shard_state(c.index)
        views = {k: _cpu_view(state.get(k), n, torch.float32) for k in optim_keys}
        step = state.get("step")
        if all(v is not None for v in views.values()) and isinstance(step, torch.Tensor) and step.numel() == 1:
            for k, v in views.items():
                into[(OPTIM_KEY, k, chunk_key(c.index))] = v
            live_state[c.index] = state
    return into, live_state


def load_optimizer_state(model, optimizer, meta_optimizer: OptimizerMeta, optim: Mapping[str, Mapping[int, np.ndarray]],
                         into: Mapping[ArrayPath, np.ndarray], live_state: Mapping[int, dict[str, torch.Tensor]]) -> None:
    """Hand each trainable chunk's read state to the optimizer, with the saved step count (state read
    in place into ``live_state`` only gets its step)."""
    keys = list(meta_optimizer.state_keys)
    step_value = torch.tensor(float(meta_optimizer.step), dtype=torch.float32)
    for c in model.layout.chunks:
        if not c.requires_grad:
            continue
        live = live_state.get(c.index)
        if live is not None and keys and all(optim[k][c.index] is into.get((OPTIM_KEY, k, chunk_key(c.index))) for k in keys):
            live["step"].copy_(step_value)  # the state tensors were overwritten in place
            continue
        state: dict[str, Any] = {k: to_torch(optim[k][c.index]) for k in keys}
        if state:
            state["step"] = step_value.clone()
        optimizer.load_shard_state(c.index, state)


def load_hyperparameters(optimizer, saved: Mapping[str, Any]) -> None:
    """Overwrite the first param group's hyper-parameters with ``saved`` (not kernel flags, not ``params``)."""
    group = optimizer.param_groups[0]
    for key, value in saved.items():
        if key in IMPLEMENTATION_FLAGS or key == "params" or key not in group:
            continue
        current = group[key]
        if isinstance(current, torch.Tensor):
            current.fill_(value)
        elif isinstance(current, tuple):
            group[key] = tuple(value)
        else:
            group[key] = value
