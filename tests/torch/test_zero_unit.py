"""In-process checks of ZeroDDP / ZeroOptimizer pieces that need no process group (fast)."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import zero_cases

from chunkzero.errors import ConfigError, ShapeMismatchError, UnusedParameterError
from torch_backend import DynamicLossScaler, ZeroDDP, ZeroOptimizer
from torch_backend.zero import collectives


def test_collectives_use_the_current_names():
    """torch 2.13 renamed the flat collectives; the old names warn, so the new ones are picked."""
    if hasattr(dist, "all_gather_single"):
        assert collectives._ALL_GATHER_FLAT is dist.all_gather_single
        assert collectives._REDUCE_SCATTER_FLAT is dist.reduce_scatter_single
    else:
        assert collectives._ALL_GATHER_FLAT is dist.all_gather_into_tensor
    assert collectives.default_backend("cpu") == "gloo"
    assert collectives.default_backend("cuda:0") == "nccl"


class _FakeWork:
    """A collective's work handle that completes after ``polls`` calls of ``is_completed`` (never: ``None``)."""

    def __init__(self, polls, error=None):
        self.polls, self.error, self.asked, self.waited = polls, error, 0, 0

    def is_completed(self):
        self.asked += 1
        if self.asked > 100_000:
            raise AssertionError("polled past HOST_SPIN_S")
        return self.polls is not None and self.asked >= self.polls

    def wait(self):
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


def test_a_host_wait_polls_then_waits_once(monkeypatch):
    """Note [spin, then block]: the work is polled until done, then waited for once (the wait raises)."""
    monkeypatch.setattr(collectives, "HOST_SPIN_S", 60.0)  # (a loaded machine must not end the polls first)
    work = _FakeWork(polls=5)
    collectives.wait_on_host(work)
    assert (work.asked, work.waited) == (5, 1)
    failed = _FakeWork(polls=1, error=RuntimeError("peer closed"))
    with pytest.raises(RuntimeError, match="peer closed"):
        collectives.Pending(failed).wait()
    assert failed.waited == 1


def test_a_host_wait_stops_polling_after_its_budget(monkeypatch):
    """A work that never completes is polled for HOST_SPIN_S only, then blocked on (where the process
    group's timeout applies): never a spin without end."""
    monkeypatch.setattr(collectives, "HOST_SPIN_S", 0.0)
    work = _FakeWork(polls=None)
    collectives.wait_on_host(work)
    assert work.asked <= 1 and work.waited == 1
    monkeypatch.setattr(collectives, "HOST_SPIN_S", 0.005)
    work = _FakeWork(polls=None)
    collectives.wait_on_host(work)
    assert work.asked >= 1 and work.waited == 1


def test_single_process_without_process_group_matches_torch():
    """No torch.distributed init: W=1, every chunk resident; 3 Adam steps equal plain torch exactly.

    Both sides run torch's fused Adam kernel (ZeroOptimizer's default): bitwise equality holds only
    for the same kernel on the same data (fused and foreach round differently on some CPUs)."""
    module = zero_cases.Odd()
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=100, keep_gathered=["ln.weight", "ln.bias"])
    assert model.world_size == 1 and model.rank == 0 and model.process_group is None
    optim = ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, eps=1e-6)
    assert optim.param_groups[0]["fused"] is True
    ropt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=1e-6, fused=True)
    for batch in zero_cases.batches("odd", 3, 4):
        loss = zero_cases.odd_loss(model, batch)
        optim.backward(loss)
        assert optim.step()
        optim.zero_grad()
        rloss = zero_cases.odd_loss(ref, batch)
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        assert loss.item() == rloss.item()
    zero_cases.assert_state_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0)
    # parameters keep their shapes and are the module's own objects
    assert model.module.w.shape == (8, 8) and model.module.a.weight.dtype == torch.float32


