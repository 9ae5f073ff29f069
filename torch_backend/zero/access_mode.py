"""What a ``ZeroDDP``'s runtime puts between torch and the parameters: :class:`Entry` (a managed parameter),
:class:`ParamAccessMode` (the ``TorchFunctionMode`` that sees every torch call while the module runs) and the
saved-tensor references :class:`SavedParam` and :class:`SavedView` (autograd holds them in place of a
parameter, or of a view of a chunk's buffer, saved for backward).

Each hands what it sees to the :class:`~torch_backend.zero.runtime.ChunkRuntime` given to it (``runtime``:
``run_op``, ``use_chunk``, ``saved_released``), which turns it into chunk calls; this module keeps no state.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ALIASING", "Entry", "ParamAccessMode", "SavedParam", "SavedView", "func_name"]


class Entry:
    """A managed parameter: its object, primary name, index in the layout, chunk and its place in the chunk
    (``tensor``, the layout's :class:`chunkzero.TensorSlot`)."""

    __slots__ = ("chunk", "index", "name", "param", "tensor")

    def __init__(self, param, name, index, chunk, tensor):
        self.param, self.name, self.index, self.chunk, self.tensor = param, name, index, chunk, tensor


# Tensor attributes and methods that read only metadata (right on a released parameter): no gather.
_METADATA_ONLY = frozenset({
    "dtype", "device", "requires_grad", "is_cuda", "is_leaf", "grad_fn", "layout", "is_sparse", "shape", "size",
    "dim", "ndim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "is_contiguous", "names", "is_meta", "is_quantized", "itemsize", "nbytes", "grad", "data_ptr",
})


# Calls whose result aliases the parameter's storage without being a view of it (no ``_base``): the
# mode cannot see the alias used later, so in forward the chunk is not released before the forward
# ends (released, the alias would read freed memory).
ALIASING = frozenset({"detach", "data"})


def func_name(func) -> str | None:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return name


class ParamAccessMode(TorchFunctionMode):
    """Gathers a parameter's chunk around every torch call that takes the parameter."""

    def __init__(self, runtime):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        runtime = self.runtime
        lookup = runtime.entries_by_id
        found = None
        views = None
        for a in (*args, *kwargs.values()) if kwargs else args:
            for b in a if type(a) is tuple or type(a) is list else (a,):
                e = lookup.get(id(b))
                if e is not None:
                    if e.param is b:
                        found = [e] if found is None else found + [e]
                elif isinstance(b, torch.Tensor):
                    base = b._base  # a view of a parameter (``w.t()``) taken while its chunk was gathered
                    if base is not None:
                        e = lookup.get(id(base))
                        if e is not None and e.param is base and not e.chunk.is_gathered:
                            views = [e.chunk] if views is None else views + [e.chunk]
        if found is None and views is None:
            return func(*args, **kwargs)
        if func_name(func) in _METADATA_ONLY:
            return func(*args, **kwargs)
        for c in views or ():
            if runtime.recording:
                runtime.recorder.touch(c.index)
            runtime.use_chunk(c)  # a view of a released chunk (e.g. ``w.t()`` taken earlier in this forward)
        if found is None:
            return func(*args, **kwargs)
        return runtime.run_op(found, func, args, kwargs)


class SavedParam:
    """A managed parameter saved for backward: one reference on its chunk while autograd holds it."""

    __slots__ = ("entry", "runtime")

    def __init__(self, runtime, entry):
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

    def __init__(self, runtime, chunk, tensor):
        self.runtime, self.chunk, self.tensor = runtime, chunk, tensor
        chunk.add_saved_ref()

    def __del__(self):
        try:
            self.runtime.saved_released(self.chunk, None)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
