"""Note [suspended access mode] (``torch_backend/zero/runtime.py``): in a forward where nothing is
released before its end, the access mode comes off the stack once every sharded chunk is gathered,
and every sharded chunk is held until it is back. One rank with the parameters offloaded has sharded
chunks (gathered on use, released after), as at W >= 2.

The mutants these tests catch: taking the mode off while some chunk is still released (its
parameters read NaN placeholders: the losses differ), not holding the chunks while it is off (a
release inside the forward frees a buffer the rest of the forward reads), and never taking it off.
The last two tests hold Note [gradients in the buffer] (``torch_backend/zero/chunk_gradient.py``) on the same
sharded chunks: views left in ``.grad`` after a backward, a replaced view added instead of copied."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from mode_cases import inputs, mode_on, reference, train
from torch import nn

from chunkzero.errors import ConfigError
from torch_backend import ZeroDDP


class _Probe(nn.Module):
    """No parameters; records whether the access mode is on while it runs, and may run ``during``."""

    def __init__(self):
        super().__init__()
        self.mode_on: list[bool] = []
        self.during = None

    def forward(self, h):
        self.mode_on.append(mode_on())
        if self.during is not None:
            self.during()
        return h


class _Cross(nn.Module):
    """Three linears in three chunks (``chunk_size=72``); after the probe the first and second ones are
    used again, the first through its weight alone (no submodule call)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.probe = _Probe()

    def forward(self, x):
        h = self.c(self.b(self.a(x).relu()).relu())
        h = self.probe(h)
        return F.linear(h, self.a.weight) + self.b(h)


@pytest.mark.parametrize("chunk_size", [72, None], ids=["three-chunks-kept", "one-chunk"])
def test_mode_off_once_every_chunk_is_gathered_and_exact(chunk_size):
    """Three chunks kept into the backward (``reshard_after_forward=False``): the mode goes off at the
    probe, where all three are gathered; one chunk (the searched size): off from the step after the
    first (the backward's prefetched chunk is then known to be all of them). Losses and values equal
    plain torch's exactly."""
    net, xs = _Cross(), inputs()
    want_losses, want_state = reference(net, xs)
    kw = dict(chunk_size=72, reshard_after_forward=False) if chunk_size else {}
    model = ZeroDDP(net, offload_param_frac=1.0, **kw)
    assert len(model._runtime._sharded) == (3 if chunk_size else 1)
    assert train(model, xs) == want_losses
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want_state[k], rtol=1e-5, atol=1e-6)  # AdamW: flat vs per tensor
    assert net.probe.mode_on[-2:] == [False, False], net.probe.mode_on  # it did go off
    assert mode_on() is False  # and is off the stack after the forward too (not left behind)


def test_mode_stays_on_while_a_chunk_is_released():
    """Released after use (the default), three chunks are never all gathered: the mode stays on and the
    result is the same."""
    net, xs = _Cross(), inputs(3)
    want_losses, _ = reference(net, xs)
    model = ZeroDDP(net, offload_param_frac=1.0, chunk_size=72)
    assert train(model, xs) == want_losses
    assert net.probe.mode_on == [True, True, True]


def test_chunks_are_held_while_the_mode_is_off():
    """A release asked for while the mode is off (as a nested backward's end would) frees nothing: the
    rest of the forward reads the gathered values; an update of a chunk's values raises."""
    net, xs = _Cross(), inputs(3)
    want_losses, _ = reference(net, xs)
    model = ZeroDDP(net, offload_param_frac=1.0, chunk_size=72, reshard_after_forward=False)
    freed = []

    def release_all():
        freed.extend(c.release() for c in model.chunks)

    net.probe.during = release_all
    assert train(model, xs) == want_losses
    assert freed == [False] * 9

    def refresh():
        model.chunks[0].refresh_from_master()

    net.probe.during = refresh
    with pytest.raises(ConfigError, match="inside ZeroDDP's forward"):
        model(xs[0])
    net.probe.during = None
    assert not any(c._held for c in model.chunks)  # the mode came back when the forward raised
    assert mode_on() is False


def _torch_grads(net, xs) -> torch.Tensor:
    """Plain torch's ``.grad`` of a copy of ``net`` after one backward per input, flat in parameter order."""
    ref = copy.deepcopy(net)
    for x in xs:
        ref(x).square().mean().backward()
    return torch.cat([p.grad.reshape(-1) for p in ref.parameters()])


def test_gradients_land_in_the_buffer_and_leave_grad_after_backward():
    """Note [gradients in the buffer]: three micro-batches (two under ``no_sync``) accumulate exactly
    as plain torch's ``.grad`` does, and after each backward ``.grad`` holds the placeholder, never a
    view of a chunk's gradient buffer (the mutant that leaves the views there fails the type check;
    one that adds a landed gradient a second time fails the values)."""
    from torch_backend.zero.chunk_gradient import ShardedGradPlaceholder

    net, xs = _Cross(), inputs(3)
    want = _torch_grads(net, xs)
    model = ZeroDDP(net, offload_param_frac=1.0, chunk_size=72)
    with model.no_sync():
        for x in xs[:2]:
            model.backward(model(x).square().mean())
            assert all(type(p.grad) is ShardedGradPlaceholder for p in net.parameters())
    model.backward(model(xs[2]).square().mean())
    assert all(type(p.grad) is ShardedGradPlaceholder for p in net.parameters())
    got = torch.cat([model.grad_shard(c.index)[: c.valid_numel] for c in model.chunks])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_backwards_accumulate_once():
    """``create_graph`` backwards under ``no_sync``: AccumulateGrad then replaces a lent view by the
    sum of the view and the new gradient, which is copied into the buffer, not added (the mutant that
    adds it counts the earlier backwards' gradients twice)."""
    net, xs = _Cross(), inputs(3)
    want = _torch_grads(net, xs)
    model = ZeroDDP(net, offload_param_frac=1.0, chunk_size=72)
    with model.no_sync():
        for x in xs[:2]:
            model(x).square().mean().backward(create_graph=True)
    model.backward(model(xs[2]).square().mean())
    got = torch.cat([model.grad_shard(c.index)[: c.valid_numel] for c in model.chunks])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
