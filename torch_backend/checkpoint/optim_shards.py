"""A ZeroOptimizer's state as numpy shards for the checkpoint format, and back.

Per-element state (``exp_avg``, ``exp_avg_sq`` …) becomes one fp32 shard per trainable chunk (the
optimizer's flat state buffers, :mod:`.optim_pieces`); the step count, the per-tensor steps that differ
from it, ``max_norm`` and every param group's hyper-parameters with its tensors' names go into
:class:`~chunkzero.checkpoint.OptimizerMeta`. Groups are saved by tensor name, so they restore at any
world size or chunk size. On load, live CPU state buffers are offered as destinations, so the read
lands in them without a second copy.
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

from ..zero.collectives import all_gather_json
from ..zero.optim_state_dict import IMPLEMENTATION_FLAGS
from .numpy_bridge import to_numpy, to_torch

logger = logging.getLogger("chunkzero.checkpoint")


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
    of the live state where it is a contiguous fp32 CPU tensor). Collective over the model's process
    group: the ranks agree on the state keys, so every rank saves the same arrays.

    Raises:
        CheckpointError: a state entry is neither a per-element shard nor the step count.
    """
    layout: ChunkLayout = model.layout
    per_chunk: dict[int, dict[str, torch.Tensor]] = {}
    keys: list[str] = []
    for c in layout.chunks:
        if not c.requires_grad:
            continue
        per_chunk[c.index] = {}
        for key, value in optimizer.shard_state(c.index).items():
            value = torch.as_tensor(value)
            if value.dim() == 1 and value.numel() == layout.shard_numel(c.index):
                per_chunk[c.index][key] = value
                if key not in keys:
                    keys.append(key)
            elif key != "step":
                raise CheckpointError(
                    f"optimizer state {key!r} of chunk {c.index} (shape {tuple(value.shape)}) is neither a per-element "
                    f"shard of {layout.shard_numel(c.index)} elements nor the step count; the chunkzero format cannot "
                    "hold it"
                )
    # a rank whose pieces never had a gradient holds no state, yet saves the same arrays as the others
    keys = list(dict.fromkeys(k for part in all_gather_json(keys, model.process_group) for k in part))
    optim: dict[str, dict[int, np.ndarray]] = {k: {} for k in keys}
    for i, state in per_chunk.items():
        for k in keys:
            if k in state:
                optim[k][i] = to_numpy(state[k].to(torch.float32), copy=False)
            else:  # no tensor of this rank's shard has state yet: zeros, as the state starts
                optim[k][i] = np.zeros(layout.shard_numel(i), dtype=np.float32)
    steps = optimizer.tensor_steps()
    step = max(steps.values(), default=0) if keys else int(optimizer.step_count)
    differing = {n: s for n, s in steps.items() if s != step}
    meta = OptimizerMeta(
        class_name=class_name(optimizer.optimizer),
        hyperparameters={k: jsonable(v) for k, v in optimizer.hyperparameters().items()},
        state_keys=keys,
        step=int(step),
        param_groups=[
            {**{k: jsonable(v) for k, v in g.items() if k not in ("params", "param_names")}, "params": list(names)}
            for g, names in zip(optimizer.param_groups, optimizer.group_names)
        ],
        tensor_steps=differing or None,
    )
    return meta, optim


def _cpu_view(t: torch.Tensor | None, numel: int, dtype: torch.dtype) -> np.ndarray | None:
    if (t is None or t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != (numel,)
            or not t.is_contiguous() or dtype == torch.bfloat16):
        return None
    return t.detach().numpy()


def live_buffers(model, optimizer, optim_keys: list[str]) -> dict[ArrayPath, np.ndarray]:
    """Numpy views of the live CPU shards (fp32 masters, optimizer state buffers) that a load can
    overwrite in place, by array path."""
    layout: ChunkLayout = model.layout
    into: dict[ArrayPath, np.ndarray] = {}
    for c in layout.chunks:
        n = layout.shard_numel(c.index)
        if not c.requires_grad:  # frozen chunks are saved in their own dtype: read, then cast
            continue
        view = _cpu_view(model.master_shard(c.index), n, torch.float32)
        if view is not None:
            into[(PARAMS_KEY, chunk_key(c.index))] = view
        if optimizer is None:
            continue
        state = optimizer.shard_state(c.index)
        for k in optim_keys:
            view = _cpu_view(state.get(k), n, torch.float32)
            if view is not None:
                into[(OPTIM_KEY, k, chunk_key(c.index))] = view
    return into


def load_optimizer_state(
    model, optimizer, meta_optimizer: OptimizerMeta, optim: Mapping[str, Mapping[int, np.ndarray]]
) -> None:
    """Hand each trainable chunk's read state to the optimizer (state read in place into its live
    buffers is not copied again), with the saved step and the per-tensor steps that differ from it."""
    keys = list(meta_optimizer.state_keys)
    for c in model.layout.chunks:
        if not c.requires_grad:
            continue
        state: dict[str, Any] = {k: to_torch(optim[k][c.index]) for k in keys}
        if state:
            state["step"] = torch.tensor(float(meta_optimizer.step), dtype=torch.float32)
        optimizer.load_shard_state(c.index, state)
    if meta_optimizer.tensor_steps:
        optimizer.load_tensor_steps(meta_optimizer.tensor_steps)


def check_param_groups(model, optimizer, saved: OptimizerMeta, *, source: str) -> None:
    """Check, before anything is loaded, that the saved param groups are this optimizer's: as many,
    each of the same tensors (by name or alias). Checkpoints without groups always pass.

    Raises:
        CheckpointError: the groups differ (names the group and a tensor; pass
            ``load_hyperparameters=False`` to keep the optimizer's own).
    """
    if saved.param_groups is None:
        return
    layout = model.layout
    fix = " (pass load_hyperparameters=False to keep this optimizer's hyper-parameters)"
    if len(saved.param_groups) != len(optimizer.group_names):
        raise CheckpointError(f"{source} holds {len(saved.param_groups)} param group(s), the optimizer has "
                              f"{len(optimizer.group_names)}{fix}")
    for i, (g, names) in enumerate(zip(saved.param_groups, optimizer.group_names)):
        got = {layout.tensor(n).name if n in layout else n for n in g["params"]}
        diff = sorted(got ^ set(names))
        if diff:
            where = "saved group" if diff[0] in got else "optimizer's group"
            raise CheckpointError(f"{source}: param group {i} differs: {diff[0]!r} is only in the {where}{fix}")


def load_hyperparameters(optimizer, saved: OptimizerMeta) -> None:
    """Restore every param group's hyper-parameters (not kernel flags, not ``params``) and ``max_norm``.

    A checkpoint without groups (one set of hyper-parameters) restores an optimizer of one group;
    an optimizer of several groups keeps its own then (with a warning): the saved set cannot say
    which group it was.
    """
    groups = saved.param_groups
    if groups is None:
        if len(optimizer.param_groups) == 1:
            groups = [saved.hyperparameters]
        else:
            logger.warning("the checkpoint records one set of optimizer hyper-parameters, the optimizer has %d "
                           "param groups: they keep their own", len(optimizer.param_groups))
            groups = [{} for _ in optimizer.param_groups]
    for group, values in zip(optimizer.param_groups, groups):
        for key, value in values.items():
            if key in IMPLEMENTATION_FLAGS or key in ("params", "param_names", "max_norm") or key not in group:
                continue
            current = group[key]
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple):
                group[key] = tuple(value)
            else:
                group[key] = value
    if "max_norm" in saved.hyperparameters:
        value = saved.hyperparameters["max_norm"]
        optimizer.max_norm = None if value is None else float(value)