def test_unused_parameter_error_names_it_single_process():
    model = ZeroDDP(zero_cases.Odd(with_unused=True), chunk_size=100)
    optim = ZeroOptimizer(model, torch.optim.SGD, lr=0.1)
    (batch,) = zero_cases.batches("odd", 1, 2)
    # raised right after the backward by optim.backward; never from inside the autograd engine
    with pytest.raises(UnusedParameterError, match=r"pass: unused\."):
        optim.backward(zero_cases.odd_loss(model, batch))
    # after a plain backward it is raised by the next forward (or step), once
    zero_cases.odd_loss(model, batch).backward()
    with pytest.raises(UnusedParameterError):
        zero_cases.odd_loss(model, batch)
    # the model is usable afterwards: no illegal transition, nothing left gathered
    model.raise_pending_error()
    assert model.gathered_chunks() == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mixed_precision="fp8"),
        dict(chunk_size=0),
        dict(chunk_size=2.5),
        dict(offload_optim_frac=1.5),
        dict(offload_param_frac=-0.1),
        dict(keep_gathered=3),
    ],
)
def test_bad_arguments_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        ZeroDDP(zero_cases.Odd(), **kwargs)


def test_bad_inputs():
    with pytest.raises(ConfigError):
        ZeroDDP("not a module")
    with pytest.raises(ConfigError, match="no parameters"):
        ZeroDDP(torch.nn.ReLU())
    # wrapping twice (accepted before, then a traceback at the first backward)
    inner = ZeroDDP(zero_cases.Odd(), chunk_size=100)
    with pytest.raises(ConfigError, match="the module is a ZeroDDP already"):
        ZeroDDP(inner)
    with pytest.raises(ConfigError, match="submodule 'body' is a ZeroDDP already"):
        ZeroDDP(torch.nn.ModuleDict({"body": inner}))
    with pytest.raises(ConfigError):
        ZeroOptimizer(zero_cases.Odd())
    model = ZeroDDP(zero_cases.Odd(), chunk_size=100)
    with pytest.raises(ConfigError, match="max_norm"):
        ZeroOptimizer(model, max_norm=-1.0)
    with pytest.raises(ShapeMismatchError, match="chunk 0"):
        model.load_master_shard(0, torch.zeros(3))
    optim = ZeroOptimizer(model, lr=1e-3)
    frozen = next(c.index for c in model.chunks if not c.requires_grad)
    with pytest.raises(ConfigError, match="frozen"):
        optim.shard_state(frozen)
    # a loss of several elements is refused as loss.backward() refuses it (not silently summed)
    idx, _ = zero_cases.batches("odd", 1, 2)[0]
    with pytest.raises(ShapeMismatchError, match="scalar loss"):
        optim.backward(model(idx))


