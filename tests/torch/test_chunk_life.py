"""A chunk's life, against the core state machine (``chunkzero.states``).

Every state change of a chunk's tensors goes through one of :class:`torch_backend.zero.chunks.Chunk`'s
life methods. These tests record, during real training, which legal transition each method takes,
and compare with the table written out here: a transition that the engine stops taking (a removed
call, a skipped state) fails :func:`test_every_legal_transition_is_taken_in_training`. Each illegal
transition the engine could be driven to is then driven through misuse and must raise.

The chunks are sharded by parameter offload at world size 1 (``offload_param_frac=1.0``): each use
gathers, each release frees, in one process, as at W > 1.
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from chunkzero import LEGAL_TRANSITIONS, IllegalTransitionError, TensorState
from chunkzero.states import ChunkStates
from torch_backend import ZeroDDP, ZeroOptimizer

S = TensorState
ADAMW = dict(lr=1e-3, eps=1e-6)

# (from, to) -> the Chunk methods that take it in the scenarios below, written out independently
TAKEN_BY = {
    (S.FREE, S.HOLD): {"finish_gather"},
    (S.HOLD, S.COMPUTE): {"use"},
    (S.COMPUTE, S.COMPUTE): {"use"},
    (S.COMPUTE, S.HOLD): {"done_using", "rest"},
    (S.HOLD, S.FREE): {"release"},
    (S.FREE, S.READY_FOR_REDUCE): {"grad_ready"},
    (S.HOLD, S.READY_FOR_REDUCE): {"grad_ready"},
    (S.COMPUTE, S.READY_FOR_REDUCE): {"grad_ready"},
    (S.READY_FOR_REDUCE, S.HOLD): {"rest"},
    (S.READY_FOR_REDUCE, S.FREE): {"rest"},  # release keeps a final gradient READY_FOR_REDUCE
}


class Net(nn.Module):
    """A tied embedding/head, a checkpointed block (a recomputation in backward), a frozen layer, a
    weight used twice in a row (two saved references alive at once), a keep-gathered (resident)
    chunk, and an unused parameter (a zero gradient with ``find_unused_parameters``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.unused = nn.Parameter(torch.ones(3))
        self.probe = None
        """A gradient hook put on the activation between the two uses of ``w`` (misuse tests)."""

    def forward(self, idx):
        h = self.emb(idx)
        h = h + checkpoint(self.block, h, use_reentrant=False)
        h = h @ self.frozen.weight + self.frozen.bias  # the frozen weight itself saved for backward
        h = h @ self.w
        if self.probe is not None:
            h.register_hook(self.probe)
        h = h @ self.w
        return F.linear(h, self.emb.weight)  # the tied head


def _loss(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].reshape(-1, 16), idx[:, 1:].reshape(-1))


def _record(monkeypatch) -> dict:
    """Patch ChunkStates' two moves to record each ``(from, to)`` taken -> {calling Chunk method}."""
    taken: dict = collections.defaultdict(set)
    original, original_all = ChunkStates.transition, ChunkStates.transition_all

    def transition(self, name, to_state, only_from=None):
        before = self.state(name)
        original(self, name, to_state, only_from)
        if self.state(name) is to_state and (only_from is None or before is only_from
                                             or (not isinstance(only_from, TensorState) and before in only_from)):
            taken[(before, to_state)].add(sys._getframe(1).f_code.co_name)

    def transition_all(self, to_state, *, only_from=None):
        before = self.counts
        original_all(self, to_state, only_from=only_from)
        wanted = (
            set(TensorState) if only_from is None else {only_from} if isinstance(only_from, TensorState) else only_from
        )
        for s, n in before.items():
            if n and s is not to_state and s in wanted:
                taken[(s, to_state)].add(sys._getframe(1).f_code.co_name)

    monkeypatch.setattr(ChunkStates, "transition", transition)
    monkeypatch.setattr(ChunkStates, "transition_all", transition_all)
    return taken


def _train(steps: int = 2, **kwargs):
    """``steps`` steps through ``ZeroOptimizer.backward``, then one whose backward retains its graph
    (its saved references outlive the backward, so its tensors are still in use at its end)."""
    model = ZeroDDP(Net(), chunk_size=80, offload_param_frac=1.0, find_unused_parameters=True,
                    keep_gathered=["block.2.bias"], **kwargs)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps + 1):
        loss = _loss(model, torch.randint(0, 16, (2, 6), generator=gen))
        if step < steps:
            optim.backward(loss)
        else:
            loss.backward(retain_graph=True)
        optim.step()
        optim.zero_grad()
        del loss
    return model


@pytest.mark.parametrize("prefetch", [0, 1])
def test_every_legal_transition_is_taken_in_training(monkeypatch, prefetch):
    taken = _record(monkeypatch)
    model = _train(prefetch=prefetch)
    assert len(model.chunks) > 2 and sum(c.resident for c in model.chunks) == 1
    assert set(TAKEN_BY) == set(LEGAL_TRANSITIONS)
    assert dict(taken) == TAKEN_BY
    reached = {s for pair in taken for s in pair}
    assert reached == set(TensorState)


def _chunk_of(model, name):
    return next(c for c in model.chunks if name in c.params)


def test_use_of_a_released_chunk_raises():
    """FREE -> COMPUTE: a tensor is used only once its chunk is gathered."""
    model = _train(steps=1)
    c = _chunk_of(model, "w")
    assert not c.is_gathered
    with pytest.raises(IllegalTransitionError, match=r"'w'.*FREE -> COMPUTE"):
        c.use("w")


def test_loading_weights_in_the_middle_of_backward_raises():
    """COMPUTE -> FREE: a gradient hook that loads new weights while a backward node still needs
    them would release a chunk in use; it raises, naming the tensor, and the model trains on."""
    model = _train(steps=1)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    w_chunk = _chunk_of(model, "w").index
    shard = model.master_shard(w_chunk).clone()
    model.module.probe = lambda grad: model.load_master_shard(w_chunk, shard)
    idx = torch.randint(0, 16, (2, 6))
    with pytest.raises(IllegalTransitionError, match=r"'w'.*COMPUTE -> FREE"):
        optim.backward(_loss(model, idx))
    model.module.probe = None
    optim.zero_grad()
    optim.backward(_loss(model, idx))
    assert optim.step()
