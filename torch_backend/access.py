"""The objects through which ``ZeroDDP`` sees a parameter being used (what the runtime does with
each event is described in :mod:`torch_backend.runtime`).

- :class:`ParamAccessMode` — the ``TorchFunctionMode`` active while the wrapped module runs (and
  during a backward's recomputation): every torch call that takes a managed parameter, or a view of
  a released chunk's buffer, goes to the runtime first.
- :class:`SavedParam` / :class:`SavedView` — what autograd stores instead of a managed parameter
  (or a view of a chunk buffer, such as ``weight.t()`` inside ``F.linear``) saved for backward:
  one saved reference on its chunk (:meth:`torch_backend.chunks.Chunk.add_saved_ref`) while
  autograd holds it.
- :class:`SavedActivation` — any other saved tensor while a placement trace counts the activations
  alive (``placement="auto"`` on CPU): its bytes are counted while autograd holds it.
- :class:`ShardedGradPlaceholder` — what ``param.grad`` holds after a backward: the gradient lives
  in chunk shards, so any use of it (a plain torch optimizer over ``model.parameters()``,
  ``clip_grad_norm_``) raises a clear error instead of silently doing nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from chunkzero.errors import ConfigError

if TYPE_CHECKING:
    from .runtime import ChunkRuntime

__all__ = ["ParamAccessMode", "SavedActivation", "SavedParam", "SavedView", "ShardedGradPlaceholder", "storage_key"]

# Tensor attributes and methods that read only metadata (right on a released parameter): no gather.
_METADATA_ONLY = frozenset({
    "dtype", "device", "requires_grad", "is_cuda", "is_leaf", "grad_fn", "layout", "is_sparse", "shape", "size",
    "dim", "ndim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "is_contiguous", "names", "is_meta", "is_quantized", "itemsize", "nbytes", "grad", "data_ptr",
})


def _func_name(func) -> str | None:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return name


def storage_key(t) -> int | None:
    """Identity of a tensor's storage (``None`` for tensors without one)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


class ParamAccessMode(TorchFunctionMode):
    """Gathers a parameter's chunk around every torch call that takes the parameter."""

    def __init__(self, runtime: ChunkRuntime):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        runtime = self.runtime
        if runtime.in_engine:  # the engine's own tensor work inside a hook: nothing to gather
            return func(*args, **kwargs)
        lookup = runtime.entries_by_id
        by_storage = runtime.chunk_by_storage
        found = None
        views = None
        for a in (*args, *kwargs.values()):
            for b in a if type(a) in (list, tuple) else (a,):
                e = lookup.get(id(b))
                if e is not None and e.param is b:
                    found = [e] if found is None else found + [e]
                elif by_storage and isinstance(b, torch.Tensor):
                    c = by_storage.get(storage_key(b))
                    if c is not None and not c.is_gathered:
                        views = [c] if views is None else views + [c]
        if found is None and views is None:
            return func(*args, **kwargs)
        if _func_name(func) in _METADATA_ONLY:
            return func(*args, **kwargs)
        for c in views or ():
            runtime.use_chunk(c)  # a view of a released chunk (e.g. ``w.t()`` taken earlier in this forward)
        if found is None:
            return func(*args, **kwargs)
        return runtime.run_op(found, func, args, kwargs)


class SavedParam:
    """A managed parameter saved for backward: one reference on its chunk while autograd holds it."""

    __slots__ = ("entry", "runtime")

    def __init__(self, runtime: ChunkRuntime, entry):
        self.runtime, self.entry = runtime, entry
        entry.chunk.add_saved_ref(entry.name)

    def __del__(self):
        try:
            self.runtime.saved_released(self.entry.chunk, self.entry.name)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to release
            pass


class SavedView:
    """A saved tensor that is a view of a sharded chunk's buffer (e.g. ``weight.t()`` inside
    ``F.linear``): unpacking it gathers the chunk first."""

    __slots__ = ("chunk", "runtime", "tensor")

    def __init__(self, runtime: ChunkRuntime, chunk, tensor):
        self.runtime, self.chunk, self.tensor = runtime, chunk, tensor
        chunk.add_saved_ref()

    def __del__(self):
        try:
            self.runtime.saved_released(self.chunk, None)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class SavedActivation:
    """A saved tensor that is not model data (an activation), held for a counter of the bytes alive:
    ``counter.add(tensor)`` when saved returns a key, ``counter.release(key)`` when autograd frees it
    (:class:`torch_backend.placement.SavedBytes`)."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, counter, tensor):
        self.counter, self.tensor = counter, tensor
        self.key = counter.add(tensor)

    def __del__(self):
        try:
            self.counter.release(self.key)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class ShardedGradPlaceholder(torch.Tensor):
    """``param.grad`` of a ZeroDDP parameter after a backward: same shape, dtype and device, no data.

    Any operation on it raises :class:`chunkzero.errors.ConfigError` pointing to ``ZeroOptimizer``,
    so a plain torch optimizer or ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()`` fails
    loudly instead of doing nothing.
    """

    _name: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device,
                                                strides=param.stride(), requires_grad=False)
        t._name = name
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a._name for a in (*args, *(kwargs or {}).values()) if isinstance(a, ShardedGradPlaceholder)]
        names += [b._name for a in args if isinstance(a, (list, tuple)) for b in a if isinstance(b, ShardedGradPlaceholder)]
        raise ConfigError(
            f"the gradient of {names[0] if names else 'a ZeroDDP parameter'!r} lives in ZeroDDP's chunk shards, so "
            f"{func} cannot use param.grad: step with ZeroOptimizer(model, torch.optim.AdamW, max_norm=...) "
            "(it clips and steps the shards), or read ZeroDDP.grad_shard(chunk)")

    def __repr__(self) -> str:
        return f"ShardedGradPlaceholder({self._name!r}, shape={tuple(self.shape)})"
