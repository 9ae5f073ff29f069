"""A :class:`~torch_backend.ZeroOptimizer`'s state in torch's full-shaped ``state_dict`` format, and back.

``{"state": {name: {"step": 0-d, "exp_avg": full-shaped fp32 CPU tensor, ...}}, "param_groups":
[{hyper-parameters..., "params": [names]}, ...]}``: per-element states are gathered chunk by chunk
from the flat shard buffers (:mod:`.optim_pieces`) and cut into each tensor's full shape; ``step``
comes from the per-tensor step counts; other 0-d entries (ASGD's ``eta`` …) are collected from the
ranks that hold a piece of the tensor. One small all-gather first agrees on both and on which state
keys each chunk has on some rank, so every rank issues the same gathers (a rank whose pieces never
had a gradient has no state of its own).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from chunkzero.errors import CheckpointError, ShapeMismatchError

from . import chunk_io
from .collectives import all_gather_json

__all__ = ["full_state_dict", "load_full_state_dict"]

IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Optimizer param-group entries that choose a kernel, not the math: recorded, never restored."""


def _agreed_state(zopt) -> tuple[dict[int, dict[str, torch.dtype]], dict[str, dict[str, Any]], bool]:
    """What every rank must gather, from one small all-gather of each rank's view: per trainable
    chunk, the per-element state keys any rank holds a flat buffer for (with its dtype) — a rank whose
    pieces never had a gradient holds none, yet must take part in the chunk's gathers —,
    ``name -> {key: number}`` of the 0-d state entries other than ``step``, from the ranks that hold
    a piece of the tensor, and whether the optimizer keeps a ``step`` (seen on some rank)."""
    states = zopt.piece_states
    local_keys = {str(ci): {k: str(b.dtype).removeprefix("torch.") for k, b in flat.items()}
                  for ci, flat in states.flat.items()}
    local_scalars: dict[str, dict[str, Any]] = {}
    for pieces in states.pieces.values():
        for p in pieces:
            for k, v in zopt.state.get(p.param, {}).items():
                if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 0:
                    local_scalars.setdefault(p.name, {})[k] = v.item()
    keys: dict[int, dict[str, torch.dtype]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    uses_step = False
    parts = all_gather_json({"keys": local_keys, "scalars": local_scalars, "uses_step": states.uses_step},
                            zopt.model.process_group)
    for part in parts:
        uses_step |= bool(part["uses_step"])
        for ci, entries in part["keys"].items():
            for k, dtype in entries.items():
                keys.setdefault(int(ci), {}).setdefault(k, getattr(torch, dtype))
        for name, entries in part["scalars"].items():
            scalars.setdefault(name, {}).update(entries)
    return keys, scalars, uses_step


def full_state_dict(zopt) -> dict[str, Any]:
    """See :meth:`ZeroOptimizer.state_dict` (collective)."""
    model, states = zopt.model, zopt.piece_states
    steps = zopt.tensor_steps()
    per: dict[str, dict[str, Any]] = {n: {} for g in zopt.group_names for n in g}
    keys, scalars, uses_step = _agreed_state(zopt)
    for c in states.chunks.values():
        flat = states.flat.get(c.index, {})
        for key, dtype in keys.get(c.index, {}).items():
            mine = flat.get(key)
            if mine is None:  # no state here: zeros, so that this rank still takes part in the gather
                mine = torch.zeros(c.shard_numel, dtype=dtype, device=c.master.device)
            full = chunk_io.gather_shard_tensor(c, mine)
            for t in model.layout.chunk_tensors(c.index):
                if steps.get(t.name, 0) > 0:
                    per[t.name][key] = full[t.offset : t.end].view(t.shape).to("cpu", torch.float32, copy=True)
            del full
    for name, entries in scalars.items():
        per[name].update({k: torch.tensor(v) for k, v in entries.items()})
    if uses_step:
        for name, s in steps.items():
            if s > 0:
                per[name]["step"] = torch.tensor(float(s), dtype=torch.float32)
    order = [n for g in zopt.group_names for n in g]
    groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": list(names)}
              for g, names in zip(zopt.param_groups, zopt.group_names)]
    return {"state": {n: per[n] for n in order if per[n]}, "param_groups": groups}


