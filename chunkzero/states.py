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
    """Lifecycle state of one tensor inside a chunk.

    Gemini's table has a fifth state, ``HOLD_AFTER_BWD`` (a gradient produced, the tensor possibly
    used again in the same backward), because its hooks fire at every use of a parameter in
    backward. chunkzero's gradient hook is torch's post-accumulate-grad hook, which fires once per
    backward, after autograd has summed every use of the leaf: the gradient it sees is final, so
    a tensor goes straight to READY_FOR_REDUCE and that state is never needed.
    """

    FREE = 0
    """No gathered payload: only the shard is kept (the chunk is released)."""
    COMPUTE = 1
    """In use by a computation, in forward or backward: its chunk must stay gathered."""
    HOLD = 2
    """Payload gathered and kept, not in use (prefetched, between uses, or resident)."""
    READY_FOR_REDUCE = 4
    """Gradient final for this backward; the chunk is reduced once all its tensors are here."""

    __hash__ = object.__hash__  # members are singletons: identity, hashed in C (Enum's own hash is Python code)


S = TensorState

LEGAL_TRANSITIONS: frozenset[tuple[TensorState, TensorState]] = frozenset(
    {
        (S.FREE, S.HOLD),  # chunk gathered (prefetched or on demand)
        (S.HOLD, S.COMPUTE),  # used by a torch call, or unpacked by a backward node
        (S.COMPUTE, S.COMPUTE),  # used again while in use (a second saved reference unpacked)
        (S.COMPUTE, S.HOLD),  # the call, or the node's last saved reference, is over
        (S.HOLD, S.FREE),  # chunk released
        (S.FREE, S.READY_FOR_REDUCE),  # final gradient, its chunk already released (no saved tensor needed it)
        (S.HOLD, S.READY_FOR_REDUCE),  # final gradient while gathered and not in use
        (S.COMPUTE, S.READY_FOR_REDUCE),  # final gradient while a node still uses the tensor
        (S.READY_FOR_REDUCE, S.HOLD),  # backward over, chunk still gathered (handed to the reduction)
        (S.READY_FOR_REDUCE, S.FREE),  # backward over and the chunk released
    }
)
"""The legal ``(from, to)`` pairs. Anything else raises :class:`IllegalTransitionError`: notably
FREE → COMPUTE (a tensor is used only once its chunk is gathered), COMPUTE → FREE (a chunk in use
is never released) and READY_FOR_REDUCE → COMPUTE (a final gradient is not reopened)."""


def is_legal(from_state: TensorState, to_state: TensorState) -> bool:
    """Whether moving a tensor from ``from_state`` to ``to_state`` is allowed."""
    return (from_state, to_state) in LEGAL_TRANSITIONS


def check_transition(tensor: str, from_state: TensorState, to_state: TensorState) -> None:
    """Raise :class:`IllegalTransitionError` naming ``tensor`` if the move is not legal."""
    if not is_legal(from_state, to_state):
        raise IllegalTransitionError(tensor, from_state, to_state)


class ChunkStates:
    """Per-tensor states of one chunk with per-state counters (Gemini's ``tensor_state_cnter``).

    Every method is one call and one table lookup per state present: the engine calls it on every
    tensor event of a step, so nothing here calls further (a host cost per tensor, not per call).

    Args:
        tensor_names: names of the chunk's tensors, in chunk order.
        initial: the state they all start in.

    Raises:
        IllegalTransitionError: from :meth:`transition` / :meth:`transition_all` on a move not in
            :data:`LEGAL_TRANSITIONS`, naming the tensor (nothing changes then).
        KeyError: naming the tensor, if it does not belong to this chunk.
    """

    __slots__ = ("_counts", "_states", "num_tensors")

    def __init__(self, tensor_names: Iterable[str], initial: TensorState = TensorState.FREE):
        self._states: dict[str, TensorState] = {name: initial for name in tensor_names}
        self._counts: dict[TensorState, int] = {s: 0 for s in TensorState}
        self._counts[initial] = len(self._states)
        self.num_tensors = len(self._states)

    @property
    def counts(self) -> Mapping[TensorState, int]:
        return dict(self._counts)

    def state(self, name: str) -> TensorState:
        try:
            return self._states[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in this chunk") from None

    def transition(self, name: str, to_state: TensorState,
                   only_from: TensorState | frozenset[TensorState] | None = None) -> TensorState:
        """Move tensor ``name`` to ``to_state`` — with ``only_from`` (a state or a set of states),
        only if it is in one of them now, else it stays. Returns the state it was in."""
        try:
            from_state = self._states[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in this chunk") from None
        if only_from is not None and from_state is not only_from and (
                type(only_from) is TensorState or from_state not in only_from):
            return from_state
        if (from_state, to_state) not in LEGAL_TRANSITIONS:
            raise IllegalTransitionError(name, from_state, to_state)
        self._states[name] = to_state
        self._counts[from_state] -= 1
        self._counts[to_state] += 1
        return from_state

    def transition_all(self, to_state: TensorState, *,
                       only_from: TensorState | frozenset[TensorState] | None = None) -> None:
        """Move every tensor (or every tensor now in a state of ``only_from``) to ``to_state``: one
        table lookup per state present; an illegal move raises naming its first tensor."""
        counts = self._counts
        if only_from is None:
            sources = [s for s, n in counts.items() if n and s is not to_state]
        else:
            wanted = (only_from,) if type(only_from) is TensorState else only_from
            sources = [s for s in wanted if counts[s] and s is not to_state]
        if not sources:
            return
        for s in sources:
            if (s, to_state) not in LEGAL_TRANSITIONS:
                name = next(n for n, st in self._states.items() if st is s)
                raise IllegalTransitionError(name, s, to_state)
        states = self._states
        for name, st in states.items():
            if st in sources:
                states[name] = to_state
        for s in sources:
            counts[to_state] += counts[s]
            counts[s] = 0

    def names_in(self, *states: TensorState) -> list[str]:
        """The tensors now in any of ``states``, in chunk order."""
        return [name for name, state in self._states.items() if state in states]

    def count(self, state: TensorState) -> int:
        return self._counts[state]

    @property
    def can_release(self) -> bool:
        """No tensor is in use (none is COMPUTE)."""
        return self._counts[S.COMPUTE] == 0

    @property
    def can_reduce(self) -> bool:
        """Every tensor's gradient is final: all READY_FOR_REDUCE."""
        return self._counts[S.READY_FOR_REDUCE] == self.num_tensors

    def __repr__(self) -> str:
        nonzero = {s.name: c for s, c in self._counts.items() if c}
        return f"ChunkStates({nonzero})"
