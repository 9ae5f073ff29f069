"""Materializing a module built on the meta device, one submodule at a time (FSDP1's
``param_init_fn`` convention), so that ``ZeroDDP`` never holds the whole model on a rank.

``ZeroDDP`` builds its chunks in order; each chunk needs the values of its tensors. For a meta
parameter, :meth:`MetaMaterializer.values` initializes every submodule up to the one that owns it,
in ``module.modules()`` order — the order in which eager construction runs ``reset_parameters()``,
so under the same seed the values equal eager init's. A submodule is materialized by giving each of
its own meta parameters and buffers real, uninitialized storage on the target device and calling
``param_init_fn(submodule)`` (default: ``submodule.reset_parameters()`` where defined). A new
parameter object replaces the meta one at every place it is registered, so tied weights stay tied
(and keep the values their first module gave them, as when the weight is tied after construction).
Once a chunk is built, its tensors become views of the chunk; a rank holds at most one chunk plus
the submodules being initialized. :func:`training_device` decides where the chunks live: the
parameters' one device, or where a meta-device module is materialized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from chunkzero.errors import ConfigError

__all__ = ["MetaMaterializer", "training_device"]


class MetaMaterializer:
    """Gives the meta parameters of ``module`` real values on ``device``, submodule by submodule.

    Args:
        module: the module to wrap (some or all parameters on the meta device).
        device: where the values are made (the compute device).
        param_init_fn: called as ``param_init_fn(submodule)`` to initialize a submodule's own
            parameters and buffers in place; ``None``: its ``reset_parameters()``.

    Raises:
        ConfigError: a submodule with meta parameters (or buffers) defines no ``reset_parameters()``
            and no ``param_init_fn`` was given (names the submodule and the tensors).
    """

    def __init__(self, module: nn.Module, device: torch.device, param_init_fn: Callable[[nn.Module], None] | None):
        self.device = device
        self.param_init_fn = param_init_fn
        self.order = [(name, m) for name, m in module.named_modules(remove_duplicate=True)]
        self.position = {id(m): i for i, (_, m) in enumerate(self.order)}
        self.owner: dict[int, int] = {}  # id(param) -> position of the first module that registers it
        self.registrations: dict[int, list[tuple[nn.Module, str]]] = {}
        for i, (_, m) in enumerate(self.order):
            for attr, p in m._parameters.items():
                if p is not None:
                    self.owner.setdefault(id(p), i)
                    self.registrations.setdefault(id(p), []).append((m, attr))
        self.replaced: dict[int, nn.Parameter] = {}  # id(meta parameter) -> the parameter that replaced it
        self.done = 0  # modules[:done] are materialized

    def values(self, param: nn.Parameter) -> nn.Parameter:
        """``param`` with real values: itself if not on the meta device, else the new parameter object
        that replaced it after its owner (and every submodule before it) was initialized."""
        if not param.is_meta:
            return param
        if id(param) in self.replaced:
            return self.replaced[id(param)]
        owner = self.owner[id(param)]
        while self.done <= owner:
            self._materialize(*self.order[self.done])
            self.done += 1
        return self.replaced[id(param)]

    def finish(self) -> None:
        """Materialize what is left (submodules with buffers only, after the last parameter)."""
        while self.done < len(self.order):
            self._materialize(*self.order[self.done])
            self.done += 1

    def _materialize(self, name: str, m: nn.Module) -> None:
        metas = [a for a, p in m._parameters.items() if p is not None and p.is_meta]
        meta_buffers = [a for a, b in m._buffers.items() if b is not None and b.is_meta]
        if not metas and not meta_buffers:
            return
        init = self.param_init_fn
        if init is None:
            init = getattr(m, "reset_parameters", None)
            if not callable(init):
                where = name or type(m).__name__
                raise ConfigError(
                    f"{where!r} ({type(m).__name__}) was built on the meta device with "
                    f"{', '.join(metas + meta_buffers)} but defines no reset_parameters(): pass "
                    "ZeroDDP(..., param_init_fn=fn), where fn(submodule) initializes a submodule's own tensors")
            init = (lambda f: lambda _m: f())(init)
        for attr in metas:
            old = m._parameters[attr]
            new = nn.Parameter(torch.empty_like(old, device=self.device), requires_grad=old.requires_grad)
            for mod, a in self.registrations[id(old)]:
                mod._parameters[a] = new
            self.registrations[id(new)] = self.registrations.pop(id(old))
            self.owner[id(new)] = self.owner.pop(id(old))
            self.replaced[id(old)] = new
        for attr in meta_buffers:
            m._buffers[attr] = torch.empty_like(m._buffers[attr], device=self.device)
        # a parameter already materialized through another module (a tied weight, maybe in a chunk
        # by now) keeps its values: eager construction initialized this module before the weight was
        # tied to it. The init writes into a stand-in, drawing the same random numbers as eager.
        kept = {a: p for a, p in m._parameters.items() if p is not None and a not in metas}
        for a, p in kept.items():
            m._parameters[a] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device), p.requires_grad)
        try:
            with torch.no_grad():
                init(m)
        finally:
            m._parameters.update(kept)


def _default_device() -> torch.device:
    """Where a meta-device module is materialized by default: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _device_arg(device: torch.device | str) -> torch.device:
    """``device`` with a CUDA index (``"cuda"`` is the current device, as torch places tensors), so it
    compares equal to the parameters' device and names the same memory-report key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def training_device(module: nn.Module, params: list[nn.Parameter], device: torch.device | str | None,
                    param_init_fn: Callable[[nn.Module], None] | None) -> tuple[torch.device, MetaMaterializer | None]:
    """``(device, materializer)`` for ``ZeroDDP``: the one device of ``params`` (``module``'s), or for
    a module built on the meta device the one it is materialized on (``device``, else the device of
    its non-meta parameters, else the current CUDA device or the CPU) and the
    :class:`MetaMaterializer` that does it (``None`` for other modules).

    Raises:
        ConfigError: parameters on several devices; ``device`` differs from a non-meta module's.
    """
    devices = {p.device for p in params if not p.is_meta}
    if len(devices) > 1:
        raise ConfigError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
    if any(p.is_meta for p in params):
        target = _device_arg(device) if device is not None else (devices.pop() if devices else _default_device())
        return target, MetaMaterializer(module, target, param_init_fn)
    if device is not None and _device_arg(device) != next(iter(devices)):
        raise ConfigError(f"device={str(device)!r} differs from the parameters' device {next(iter(devices))}; "
                          "it is for modules built on the meta device")
    return devices.pop(), None
