"""Which submodules of a ``ZeroDDP`` run as units, with the access mode off: :class:`UnitRecorder`.

Note [recorded units]. Most of the access mode's calls are on activations, inside modules that read
their own parameters only. A submodule whose parameters all lie in one chunk, and whose calls in a
recorded forward (the first one that keeps the mode on throughout) read tensors of that chunk only and
detach none of them (an alias may outlive the call), becomes a unit, as a compiled submodule is: the
runtime (:mod:`torch_backend.zero.runtime`) gathers and holds its chunk before the call, takes the mode
off inside it, and counts its tensors as used when it returns. The outermost such submodules are chosen
(with one chunk per block: the blocks). A chunk gathers at the same points as under the mode: the
unit's first call reads its chunk. What a unit would miss is a read of another chunk's parameter that
the recorded forward did not make (a branch taken later): a released parameter reads NaN there
(``chunks._released_placeholder``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["ALIAS", "UnitRecorder"]

ALIAS = -1
"""What :meth:`UnitRecorder.touch` is given for a call that detached a parameter: no running candidate
can be a unit."""


class UnitRecorder:
    """The candidates of one wrapped module and what one recorded forward saw of them.

    Args:
        module: the wrapped module (never a unit itself).
        entries_of: a submodule's managed parameters (objects with ``.chunk.index``), in any order.
        excluded: ids of submodules that are or lie inside a compiled submodule (units already).
    """

    def __init__(self, module: nn.Module, entries_of: Callable[[nn.Module], list[Any]], excluded: Iterable[int]):
        excluded = set(excluded)
        self.candidates: dict[int, tuple[int, list[Any]]] = {}
        """Submodules whose parameters all lie in one chunk: ``id -> (chunk index, entries)``."""
        self._parent: dict[int, int] = {}
        for sub in module.modules():
            for child in sub.children():
                self._parent.setdefault(id(child), id(sub))
            own = entries_of(sub)
            if (sub is not module and own and len({e.chunk.index for e in own}) == 1
                    and not any(id(m) in excluded for m in sub.modules())):
                self.candidates[id(sub)] = (own[0].chunk.index, own)
        self._running: list[tuple[int, int]] = []
        self._called: set[int] = set()
        self._touched_other: set[int] = set()

    def start(self) -> None:
        """A forward begins: record it from scratch."""
        self._running, self._called, self._touched_other = [], set(), set()

    def enter(self, module: nn.Module) -> None:
        """``module``'s forward begins (its pre-hook)."""
        candidate = self.candidates.get(id(module))
        if candidate is not None:
            self._running.append((id(module), candidate[0]))
            self._called.add(id(module))

    def exit(self, module: nn.Module) -> None:
        """``module``'s forward ended or raised (its post-hook)."""
        if self._running and self._running[-1][0] == id(module):
            self._running.pop()

    def touch(self, chunk_index: int) -> None:
        """A call read a tensor of chunk ``chunk_index`` (or detached a parameter: :data:`ALIAS`): a running
        candidate of another chunk cannot be a unit."""
        for module_id, own in self._running:
            if own != chunk_index:
                self._touched_other.add(module_id)

    def units(self) -> dict[int, list[Any]]:
        """After the recorded forward: ``{id: entries}`` of the outermost candidates it called that read
        their chunk only."""
        chosen = self._called - self._touched_other
        found = {}
        for module_id in chosen:
            up = self._parent.get(module_id)
            while up is not None and up not in chosen:
                up = self._parent.get(up)
            if up is None:
                found[module_id] = self.candidates[module_id][1]
        return found
