"""Note [recorded units] (``torch_backend/zero/units.py``): a submodule whose parameters lie in one
chunk, and whose recorded forward read tensors of that chunk only, runs as a unit from then on: its
chunk gathered and held before the call, the access mode off inside it. One rank with the
parameters offloaded has sharded chunks (gathered on use, released after), as at W >= 2.

The mutants these tests catch: never making units (the mode stays on inside the blocks), making a
unit of a module that reads another chunk (that chunk is released there: its parameter reads NaN, the
losses differ), and not holding a unit's chunk (a release inside it frees what the rest reads)."""

from __future__ import annotations

import pytest
import torch
from mode_cases import assert_losses_match, inputs, mode_on, reference, train
from torch import nn

from torch_backend import ZeroDDP
from torch_backend.zero.units import UnitRecorder


class _Block(nn.Module):
    """One ``Linear(8, 8)`` (72 elements: one chunk at ``chunk_size=72``) and a probe of the access mode;
    with ``reads``, it also reads that other linear's weight (not a submodule of it), with no gradient:
    its backward needs no saved parameter, so that chunk is not kept for the backward either."""

    def __init__(self, reads: nn.Linear | None = None):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        object.__setattr__(self, "reads", reads)
        self.mode_on: list[bool] = []
        self.during = None

    def forward(self, h):
        self.mode_on.append(mode_on())
        if self.during is not None:
            self.during()
        h = self.lin(h).relu()
        if self.reads is not None:
            h = h + self.reads.weight.mean().detach()
        return h


class _Net(nn.Module):
    """Three blocks in three chunks; with ``cross``, the last block reads the first block's weight."""

    def __init__(self, cross: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = _Block()
        self.b = _Block()
        self.c = _Block(reads=self.a.lin if cross else None)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _zero(net: nn.Module, xs: list[torch.Tensor]) -> tuple[ZeroDDP, list[float]]:
    model = ZeroDDP(net, offload_param_frac=1.0, chunk_size=72)
    assert len(model._runtime._sharded) == 3
    return model, train(model, xs)


def test_blocks_that_read_their_own_chunk_become_units_and_stay_exact():
    """After the recorded first forward each block is a unit: the mode is off inside it; the losses
    equal plain torch's exactly."""
    net, xs = _Net(), inputs(4)
    want, _ = reference(net, xs)
    model, losses = _zero(net, xs)
    assert_losses_match(losses, want)
    for block in (net.a, net.b, net.c):
        assert block.mode_on == [True, False, False, False], block.mode_on
    assert set(model._runtime._units) == {id(net.a), id(net.b), id(net.c)}  # the outermost: not the linears


def test_a_block_that_reads_another_chunk_stays_under_the_mode(monkeypatch):
    """The last block reads the first block's weight, whose chunk is released by then: it stays under
    the mode, which gathers that chunk again, and the losses equal plain torch's. Made a unit anyway
    (the recording blinded), it reads the released weight's NaN."""
    net, xs = _Net(cross=True), inputs(4)
    want, _ = reference(net, xs)
    _, losses = _zero(net, xs)
    assert_losses_match(losses, want)
    assert net.c.mode_on == [True] * 4
    assert net.a.mode_on == [True, False, False, False]

    monkeypatch.setattr(UnitRecorder, "touch", lambda self, chunk_index: None)
    _, blind = _zero(_Net(cross=True), xs)
    assert any(v != v for v in blind[1:]), blind  # NaN after the recorded forward


def test_a_units_chunk_is_held_while_it_runs():
    """A release asked for inside a unit (as a nested backward's end would) frees nothing: the rest of
    the block reads its gathered weight."""
    net, xs = _Net(), inputs(3)
    want, _ = reference(net, xs)
    freed = []
    holder: list[ZeroDDP] = []
    net.b.during = lambda: freed.append(holder[0].chunks[1].release()) if holder else None
    model = ZeroDDP(net, offload_param_frac=1.0, chunk_size=72)
    holder.append(model)
    assert_losses_match(train(model, xs), want)
    assert freed[1:] == [False, False], freed  # (the first forward is recorded under the mode)
    assert not any(c._held for c in model.chunks)


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_the_first_forward_that_raises_decides_nothing(grad):
    """A forward that raises is not a recording: no unit is chosen from it, and the next forward records."""
    net, xs = _Net(), inputs(2)
    model = ZeroDDP(net, offload_param_frac=1.0, chunk_size=72)

    def fail():
        raise RuntimeError("boom")

    net.c.during = fail
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="boom"):
        model(xs[0])
    assert model._runtime._units == {}
    net.c.during = None
    with torch.set_grad_enabled(grad):
        model(xs[1])
    assert set(model._runtime._units) == {id(net.a), id(net.b), id(net.c)}


class _HandsOutAlias(nn.Module):
    """A linear that also returns its weight detached (an alias of its chunk's buffer, no ``_base``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h):
        return self.lin(h), self.lin.weight.detach()


class _AliasNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = _HandsOutAlias(), _Block()

    def forward(self, x):
        h, alias = self.a(x)
        return self.b(h) * alias.mean()  # read after `a` returned and `b` ran


def test_a_module_that_hands_out_a_detached_parameter_is_no_unit():
    """Its alias outlives the call, so its chunk must stay gathered to the forward's end, which a unit's
    release at its return would not do (the alias would read freed memory); it stays under the mode."""
    net, xs = _AliasNet(), inputs(3)
    want, _ = reference(net, xs)
    model = ZeroDDP(net, offload_param_frac=1.0, chunk_size=72)
    assert_losses_match(train(model, xs), want)
    assert id(net.a) not in model._runtime._units and id(net.b) in model._runtime._units
