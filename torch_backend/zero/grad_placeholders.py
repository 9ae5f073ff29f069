"""``param.grad`` after a backward of a ``ZeroDDP``: :class:`ShardedGradPlaceholder` and
:class:`GradPlaceholders`, which the runtime sets and clears.

The gradient lives in the chunk shards, so each parameter that received one holds a placeholder in
``.grad``: a plain torch optimizer or ``clip_grad_norm_`` over ``model.parameters()`` raises instead of
doing nothing.
"""

from __future__ import annotations

import torch

from chunkzero.errors import ConfigError

from .torch_internals import wrapper_tensor

__all__ = ["GradPlaceholders", "ShardedGradPlaceholder"]


class ShardedGradPlaceholder(torch.Tensor):
    """``param.grad`` of a ZeroDDP parameter after a backward: same shape, dtype and device, no data.

    Any operation on it raises :class:`chunkzero.errors.ConfigError` pointing to ``ZeroOptimizer``,
    so a plain torch optimizer or ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()`` fails
    loudly instead of doing nothing.
    """

    param_name: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str):
        t = wrapper_tensor(cls, param)
        t.param_name = name
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a.param_name for a in (*args, *(kwargs or {}).values()) if isinstance(a, ShardedGradPlaceholder)]
        names += [
            b.param_name
            for a in args
            if isinstance(a, (list, tuple))
            for b in a
            if isinstance(b, ShardedGradPlaceholder)
        ]
        raise ConfigError(
            f"the gradient of {names[0] if names else 'a ZeroDDP parameter'!r} lives in ZeroDDP's chunk shards, so "
            f"{func} cannot use param.grad: step with ZeroOptimizer(model, torch.optim.AdamW, max_norm=...) "
            "(it clips and steps the shards), or read ZeroDDP.grad_shard(chunk)")

    def __repr__(self) -> str:
        return f"ShardedGradPlaceholder({self.param_name!r}, shape={tuple(self.shape)})"


class GradPlaceholders:
    """The placeholders of a model's trainable parameters: set after a backward in the ``.grad`` of
    each parameter that received a gradient on some rank, cleared before the next forward, backward
    or ``zero_grad`` (only where ``.grad`` still holds the placeholder).

    Args:
        params: ``(parameter, name, layout tensor index)`` of each trainable parameter.
    """

    def __init__(self, params: list[tuple[torch.nn.Parameter, str, int]]):
        self.params = params
        self._made: dict[int, ShardedGradPlaceholder] = {}
        self.installed = False
        """Whether some parameter's ``.grad`` may hold its placeholder now."""

    def set(self, grad_received: torch.Tensor) -> None:
        """Put a placeholder in ``.grad`` of every parameter whose ``grad_received[index]`` is set."""
        received = grad_received.tolist()
        for param, name, index in self.params:
            if received[index] and param.grad is None:
                if index not in self._made:
                    self._made[index] = ShardedGradPlaceholder(param, name)
                param.grad = self._made[index]
                self.installed = True

    def clear(self) -> None:
        """Take the placeholders out of ``.grad`` again."""
        if self.installed:
            for param, _, index in self.params:
                if param.grad is not None and param.grad is self._made.get(index):
                    param.grad = None
            self.installed = False
