"""Tensor states of chunk-managed parameters and the table of legal transitions.

The state machine follows ColossalAI Gemini's ``TensorState`` (itself from PatrickStar,
Fang et al. 2021, "PatrickStar: Parallel Training of Pre-trained Models via Chunk-based
Memory Management"). A chunk may be released (its gathered buffer dropped) only when none of
its tensors is in use, and reduced only when every tensor's gradient is ready.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from .errors import IllegalTransitionError


class TensorState(enum.Enum):
    """Lifecycle state of one tensor inside a chunk."""

    FREE = 0
    """No gathered payload is needed; only the shard is kept."""
    COMPUTE = 1
    """In use by forward or backward: its chunk must be gathered."""
    HOLD = 2
    """Payload valid and kept, not in use (e.g. between forward and backward without resharding)."""
    HOLD_AFTER_BWD = 3
    """Its gradient for this backward has been produced; may still be used again (a shared layer)."""
    READY_FOR_REDUCE = 4
    """Gradient final for this step; the chunk can be reduced once all its tensors are here."""


S = TensorState

LEGAL_TRANSITIONS: frozenset[tuple[TensorState, TensorState]] = frozenset(
    {
        (S.FREE, S.HOLD),  # chunk gathered (or initialized) without use
        (S.FREE, S.COMPUTE),  # gathered for a computation
        (S.HOLD, S.COMPUTE),  # used again while still gathered
        (S.HOLD, S.FREE),  # released
        (S.HOLD, S.READY_FOR_REDUCE),  # unused parameter given a zero gradient
        (S.COMPUTE, S.HOLD),  # forward of its module finished
        (S.COMPUTE, S.COMPUTE),  # nested / repeated use of the same parameter
        (S.COMPUTE, S.HOLD_AFTER_BWD),  # its gradient was produced in backward
        (S.HOLD_AFTER_BWD, S.COMPUTE),  # used again in the same backward (called several times)
        (S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE),  # backward pass over: gradient final
        (S.READY_FOR_REDUCE, S.HOLD),  # chunk reduced; payload still gathered
        (S.READY_FOR_REDUCE, S.FREE),  # chunk reduced and released at once
    }
)
"""The legal ``(from, to)`` pairs. Anything else raises :class:`IllegalTransitionError`."""


def is_legal(from_state: TensorState, to_state: TensorState) -> bool:
    """Whether moving a tensor from ``from_state`` to ``to_state`` is allowed."""
    return (from_state, to_state) in LEGAL_TRANSITIONS


def check_transition(tensor: str, from_state: TensorState, to_state: TensorState) -> None:
    """Raise :class:`IllegalTransitionError` naming ``tensor`` if the move is not legal."""
    if not is_legal(from_state, to_state):
        raise IllegalTransitionError(tensor, from_state, to_state)


class ChunkStates:
    """Per-tensor states of one chunk with per-state counters (Gemini's ``tensor_state_cnter``).

    Args:
        tensor_names: names of the chunk's tensors, in chunk order. All start FREE.

    Raises:
        IllegalTransitionError: from :meth:`transition` on a move not in :data:`LEGAL_TRANSITIONS`.
        KeyError: naming the tensor, if it does not belong to this chunk.
    """

    def __init__(self, tensor_names: Iterable[str], initial: TensorState = TensorState.FREE):
        self._states: dict[str, TensorState] = {name: initial for name in tensor_names}
        self._counts: dict[TensorState, int] = {s: 0 for s in TensorState}
        self._counts[initial] = len(self._states)

    @property
    def num_tensors(self) -> int:
        return len(self._states)

    @property
    def counts(self) -> Mapping[TensorState, int]:
        return dict(self._counts)

    def state(self, name: str) -> TensorState:
        try:
            return self._states[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in this chunk") from None

    def transition(self, name: str, to_state: TensorState) -> TensorState:
        """Move tensor ``name`` to ``to_state``; returns the previous state."""
        from_state = self.state(name)
        check_transition(name, from_state, to_state)
        self._states[name] = to_state
        self._counts[from_state] -= 1
        self._counts[to_state] += 1
        return from_state

    def transition_all(self, to_state: TensorState, *, only_from: TensorState | None = None) -> None:
        """Move every tensor (or every tensor currently in ``only_from``) to ``to_state``."""
        for name, state in list(self._states.items()):
            if only_from is None or state is only_from:
                if state is not to_state:
                    self.transition(name, to_state)

    def count(self, state: TensorState) -> int:
        return self._counts[state]

    @property
    def can_release(self) -> bool:
        """No tensor is in use: every tensor is FREE or HOLD."""
        return self._counts[S.FREE] + self._counts[S.HOLD] == self.num_tensors

    @property
    def can_reduce(self) -> bool:
        """Every tensor's gradient is final: all READY_FOR_REDUCE."""
        return self._counts[S.READY_FOR_REDUCE] == self.num_tensors

    def __repr__(self) -> str:
        nonzero = {s.name: c for s, c in self._counts.items() if c}
        return f"ChunkStates({nonzero})"
