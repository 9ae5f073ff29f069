"""``ZeroDDP(placement="auto")``: the warm-up tracer, re-tracing, applying the plan, and its errors."""

import copy

import placement_cases
import pytest
import torch
from torch import nn

from chunkzero.errors import ConfigError, PlacementBudgetError
from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend._testing import run_distributed
from torch_backend.zero.placement import DEFAULT_STEADY_DEVICE_CAP_RATIO, device_memory_bytes


def _saved_storage_bytes(out: torch.Tensor, params) -> int:
    """Independent count: walk ``out``'s autograd graph and sum the distinct storages of the tensors
    its nodes saved (``_saved_*`` attributes), parameters excluded."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen, stack, found = set(), [out.grad_fn], {}
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                value = getattr(fn, name)
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in param_storages:
                        found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(f for f, _ in fn.next_functions)
    return sum(found.values())


def test_tracer_records_the_saved_activation_bytes_at_each_access():
    """A chain of Linear+Tanh layers, one chunk each: at the forward access of layer i the saved
    activations alive are those the plain module's graph holds after layers < i (independent count
    by walking its nodes' saved tensors); in backward, the nodes after layer i have freed theirs, so
    the same bytes are alive again. Layer 0 is not accessed in backward (its input needs no gradient)."""
    d, n_layers = 8, 4
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(n_layers) for m in (nn.Linear(d, d), nn.Tanh())])
    plain = copy.deepcopy(net)
    x = torch.randn(5, d)
    want = [0] + [_saved_storage_bytes(plain[: 2 * i](x), list(plain.parameters())) for i in range(1, n_layers)]
    assert want[1] > 0 and want == sorted(want)
    model = ZeroDDP(net, chunk_size=d * d + d, placement="auto")
    model(x).sum().backward()
    trace = model.auto_placement.trace
    assert trace.access_order == (0, 1, 2, 3, 3, 2, 1) and trace.forward_accesses == n_layers
    assert list(trace.non_model_bytes) == want + want[:0:-1]
    # transient: the accessed chunk's gathered buffer at least, gradient buffers in backward
    chunk_bytes = (d * d + d) * 4
    assert all(b >= chunk_bytes for b in trace.transient_bytes)
    assert max(trace.transient_bytes[n_layers:]) > max(trace.transient_bytes[:n_layers])


class _Chain(nn.Module):
    """Linear+Tanh layers (one chunk each at ``chunk_size=d*d+d``) that can run in reverse order."""

    def __init__(self, d: int = 8, n_layers: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))

    def forward(self, x, reverse: bool = False):
        for layer in reversed(self.layers) if reverse else self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def test_retraces_when_the_access_order_changes():
    """Layers run in reverse from step 3: that step leaves the plan at its first access (not the
    recorded order) and the next step is traced again; the new plan is over the new order, and the
    steps after it follow it to the end."""
    model = ZeroDDP(_Chain(), chunk_size=8 * 8 + 8, placement="auto")
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, eps=1e-6)
    ap = model.auto_placement
    x = torch.randn(5, 8, requires_grad=True)  # so that layer 0 is accessed in backward too

    def step(reverse):
        optim.backward(model(x, reverse=reverse))
        optim.step()
        optim.zero_grad()

    step(False)
    first = ap.trace
    assert first.access_order == (0, 1, 2, 3, 3, 2, 1, 0)
    step(False)
    assert ap.traces == 1 and ap._step_done
    step(True)
    assert ap.traces == 1 and not ap._step_done
    step(True)  # traced
    assert ap.traces == 2 and ap.trace.access_order == (3, 2, 1, 0, 0, 1, 2, 3)
    step(True)
    step(True)
    assert ap.plan is not None and ap._step_done and ap.traces == 2


@pytest.mark.parametrize("world", [1, 2, 3])
def test_auto_at_half_the_model_state_trains_as_no_offload_and_moves_less_than_static(world):
    results = run_distributed(placement_cases.worker_half_budget, world, timeout=300)
    for r in results:
        assert 0 < r["auto"] < r["static"]


def test_budget_too_small_names_both_numbers():
    """After the warm-up step a budget below one access's chunk plus its non-model memory is refused
    by the next forward, naming the budget and the bytes needed; a larger budget then trains."""
    model = ZeroDDP(placement_cases.base_model(), chunk_size=placement_cases.CHUNK_SIZE, placement="auto",
                    device_memory_bytes=1000, steady_device_cap_ratio=1.0)
    batch = placement_cases.batches(0, 1)[0]
    placement_cases.loss_of(model, batch).backward()  # the warm-up step runs with every chunk on the host
    trace = model.auto_placement.trace
    need = max(model.auto_placement.chunk_bytes[c] + a + b
               for c, a, b in zip(trace.access_order, trace.non_model_bytes, trace.transient_bytes))
    with pytest.raises(PlacementBudgetError) as err:
        placement_cases.loss_of(model, batch)
    assert err.value.budget_bytes == 1000 and err.value.chunk_bytes + err.value.non_model_bytes == need
    assert "1000 bytes" in str(err.value) and f"{need} bytes in all" in str(err.value)
    model.auto_placement.budget_bytes = need
    placement_cases.loss_of(model, batch).backward()
    assert model.auto_placement.plan.budget_bytes == need


def test_default_budget_and_bad_arguments():
    module = placement_cases.base_model()
    model = ZeroDDP(copy.deepcopy(module), chunk_size=placement_cases.CHUNK_SIZE, placement="auto")
    assert model.auto_placement.budget_bytes == int(
        device_memory_bytes(torch.device("cpu")) * DEFAULT_STEADY_DEVICE_CAP_RATIO
    )
    assert model.offload_param_chunks == tuple(range(len(model.chunks)))  # the warm-up starts on the host
    assert ZeroDDP(copy.deepcopy(module), chunk_size=4000).auto_placement is None
    for kwargs, name in [(dict(placement="gemini"), "placement"),
                         (dict(placement="auto", offload_optim_frac=0.5), "offload_optim_frac"),
                         (dict(placement="auto", offload_param_frac=0.5), "offload_param_frac"),
                         (dict(device_memory_bytes=10**9), "device_memory_bytes"),
                         (dict(steady_device_cap_ratio=0.5), "steady_device_cap_ratio"),
                         (dict(placement="auto", device_memory_bytes=0), "device_memory_bytes"),
                         (dict(placement="auto", device_memory_bytes=2.5e9), "device_memory_bytes"),
                         (dict(placement="auto", steady_device_cap_ratio=0.0), "steady_device_cap_ratio"),
                         (dict(placement="auto", steady_device_cap_ratio=1.5), "steady_device_cap_ratio")]:
        with pytest.raises(ConfigError, match=name):
            ZeroDDP(copy.deepcopy(module), chunk_size=4000, **kwargs)
    with pytest.raises(ConfigError, match="budget_bytes"):
        model.auto_placement.budget_bytes = -1
    with pytest.raises(ConfigError, match="traced step"):
        model.auto_placement.budget_for_fraction(0.5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_auto_trains_as_static(precision):
    """bf16 / fp16 (a persistent low-precision shard refreshed from the master, moved under ``auto``)
    at 30% of the model data: the same casts as static placement, so the same values exactly."""
    base, data = placement_cases.base_model(), placement_cases.batches(0, 4)
    static, _, _ = placement_cases.train(copy.deepcopy(base), data, mixed_precision=precision)
    auto, _, checks = placement_cases.train(copy.deepcopy(base), data, fraction=0.3, mixed_precision=precision,
                                            placement="auto")
    assert sum(auto.auto_placement.step_bytes_moved[2:]) > 0 and all(want == have for want, have in checks)
    sa, sb = static.state_dict(), auto.state_dict()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
