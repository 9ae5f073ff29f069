"""In-process ZeroEMA checks (W = 1, no process group): the swap and its restore on an exception, no
update on a skipped fp16 step (with the mutant that updates anyway), the warm-up, bad input."""

import math

import pytest
import torch
import zero_cases

from chunkzero.errors import ConfigError
from torch_backend import ZeroDDP, ZeroEMA, ZeroOptimizer


def _build(mixed_precision="fp32", ema_cls=ZeroEMA, **ema_kwargs):
    module = zero_cases.Odd()  # a frozen layer, an embedding, keep-gathered LayerNorm
    model = ZeroDDP(module, chunk_size=100, mixed_precision=mixed_precision, keep_gathered=["ln.weight", "ln.bias"])
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6, initial_scale=8.0)
    return model, optim, ema_cls(optim, **{"decay": 0.9, **ema_kwargs})


def _step(model, optim, batch, scale=1.0):
    optim.backward(zero_cases.odd_loss(model, batch) * scale)
    applied = optim.step()
    optim.zero_grad()
    return applied


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _shards(ema):
    return {i: b.clone() for i, b in ema.shards.items()}


def test_ema_weights_restores_the_live_weights_after_an_exception():
    """Inside the block the model computes with the EMA; an exception inside it leaves the live
    weights (masters, low-precision shards, outputs) exactly as before, and the EMA unchanged."""
    model, optim, ema = _build("bf16")
    data = zero_cases.batches("odd", 3, 4)
    for b in data:
        assert _step(model, optim, b)
    x = data[0][0]
    live, shards = _weights(model), _shards(ema)
    with torch.no_grad():
        out_live = model(x).clone()
    seen = {}
    with pytest.raises(RuntimeError, match="evaluation failed"):
        with ema.ema_weights():
            seen = _weights(model)
            with torch.no_grad():
                out_ema = model(x).clone()
            raise RuntimeError("evaluation failed")
    assert any(not torch.equal(seen[k], live[k]) for k in live)  # the EMA was in the live shards
    assert not torch.equal(out_ema, out_live)
    after = _weights(model)
    assert all(torch.equal(after[k], live[k]) for k in live)
    assert all(torch.equal(ema.shards[i], shards[i]) for i in shards)
    with torch.no_grad():
        assert torch.equal(model(x), out_live)  # the bf16 shards were refreshed back too
    with ema.ema_weights():  # and the EMA is still what the first block saw
        assert all(torch.equal(v, seen[k]) for k, v in model.state_dict().items())


def test_step_inside_ema_weights_is_refused_and_blocks_do_not_nest():
    model, optim, ema = _build()
    batch = zero_cases.batches("odd", 1, 4)[0]
    live = _weights(model)
    with ema.ema_weights():
        with pytest.raises(ConfigError, match="already active"):
            with ema.ema_weights():
                pass
        optim.backward(zero_cases.odd_loss(model, batch))
        with pytest.raises(ConfigError, match="inside ZeroEMA.ema_weights"):
            optim.step()
        optim.zero_grad()
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())


class _UpdatesOnEveryStep(ZeroEMA):
    """The mutant: updates after every step() call, a skipped one included."""

    def _after_step(self, optimizer, args, kwargs):  # noqa: ARG002 - overrides ZeroEMA._after_step
        self.update()


@pytest.mark.parametrize("ema_cls, should_hold", [(ZeroEMA, True), (_UpdatesOnEveryStep, False)])
def test_skipped_fp16_step_leaves_the_ema_alone(ema_cls, should_hold):
    """An fp16 step skipped for an overflow changes neither the EMA nor its update count;
    the mutant that updates on every step() call fails the same check."""
    model, optim, ema = _build("fp16", ema_cls=ema_cls)
    data = zero_cases.batches("odd", 3, 4)
    assert _step(model, optim, data[0])
    shards, count = _shards(ema), ema.update_count
    assert not _step(model, optim, data[1], scale=math.inf)  # inf loss -> non-finite gradients: skipped
    held = ema.update_count == count and all(torch.equal(ema.shards[i], shards[i]) for i in shards)
    assert held is should_hold
    assert _step(model, optim, data[2])
    assert ema.update_count == count + (1 if should_hold else 2)


def test_warmup_follows_its_formula():
    """warmup=True: the n-th update uses min(decay, (1 + n) / (10 + n)); checked against the formula
    on the masters themselves (same kernel: torch.lerp)."""
    model, optim, ema = _build(decay=0.5, warmup=True)
    assert [round(ema.current_decay(), 6)] == [0.1]
    want = {i: b.clone() for i, b in ema.shards.items()}
    for n, b in enumerate(zero_cases.batches("odd", 12, 4)):
        assert _step(model, optim, b)
        d = min(0.5, (1 + n) / (10 + n))
        for i in want:
            want[i].lerp_(model.chunks[i].master.detach(), 1 - d)
    assert ema.update_count == 12 and ema.current_decay() == 0.5
    assert all(torch.equal(ema.shards[i], want[i]) for i in want)


def test_bad_input_is_refused():
    model, optim, ema = _build()
    with pytest.raises(ConfigError, match="has an EMA already"):
        ZeroEMA(optim, 0.9)
    with pytest.raises(ConfigError, match="needs a ZeroOptimizer"):
        ZeroEMA(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 0.9)
    ema.remove()
    assert optim.ema is None
    for bad in (1.0, -0.1, "0.9", True):
        with pytest.raises(ConfigError, match="decay"):
            ZeroEMA(optim, bad)
    assert optim.ema is None
    ZeroEMA(optim, 0.5)  # a new one may replace a removed one
