"""Torch tensors ↔ numpy arrays, the torch backend's side of the checkpoint format (bfloat16 included:
numpy has none, so it travels as ``ml_dtypes.bfloat16``, the type JAX and TensorStore use)."""

from __future__ import annotations

import numpy as np
import torch

from chunkzero.dtypes import canonical_dtype, numpy_dtype


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a chunkzero dtype name (``"bfloat16"``, ``"fp16"`` …)."""
    return getattr(torch, canonical_dtype(name))


def to_numpy(t: torch.Tensor, *, copy: bool = True) -> np.ndarray:
    """``t`` on the host as numpy (bfloat16 as ``ml_dtypes.bfloat16``): a copy, or with ``copy=False``
    a view of ``t``'s memory when it is already a contiguous CPU tensor."""
    t = t.detach()
    on_cpu = t.device.type == "cpu"
    t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        a = t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    else:
        a = t.numpy()
    return a.copy() if (on_cpu and copy) else a


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing ``a``'s memory (bfloat16 handled; a read-only array is copied first)."""
    a = np.ascontiguousarray(a)
    if a.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)
