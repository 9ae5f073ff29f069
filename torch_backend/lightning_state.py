"""Lightning's checkpoint dictionary (loops, callbacks, LR schedulers, hyper-parameters …) as JSON, so
that it travels in the JSON item of a chunkzero checkpoint (``meta.extra``) and is read back without
unpickling anything.

Everything but the weights and the optimizer state (those are the checkpoint's sharded arrays) is small:
ints, floats, strings, lists and dicts, plus a few tensors (a ``ModelCheckpoint``'s best score). Tensors
are written as ``{"__tensor__": {"dtype": "float32", "shape": [...], "data": [...]}}``; tuples come
back as lists. Anything else (a class, a module, an arbitrary object in the hyper-parameters) is refused
with the key path that holds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from chunkzero.errors import CheckpointFormatError, ConfigError

TENSOR_TAG = "__tensor__"

__all__ = ["TENSOR_TAG", "from_json", "to_json"]


def _float(x: float) -> Any:
    return x if math.isfinite(x) else {"__float__": repr(x)}  # inf/nan as text: strict JSON everywhere


def to_json(value: Any, path: str = "checkpoint") -> Any:
    """``value`` as JSON-able data (tensors tagged; see the module docstring).

    Raises:
        ConfigError: a value that is not JSON data or a tensor (names its key path and type), or a
            dict key that is not a string, int or float.
    """
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, np.generic):
        return to_json(value.item(), path)
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
        data = t.reshape(-1).tolist()
        if t.is_floating_point():
            data = [_float(float(x)) for x in data]
        return {TENSOR_TAG: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": data}}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int, float)):
                raise ConfigError(f"{path} has a key {k!r} of type {type(k).__name__}; a chunkzero checkpoint keeps "
                                  "Lightning's state as JSON (string keys)")
            if isinstance(k, str) and k.startswith("__") and k.endswith("__"):
                raise ConfigError(f"{path} has the key {k!r}, reserved for tagged values")
            out[str(k)] = to_json(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{path} holds a {type(value).__module__}.{type(value).__qualname__}, which a chunkzero "
                      "checkpoint cannot keep (it stores Lightning's state as JSON: numbers, strings, lists, dicts, "
                      "tensors); keep it out of the checkpoint (e.g. save_hyperparameters(ignore=[...]))")


def from_json(value: Any, path: str = "checkpoint") -> Any:
    """The inverse of :func:`to_json` (tuples come back as lists).

    Raises:
        CheckpointFormatError: a malformed tagged tensor or float (names its key path).
    """
    if isinstance(value, list):
        return [from_json(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if set(value) == {"__float__"}:
        try:
            return float(value["__float__"])
        except (TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: malformed float {value!r}") from None
    if set(value) == {TENSOR_TAG}:
        spec = value[TENSOR_TAG]
        try:
            dtype = getattr(torch, spec["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise TypeError(spec["dtype"])
            data = [from_json(x) for x in spec["data"]]
            return torch.tensor(data, dtype=dtype).reshape([int(n) for n in spec["shape"]])
        except (TypeError, KeyError, ValueError, RuntimeError, AttributeError) as e:
            raise CheckpointFormatError(f"{path}: malformed tensor ({e})") from None
    return {k: from_json(v, f"{path}.{k}") for k, v in value.items()}
