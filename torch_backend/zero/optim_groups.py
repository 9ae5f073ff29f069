"""Which tensors each param group of a :class:`~torch_backend.ZeroOptimizer` holds.

``param_groups=[{"params": [...], "weight_decay": 0.0, ...}, ...]`` names the wrapped module's
parameters by object (``model.module.parameters()``, ``named_parameters()`` pairs) or by name (any
alias of a tied tensor; the ``module.`` prefix of ``ZeroDDP.named_parameters()`` is accepted). Each
entry resolves to a layout tensor's primary name; every trainable tensor belongs to exactly one
group, and the ones not listed form a default group after the listed ones (torch's convention is
the same: one group per dict, in the order given). Groups are defined per tensor, so they are the
same on every rank whatever the world size.

``params=`` takes torch's ``Optimizer(params)`` meaning instead (:func:`torch_params_specs`): every
trainable parameter listed, as parameters or as group dicts; frozen ones in it are skipped, as a torch
optimizer never steps a parameter without a gradient.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from chunkzero.errors import ConfigError

__all__ = ["GroupSpec", "group_specs", "resolve_params", "torch_params_specs", "trainable_names"]


@dataclass
class GroupSpec:
    """One param group before the inner optimizer fills its defaults.

    Attributes:
        names: primary layout names of its tensors, in the order given (the default group: module order).
        options: its hyper-parameters (everything but ``params``).
        is_default: the group of the trainable tensors no ``param_groups`` entry listed.
    """

    names: list[str]
    options: dict[str, Any] = field(default_factory=dict)
    is_default: bool = False


def trainable_names(model) -> list[str]:
    """Primary names of the trainable tensors in ``model.module.parameters()`` order (each tied tensor once)."""
    seen: dict[str, None] = {}
    for name, p in model.module.named_parameters():
        if p.requires_grad:
            seen.setdefault(model.layout.tensor(name).name, None)
    return list(seen)


def _object_names(model) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, p in model.module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), model.layout.tensor(name).name)
    return out


def _lookup(layout, name: str, where: str) -> str:
    for candidate in (name, name.removeprefix("module.")):
        if candidate in layout:
            return layout.tensor(candidate).name
    close = difflib.get_close_matches(name, layout.all_names, n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    raise ConfigError(f"{where}: the wrapped module has no parameter named {name!r}{hint}")


def _entries(params: Any, where: str):
    """A group's ``params`` as an iterable of entries (one parameter or name is a list of one).

    Raises:
        ConfigError: a set (unordered), or neither parameters nor names.
    """
    if isinstance(params, (torch.Tensor, str)):
        return [params]
    if isinstance(params, (set, frozenset)):
        raise ConfigError(f"{where}: 'params' is a set; give a list (a set's order changes between runs)")
    if not isinstance(params, Iterable):
        raise ConfigError(f"{where}: 'params' must be parameters or names, got {type(params).__name__}")
    return params


def resolve_params(model, params: Any, where: str, objects: Mapping[int, str] | None = None) -> list[str]:
    """Primary layout names of a group's ``params``: parameters, ``(name, parameter)`` pairs or names.

    Raises:
        ConfigError: a set (unordered), an unknown name, a tensor that is not a parameter of
            ``model.module``, a frozen parameter, or an entry of another type (each named).
    """
    params = _entries(params, where)
    objects = _object_names(model) if objects is None else objects
    names = []
    for item in params:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            item = item[1]  # named_parameters() pairs: the object decides (ZeroDDP's names carry "module.")
        if isinstance(item, str):
            name = _lookup(model.layout, item, where)
        elif isinstance(item, torch.Tensor):
            name = objects.get(id(item))
            if name is None:
                raise ConfigError(
                    f"{where}: a tensor of shape {tuple(item.shape)} is not a parameter of the ZeroDDP-wrapped module "
                    "(pass the parameters of model.module, or their names)")
        else:
            raise ConfigError(f"{where}: 'params' entries must be parameters or names, got {type(item).__name__}")
        if not model.layout.tensor(name).requires_grad:
            raise ConfigError(f"{where}: parameter {name!r} is frozen (requires_grad=False): frozen chunks keep no "
                              "optimizer state; leave it out of the param groups")
        names.append(name)
    return names


def _check_duplicates(specs: list[GroupSpec]) -> None:
    owner: dict[str, int] = {}
    for i, spec in enumerate(specs):
        for name in spec.names:
            if name in owner:
                where = f"twice in param group {i}" if owner[name] == i else f"in param groups {owner[name]} and {i}"
                raise ConfigError(f"parameter {name!r} is listed {where}; each parameter belongs to one group")
            owner[name] = i


def group_specs(model, param_groups: Iterable[Mapping[str, Any]] | None) -> list[GroupSpec]:
    """The groups of ``param_groups`` in order, then a default group (no options of its own: the
    optimizer's defaults) of the trainable tensors none of them lists — only if there are any.

    Raises:
        ConfigError: an entry is not a dict with ``params``, or as :func:`resolve_params`; a parameter
            listed twice.
    """
    specs: list[GroupSpec] = []
    if param_groups is not None:
        if isinstance(param_groups, Mapping):
            raise ConfigError("param_groups must be a list of dicts, got one dict")
        objects = _object_names(model)
        for i, g in enumerate(param_groups):
            if not isinstance(g, Mapping) or "params" not in g:
                raise ConfigError(f"param group {i} must be a dict with a 'params' entry, got {type(g).__name__}")
            names = resolve_params(model, g["params"], f"param group {i}", objects)
            specs.append(GroupSpec(names, {k: v for k, v in g.items() if k != "params"}))
    _check_duplicates(specs)
    listed = {n for s in specs for n in s.names}
    rest = [n for n in trainable_names(model) if n not in listed]
    if rest or not specs:
        specs.append(GroupSpec(rest, {}, is_default=True))
    if not any(s.names for s in specs):
        raise ConfigError("the model has no trainable parameters")
    return specs


def _is_frozen(model, item: Any, objects: Mapping[int, str]) -> bool:
    """Whether a ``params`` entry names a frozen parameter of ``model.module`` (unknown entries: no,
    :func:`resolve_params` reports them)."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
        item = item[1]
    if isinstance(item, torch.Tensor):
        name = objects.get(id(item))
    elif isinstance(item, str):
        name = next((n for n in (item, item.removeprefix("module.")) if n in model.layout), None)
    else:
        return False
    return name is not None and not model.layout.tensor(name).requires_grad


def _without_frozen(model, params: Any, where: str, objects: Mapping[int, str]) -> list:
    return [item for item in _entries(params, where) if not _is_frozen(model, item, objects)]


def torch_params_specs(model, params: Any) -> list[GroupSpec]:
    """The groups of torch's ``params`` argument (``ZeroOptimizer(model, AdamW, params=...)``): an
    iterable of parameters (objects, ``named_parameters()`` pairs or names, as in ``param_groups``) →
    one group; an iterable of group dicts → one group per dict, as ``param_groups=``. Frozen
    parameters in it are skipped (torch's optimizers accept them and never step them), so
    ``model.parameters()`` and ``model.module.parameters()`` work, also with a frozen base.

    Raises:
        ConfigError: one dict instead of a list, an empty list, parameters and dicts mixed, a
            trainable parameter left out (torch would never update it, while ZeroDDP reduces its
            gradient; names the first ones), or as :func:`group_specs` (unknown, foreign or
            twice-listed parameters, an entry that is not a dict with ``params``).
    """
    if isinstance(params, Mapping):
        raise ConfigError("params= is one dict; give a list of group dicts, params=[{'params': [...], ...}], "
                          "or the same list as param_groups=")
    if isinstance(params, (torch.Tensor, str)):
        params = [params]
    if isinstance(params, (set, frozenset)):
        raise ConfigError("params= is a set; give a list (a set's order changes between runs)")
    if not isinstance(params, Iterable):
        raise ConfigError(f"params= must be an iterable of parameters or of group dicts, got {type(params).__name__}")
    items = list(params)
    if not items:
        raise ConfigError("params= is empty: list the parameters to optimize (e.g. model.parameters())")
    objects = _object_names(model)
    dicts = [isinstance(item, Mapping) for item in items]
    if all(dicts):
        groups = []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ConfigError(f"param group {i} must be a dict with a 'params' entry")
            groups.append({**g, "params": _without_frozen(model, g["params"], f"param group {i}", objects)})
    elif any(dicts):
        raise ConfigError("params= mixes parameters and group dicts; give one kind (torch's convention)")
    else:
        groups = [{"params": _without_frozen(model, items, "params=", objects)}]
    specs = group_specs(model, groups)
    left_out = specs[-1].names if specs[-1].is_default else []
    if left_out:
        more = f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
        raise ConfigError(
            f"params= leaves out trainable parameter(s) {', '.join(map(repr, left_out[:3]))}{more}: torch would never "
            "update them, but ZeroDDP reduces their gradients. List every trainable parameter, freeze the others "
            "before wrapping (requires_grad_(False)), or pass param_groups=[...] (unlisted parameters then form "
            "a default group with the optimizer's defaults)")
    return specs
