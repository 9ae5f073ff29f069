"""The tensor-state transition table, exhaustively, and the chunk-level counters and predicates."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkzero import LEGAL_TRANSITIONS, ChunkStates, IllegalTransitionError, TensorState
from chunkzero.states import check_transition, is_legal

S = TensorState

# The table written out independently of states.py: a change to it must be deliberate.
EXPECTED_LEGAL = {
    (S.FREE, S.HOLD), (S.FREE, S.READY_FOR_REDUCE),
    (S.HOLD, S.COMPUTE), (S.HOLD, S.FREE), (S.HOLD, S.READY_FOR_REDUCE),
    (S.COMPUTE, S.HOLD), (S.COMPUTE, S.COMPUTE), (S.COMPUTE, S.READY_FOR_REDUCE),
    (S.READY_FOR_REDUCE, S.HOLD), (S.READY_FOR_REDUCE, S.FREE),
}
ALL_PAIRS = list(itertools.product(TensorState, TensorState))


def test_table_is_the_expected_one():
    assert set(LEGAL_TRANSITIONS) == EXPECTED_LEGAL
    assert len(ALL_PAIRS) == 16


@pytest.mark.parametrize("src,dst", ALL_PAIRS, ids=[f"{a.name}->{b.name}" for a, b in ALL_PAIRS])
def test_every_pair(src, dst):
    states = ChunkStates(["w", "other"], initial=src)
    legal = (src, dst) in EXPECTED_LEGAL
    assert is_legal(src, dst) is legal
    if legal:
        check_transition("w", src, dst)
        assert states.transition("w", dst) is src
        assert states.state("w") is dst and states.state("other") is src
        expected = {s: 0 for s in TensorState}
        expected[src] += 1
        expected[dst] += 1
        assert states.counts == expected
    else:
        with pytest.raises(IllegalTransitionError) as info:
            states.transition("w", dst)
        err = info.value
        assert (err.tensor, err.from_state, err.to_state) == ("w", src, dst)
        assert "'w'" in str(err) and f"{src.name} -> {dst.name}" in str(err)
        # nothing changed
        assert states.state("w") is src and states.count(src) == 2
        with pytest.raises(IllegalTransitionError):
            check_transition("w", src, dst)


def test_a_training_step():
    """Forward, backward and reduce of a chunk of two tensors, one used twice (a shared layer)."""
    c = ChunkStates(["wte", "ln"])
    assert c.can_release and not c.can_reduce
    c.transition_all(S.HOLD)  # gathered for forward
    c.transition("wte", S.COMPUTE)
    assert not c.can_release
    c.transition("wte", S.HOLD)
    c.transition("ln", S.COMPUTE)
    c.transition("ln", S.HOLD)
    assert c.can_release and c.counts[S.HOLD] == 2
    # backward: ln first, wte used twice (tied head, then embedding)
    c.transition("ln", S.COMPUTE)
    c.transition("ln", S.READY_FOR_REDUCE)
    c.transition("wte", S.COMPUTE)
    c.transition("wte", S.COMPUTE)  # its second saved reference unpacked
    assert not c.can_reduce and not c.can_release
    c.transition("wte", S.READY_FOR_REDUCE)
    assert c.can_reduce and c.count(S.READY_FOR_REDUCE) == 2
    c.transition_all(S.FREE)
    assert c.can_release and c.count(S.FREE) == 2 and not c.can_reduce


def test_unused_parameter_goes_ready_from_hold():
    c = ChunkStates(["used", "unused"], initial=S.HOLD)
    c.transition("used", S.COMPUTE)
    c.transition("used", S.READY_FOR_REDUCE)
    assert not c.can_reduce
    c.transition("unused", S.READY_FOR_REDUCE)
    assert c.can_reduce


def test_transition_all_names_the_offending_tensor():
    c = ChunkStates(["a", "b"])
    c.transition("b", S.HOLD)
    with pytest.raises(IllegalTransitionError) as info:
        c.transition_all(S.COMPUTE)  # a is FREE: FREE -> COMPUTE is illegal (not gathered)
    assert info.value.tensor == "a" and info.value.from_state is S.FREE


def test_unknown_tensor_is_named():
    with pytest.raises(KeyError, match="'zz'"):
        ChunkStates(["a"]).transition("zz", S.HOLD)


def test_empty_chunk():
    c = ChunkStates([])
    assert c.num_tensors == 0 and c.can_release and c.can_reduce


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(list(TensorState))), max_size=40))
def test_counters_match_states(moves):
    """After any sequence of attempted moves the counters equal the per-tensor states and the
    predicates agree with their definitions."""
    names = ["t0", "t1", "t2", "t3"]
    c = ChunkStates(names)
    shadow = {n: S.FREE for n in names}
    for i, dst in moves:
        n = names[i]
        if (shadow[n], dst) in EXPECTED_LEGAL:
            c.transition(n, dst)
            shadow[n] = dst
        else:
            with pytest.raises(IllegalTransitionError):
                c.transition(n, dst)
        counts = c.counts
        assert sum(counts.values()) == 4
        for s in TensorState:
            assert counts[s] == sum(1 for v in shadow.values() if v is s)
        assert c.can_release == all(v is not S.COMPUTE for v in shadow.values())
        assert c.can_reduce == all(v is S.READY_FOR_REDUCE for v in shadow.values())