def test_loss_scaler_hysteresis_and_growth():
    s = DynamicLossScaler(2.0**4, growth_interval=2, hysteresis=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 16.0  # hysteresis 2: first overflow tolerated
    s.update(True)
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 4.0  # stays in back-off until a growth refills the hysteresis
    s.update(False)
    s.update(False)
    assert s.scale == 8.0 and s.hysteresis_tracker == 2
    one = DynamicLossScaler(2.0**4, hysteresis=1, min_scale=4.0)
    for expect in (8.0, 4.0, 4.0):
        one.update(True)
        assert one.scale == expect
    restored = DynamicLossScaler()
    restored.load_state_dict(one.state_dict())
    assert restored.state_dict() == one.state_dict()
    with pytest.raises(ConfigError):
        DynamicLossScaler(hysteresis=0)


def test_bf16_single_process_and_memory_report():
    module = zero_cases.tiny_gpt2()
    model = ZeroDDP(module, chunk_size=1500, mixed_precision="bf16", offload_optim_frac=0.3)
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3)
    batch = zero_cases.batches("gpt2", 1, 2)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        loss = zero_cases.gpt2_loss(model, batch)
    optim.backward(loss)
    assert optim.step()
    report = optim.memory_report()
    kinds = report.bytes["cpu"]
    assert kinds["optimizer_states"] > 0 and kinds["fp32_master"] > 0 and kinds["gradients"] > 0
    assert len(report.offload_optim_chunks) == -(-len(model.chunks) * 3 // 10)
    assert "optimizer_states" in str(report)
    optim.zero_grad()
    assert model.memory_report().total("gradients") == 0


class FrozenMix(torch.nn.Module):
    """Frozen layers of three kinds before a trainable head: an fp32 Linear, a Linear that arrives
    in bf16, and an fp32 LayerNorm (packed keep-gathered by the tests)."""

    def __init__(self, shift: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.fp32 = torch.nn.Linear(8, 8)
        self.bf16 = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.ln = torch.nn.LayerNorm(8)
        torch.nn.init.normal_(self.ln.weight)
        self.head = torch.nn.Linear(8, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(shift)
        for m in (self.fp32, self.bf16, self.ln):
            m.requires_grad_(False)

    def forward(self, x):
        return self.head(self.ln(torch.tanh(self.bf16(torch.tanh(self.fp32(x)))))).squeeze(-1)


def _frozen_bits(sd, module) -> dict[str, torch.Tensor]:
    return {n: sd[n].view(torch.int32) for n, p in module.named_parameters() if not p.requires_grad}


def test_frozen_tensors_keep_their_dtype_single_process():
    """W=1, bf16 compute: frozen chunks are stored in their own dtype (fp32, bf16; the keep-gathered
    one whole, with its bf16 compute copy beside it), compute as a bf16 copy of the module does, and
    come back bit for bit after AdamW steps and a load_state_dict; a bf16 frozen tensor costs 2 bytes
    per element in memory_report also under fp32 compute (no upcast)."""
    module = FrozenMix()
    want = {
        n: p.detach().float().view(torch.int32).clone() for n, p in module.named_parameters() if not p.requires_grad
    }
    ref = copy.deepcopy(module).to(torch.bfloat16)
    model = ZeroDDP(module, chunk_size=100, mixed_precision="bf16", keep_gathered=["ln.weight", "ln.bias"])
    dtypes = {t.name: model.layout.chunks[t.chunk].dtype for t in model.layout.tensors}
    assert dtypes == {
        "fp32.weight": "float32",
        "fp32.bias": "float32",
        "bf16.weight": "bfloat16",
        "bf16.bias": "bfloat16",
        "ln.weight": "float32",
        "ln.bias": "float32",
        "head.weight": "bfloat16",
        "head.bias": "bfloat16",
    }
    assert len({model.layout.tensor(n).chunk for n in ("fp32.weight", "bf16.weight", "ln.weight")}) == 3
    report = model.memory_report()
    assert report.frozen_parameters == {"cpu": {"float32": 72 * 4 + 16 * 4, "bfloat16": 72 * 2 + 16 * 2}}, (
        report.frozen_parameters
    )
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), ref(x.to(torch.bfloat16)))  # the gathers cast the stored values

    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    for _ in range(3):
        optim.backward(model(x).float().square().mean())
        assert optim.step()
        optim.zero_grad()
    sd = model.state_dict()
    assert all(torch.equal(v, want[n]) for n, v in _frozen_bits(sd, module).items())

    shifted = FrozenMix(shift=0.25)
    model.load_state_dict(shifted.state_dict())
    got = _frozen_bits(model.state_dict(), module)
    assert all(torch.equal(v, shifted.state_dict()[n].float().view(torch.int32)) for n, v in got.items())
    torch.testing.assert_close(model(x), copy.deepcopy(shifted).to(torch.bfloat16)(x.to(torch.bfloat16)))

    fp32 = ZeroDDP(FrozenMix(), chunk_size=100)
    assert fp32.memory_report().frozen_total("bfloat16") == 72 * 2
    assert fp32.chunks[fp32.layout.tensor("bf16.weight").chunk].shard.dtype == torch.bfloat16
    torch.testing.assert_close(fp32(x), FrozenMix().float()(x))