def _group_keys(zopt, groups: list[dict]) -> dict[Any, str]:
    """Saved parameter id (a name or an int) -> this model's primary name, checking the groups match."""
    layout = zopt.model.layout
    if len(groups) != len(zopt.group_names):
        raise CheckpointError(
            f"optimizer state has {len(groups)} param group(s), this optimizer has {len(zopt.group_names)}"
        )
    out: dict[Any, str] = {}
    for i, (g, names) in enumerate(zip(groups, zopt.group_names)):
        ids = g.get("params") if isinstance(g, dict) else None
        if not isinstance(ids, list):
            raise CheckpointError(f"optimizer state param group {i} has no 'params' list")
        if len(ids) != len(names):
            raise CheckpointError(
                f"optimizer state param group {i} has {len(ids)} parameters, this optimizer's has {len(names)}"
            )
        if all(isinstance(k, str) for k in ids):
            unknown = [k for k in ids if k not in layout]
            if unknown:
                raise CheckpointError(f"optimizer state names parameters this model does not have: {unknown}")
            mine = {layout.tensor(k).name: k for k in ids}
            other = sorted(set(names) ^ set(mine))
            if other:
                raise CheckpointError(f"optimizer state param group {i} holds other parameters than this optimizer's "
                                      f"group {i} (first difference: {other[0]!r})")
            out.update({k: layout.tensor(k).name for k in ids})
        else:
            out.update(zip(ids, names))
    return out


def _scalar_step(value: Any) -> int:
    return int(torch.as_tensor(value).item())


def load_full_state_dict(zopt, state_dict: dict[str, Any]) -> None:
    """See :meth:`ZeroOptimizer.load_state_dict` (every rank, the same dict)."""
    try:
        groups = copy.deepcopy(list(state_dict["param_groups"]))
        saved_state = state_dict["state"]
    except (KeyError, TypeError):
        raise CheckpointError("optimizer state dict needs 'state' and 'param_groups'") from None
    key_to_name = _group_keys(zopt, groups)
    by_name = {key_to_name[k]: v for k, v in saved_state.items() if k in key_to_name}
    layout, states = zopt.model.layout, zopt.piece_states
    for c in states.chunks.values():
        tensors = layout.chunk_tensors(c.index)
        fulls: dict[str, dict[str, torch.Tensor]] = {}
        scalars: dict[str, dict[str, torch.Tensor]] = {}
        steps: dict[int, int] = {}
        uses_step = False
        for t in tensors:
            entry = by_name.get(t.name, {})
            step = entry.get("step")
            if not entry:
                steps[states.tensor_index[t.name]] = 0
            else:
                steps[states.tensor_index[t.name]] = max(zopt.step_count, 1) if step is None else _scalar_step(step)
            uses_step = uses_step or step is not None
            for key, v in entry.items():
                if key == "step":
                    continue
                if isinstance(v, torch.Tensor) and (v.dim() > 0 or t.numel == 1):
                    if tuple(v.shape) != t.shape:
                        raise ShapeMismatchError(f"optimizer state {t.name}.{key}", t.shape, tuple(v.shape))
                    fulls.setdefault(key, {})[t.name] = v
                else:
                    scalars.setdefault(t.name, {})[key] = torch.as_tensor(v)
        keys = dict.fromkeys([*states.flat.get(c.index, {}), *fulls])
        shards = {key: chunk_io.shard_from_full(c, fulls.get(key, {})) for key in keys}  # zeros: no state
        states.load_shards(c.index, shards, steps, uses_step=uses_step)
        for p in states.pieces.get(c.index, []):
            for key, v in scalars.get(p.name, {}).items():
                if p.param in zopt.state:
                    zopt.state[p.param][key] = v.clone()
    states.adopt()  # every chunk holds every key
    for group, saved in zip(zopt.param_groups, groups):
        for key, value in saved.items():
            if key not in ("params", "param_names") and key not in IMPLEMENTATION_FLAGS:
                group[key] = value
