"""Full (unsharded) torch state dicts of a ``ZeroDDP`` model: gathered one chunk at a time."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from chunkzero.errors import CheckpointError, ShapeMismatchError

from . import chunk_io

__all__ = ["IncompatibleKeys", "full_state_dict", "load_full_state_dict"]


class IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def full_state_dict(model) -> OrderedDict[str, torch.Tensor]:
    """The wrapped module's full state dict on every rank (collective): parameters from the fp32
    master chunks (float32, CPU, full shapes) under every alias name (tied names share one tensor),
    buffers copied as they are (CPU). Keys are the wrapped module's."""
    params: dict[str, torch.Tensor] = {}
    for c in model.chunks:
        full = chunk_io.gather_master(c)
        for t in c.tensors:
            value = full[t.offset : t.end].view(t.shape).to("cpu", copy=True)
            for n in t.names:
                params[n] = value
        del full
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in model.module.state_dict(keep_vars=True).items():
        if key in params:
            out[key] = params[key]
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu", copy=True)
        else:
            out[key] = value
    return out


def load_full_state_dict(model, state_dict: dict[str, Any], strict: bool = True) -> IncompatibleKeys:
    """Load a full-shaped torch state dict into ``model``'s shards (every rank passes the same one).

    A tied tensor is loaded from the first of its names present; its other names are neither missing
    nor unexpected. Values may have any floating dtype and device.

    Raises:
        ShapeMismatchError: a tensor's shape differs (names the key and both shapes).
        CheckpointError: with ``strict``, any missing or unexpected key (all listed); nothing loaded.
    """
    module_sd = model.module.state_dict(keep_vars=True)
    buffer_keys = [k for k in module_sd if k not in model.layout]
    missing: list[str] = []
    chosen: dict[str, torch.Tensor] = {}
    for t in model.layout.tensors:
        present = [n for n in t.names if n in state_dict]
        if not present:
            missing.extend(t.names)
            continue
        for n in present:
            got = tuple(state_dict[n].shape)
            if got != t.shape:
                raise ShapeMismatchError(n, t.shape, got)
        chosen[t.name] = state_dict[present[0]]
    named_buffers = dict(model.module.named_buffers())
    for k in buffer_keys:
        if k not in state_dict:
            missing.append(k)
        elif k in named_buffers and tuple(state_dict[k].shape) != tuple(named_buffers[k].shape):
            raise ShapeMismatchError(k, tuple(named_buffers[k].shape), tuple(state_dict[k].shape))
    known = set(model.layout.all_names) | set(buffer_keys)
    unexpected = [k for k in state_dict if k not in known]
    if strict and (missing or unexpected):
        raise CheckpointError(
            "Error(s) in loading state_dict for ZeroDDP: "
            + (f"missing keys: {missing}. " if missing else "")
            + (f"unexpected keys: {unexpected}." if unexpected else "")
        )
    for c in model.chunks:
        values = {t.name: chosen[t.name] for t in c.tensors if t.name in chosen}
        if values:
            c.load_master(chunk_io.shard_from_full(c, values, base=c.master_values()))
    with torch.no_grad():
        for k in buffer_keys:
            if k in state_dict and k in named_buffers:
                named_buffers[k].copy_(state_dict[k])
    return IncompatibleKeys(missing, unexpected)
