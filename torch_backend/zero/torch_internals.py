"""Every question the engine asks torch that torch's public API does not answer, in one place:
whether a call runs under ``torch.compile``, a compiled module's original, the autograd node being
run, the torch-function mode stack, the autograd engine's entry, a storage's identity, a
data-less tensor subclass and a process group's collective timeout. A torch upgrade that moves one of
these breaks here alone."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = [
    "ENGINE_RUN_BACKWARD",
    "compile_frame_callback",
    "compiled_original",
    "current_autograd_node",
    "no_torch_function",
    "pop_torch_function_mode",
    "process_group_timeout",
    "push_torch_function_mode",
    "storage_key",
    "torch_function_mode_depth",
    "tree_flatten",
    "wrapper_tensor",
]


def _no_frame_callback():
    return None


_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
compile_frame_callback = _eval_frame.get_eval_frame_callback if _eval_frame is not None else _no_frame_callback
"""``compile_frame_callback()`` is not ``None`` while a ``torch.compile``'d frame runs (eagerly, after a
graph break); with ``torch.compiler.is_compiling()`` (tracing) it tells whether a call runs under
``torch.compile``. Torch's own function: calling it costs no Python frame here."""


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile``'d module (dynamo's ``OptimizedModule``) wraps, told without
    importing dynamo; ``None`` for any other module."""
    orig = getattr(module, "_orig_mod", None)
    return orig if type(module).__name__ == "OptimizedModule" and isinstance(orig, nn.Module) else None


# torch's own functions under the engine's names (a call costs no Python frame here)
current_autograd_node = torch._C._current_autograd_node
"""``current_autograd_node()``: the autograd node whose backward runs on this thread (``None`` outside one)."""
pop_torch_function_mode = torch._C._pop_torch_function_stack
"""``pop_torch_function_mode()``: take the innermost torch-function mode off the stack and return it."""
push_torch_function_mode = torch._C._push_on_torch_function_stack
"""``push_torch_function_mode(mode)``: put ``mode`` back on top of the torch-function mode stack."""
torch_function_mode_depth = torch._C._len_torch_function_stack
"""``torch_function_mode_depth()``: how many torch-function modes are on the stack."""
no_torch_function = torch._C.DisableTorchFunction
"""``with no_torch_function():`` torch calls inside skip every torch-function mode and subclass handler
(the engine's own tensor work inside a hook: no Python frame per call)."""


ENGINE_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)
"""The autograd engine's entry (``None`` where this torch lacks it): it runs a backward with the active
torch-function modes kept, unlike ``Tensor.backward``, which goes through them."""


def storage_key(t) -> int | None:
    """Identity of a tensor's storage (``None`` for tensors without one)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def wrapper_tensor(cls, like: torch.Tensor) -> torch.Tensor:
    """A data-less instance of tensor subclass ``cls`` with ``like``'s shape, strides, dtype and device."""
    return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                               strides=like.stride(), requires_grad=False)


def process_group_timeout(group):
    """The collective timeout (``datetime.timedelta``) ``group`` was created with (the ``timeout=`` of
    ``init_process_group`` / ``new_group``), read from its backend's options; ``None`` when this torch
    does not tell."""
    import torch.distributed as dist

    try:
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
