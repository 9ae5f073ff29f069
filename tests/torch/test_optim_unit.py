"""In-process checks of ZeroOptimizer as a torch optimizer (no process group, fast): bad param groups,
refused no-ops, add_param_group, hooks, a checkpoint round trip with a tensor that never had a gradient."""

import collections
import copy
import logging

import pytest
import torch
import zero_cases
from optim_cases import nanogpt_groups

from chunkzero.errors import CheckpointError, ConfigError
from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend.checkpoint.sharded import load_checkpoint, read_meta, save_checkpoint

ADAMW = dict(lr=1e-2, eps=1e-6)


def _train_odd(model, optim, batches) -> None:
    """A ZeroOptimizer step on each of ``batches`` of the ``Odd`` model."""
    for batch in batches:
        optim.backward(zero_cases.odd_loss(model, batch))
        optim.step()
        optim.zero_grad()


def _gpt2():
    module = zero_cases.tiny_gpt2()
    return module, ZeroDDP(module, chunk_size=1500)


def test_is_a_torch_optimizer_sharing_groups_and_state():
    module, model = _gpt2()
    optim = ZeroOptimizer(model, torch.optim.AdamW, param_groups=nanogpt_groups(module, 1e-3), lr=1e-3)
    assert isinstance(optim, torch.optim.Optimizer)
    assert optim.param_groups is optim.optimizer.param_groups and optim.state is optim.optimizer.state
    assert optim.defaults["lr"] == 1e-3 and [g["lr"] for g in optim.param_groups] == [1e-3, 5e-4]
    # every trainable tensor in exactly one group, the tied weight once
    names = [n for g in optim.group_names for n in g]
    assert sorted(names) == sorted({model.layout.tensor(n).name for n, _ in module.named_parameters()})
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "groups, match",
    [
        (
            lambda m: [{"params": [m.transformer.wte.weight]}, {"params": ["lm_head.weight"]}],
            "listed in param groups 0 and 1",
        ),
        (
            lambda m: [{"params": ["transformer.h.0.attn.c_attn.weigth"]}],
            "did you mean 'transformer.h.0.attn.c_attn.weight'",
        ),
        (lambda m: [{"params": [torch.nn.Parameter(torch.zeros(3))]}], "not a parameter of the ZeroDDP-wrapped module"),
        (lambda m: [{"params": {m.transformer.wpe.weight}}], "is a set"),
        (
            lambda m: [{"params": [m.transformer.wpe.weight], "weight_decy": 0.0}],
            "'weight_decy' is not a hyper-parameter",
        ),
        (lambda m: [{"weight_decay": 0.0}], "with a 'params' entry"),
        (lambda m: {"params": []}, "list of dicts"),
    ],
)
def test_bad_param_groups_name_the_fault(groups, match):
    module, model = _gpt2()
    with pytest.raises(ConfigError, match=match):
        ZeroOptimizer(model, torch.optim.AdamW, param_groups=groups(module), lr=1e-3)


def test_frozen_and_refused_optimizers():
    model = ZeroDDP(zero_cases.Odd(), chunk_size=100)
    with pytest.raises(ConfigError, match="'frozen.weight' is frozen"):
        ZeroOptimizer(model, torch.optim.AdamW, param_groups=[{"params": ["frozen.weight"]}])
    with pytest.raises(ConfigError, match="not elementwise"):
        ZeroOptimizer(model, torch.optim.Adafactor)
    with pytest.raises(ConfigError, match="unexpected keyword"):
        ZeroOptimizer(model, torch.optim.AdamW, lrr=1e-3)

    # a factory that builds its own groups (here: over the module's parameters) is refused
    def own_groups(groups, **kw):
        return torch.optim.AdamW([p for p in model.module.parameters() if p.requires_grad], **kw)

    with pytest.raises(ConfigError, match="built param groups of its own"):
        ZeroOptimizer(model, own_groups, lr=1e-3)
    # a factory that uses the groups it is given is fine
    optim = ZeroOptimizer(model, lambda groups, **kw: torch.optim.SGD(groups, momentum=0.9, **kw), lr=0.1)
    with pytest.raises(ConfigError, match="closure"):
        optim.step(lambda: 0.0)
    for call in (lambda: optim.optimizer.add_param_group({"params": []}), optim.optimizer.state_dict,
                 lambda: optim.optimizer.load_state_dict({})):
        with pytest.raises(ConfigError, match="call ZeroOptimizer"):
            call()


def test_add_param_group_moves_default_parameters_and_equals_torch():
    module = zero_cases.Odd()
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=100, keep_gathered=["ln.weight", "ln.bias"])
    optim = ZeroOptimizer(
        model, torch.optim.AdamW, param_groups=[{"params": ["w"], "lr": 3e-2}], weight_decay=0.1, **ADAMW
    )
    with pytest.raises(ConfigError, match="already belongs to param group 0"):
        optim.add_param_group({"params": [module.w]})
    # ZeroDDP's own named_parameters() names ("module." prefix) are accepted
    optim.add_param_group({"params": ["module.ln.weight", "module.ln.bias", module.a.bias], "weight_decay": 0.0})
    assert [len(n) for n in optim.group_names] == [1, len(optim.group_names[1]), 3]
    rest = [
        p for n, p in ref.named_parameters() if p.requires_grad and n not in ("w", "ln.weight", "ln.bias", "a.bias")
    ]
    ropt = torch.optim.AdamW([{"params": [ref.w], "lr": 3e-2}, {"params": rest},
                              {"params": [ref.ln.weight, ref.ln.bias, ref.a.bias], "weight_decay": 0.0}],
                             weight_decay=0.1, **ADAMW)
    for batch in zero_cases.batches("odd", 2, 4):
        optim.backward(zero_cases.odd_loss(model, batch))
        optim.step()
        optim.zero_grad()
        zero_cases.odd_loss(ref, batch).backward()
        ropt.step()
        ropt.zero_grad()
    zero_cases.assert_state_close(model.state_dict(), ref.state_dict(), rtol=1e-6, atol=1e-7)


def test_add_param_group_of_no_parameters_without_a_default_group():
    """As torch, an empty group may be added, also when every parameter already has a group."""
    module = zero_cases.Odd()
    model = ZeroDDP(module, chunk_size=100)
    optim = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        param_groups=[{"params": [p for p in module.parameters() if p.requires_grad]}],
        **ADAMW,
    )
    optim.add_param_group({"params": [], "lr": 0.5})
    assert [len(g["params"]) for g in optim.param_groups][1:] == [0] and optim.group_names[1] == []
    optim.backward(zero_cases.odd_loss(model, zero_cases.batches("odd", 1, 2)[0]))
    assert optim.step()
    optim.load_state_dict(optim.state_dict())


@pytest.mark.parametrize("spelling", ["model.parameters()", "model.module.parameters()", "group dicts", "positional"])
def test_params_takes_torchs_meaning(spelling):
    """``params=`` is torch's ``Optimizer(params)``: ``model.parameters()`` (frozen ones included, as
    torch skips them) or group dicts; 3 AdamW steps equal torch's fused AdamW on the same groups bitwise."""
    module = zero_cases.Odd()
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=100, keep_gathered=["ln.weight", "ln.bias"])
    if spelling == "group dicts":  # the frozen layer's weight in the no-decay group, as a torch user writes it
        decay = lambda m: [p for n, p in m.named_parameters() if p.dim() >= 2]  # noqa: E731
        rest = lambda m: [p for n, p in m.named_parameters() if p.dim() < 2]  # noqa: E731
        params = [
            {"params": decay(module), "weight_decay": 0.1},
            {"params": rest(module), "weight_decay": 0.0, "lr": 5e-3},
        ]
        ref_params = [
            {"params": decay(ref), "weight_decay": 0.1},
            {"params": rest(ref), "weight_decay": 0.0, "lr": 5e-3},
        ]
    else:
        params = model.parameters() if spelling == "model.parameters()" else model.module.parameters()
        ref_params = ref.parameters()
    if spelling == "positional":  # torch's own order: Optimizer(params, lr=...)
        optim = ZeroOptimizer(model, torch.optim.AdamW, model.parameters(), **ADAMW)
    else:
        optim = ZeroOptimizer(model, torch.optim.AdamW, params=params, **ADAMW)
    ropt = torch.optim.AdamW(ref_params, fused=True, **ADAMW)
    assert len(optim.param_groups) == len(ropt.param_groups)
    assert all(
        g["lr"] == r["lr"] and g["weight_decay"] == r["weight_decay"]
        for g, r in zip(optim.param_groups, ropt.param_groups)
    )
    assert "frozen.weight" not in {n for g in optim.group_names for n in g}
    for batch in zero_cases.batches("odd", 3, 4):
        optim.backward(zero_cases.odd_loss(model, batch))
        assert optim.step()
        optim.zero_grad()
        zero_cases.odd_loss(ref, batch).backward()
        ropt.step()
        ropt.zero_grad()
    zero_cases.assert_state_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "params, match",
    [
        (
            lambda m: [p for n, p in m.named_parameters() if n != "w"],
            r"leaves out trainable parameter\(s\) 'w'.*param_groups=",
        ),
        (lambda m: [{"params": [m.w]}, {"params": [m.head.weight]}], r"leaves out .*'emb.weight'.* and \d+ more"),
        (lambda m: {"params": list(m.parameters())}, "one dict.*param_groups="),
        (lambda m: [m.w, {"params": [m.a.weight]}], "mixes parameters and group dicts"),
        (lambda m: [], "params= is empty"),
        (lambda m: set(m.parameters()), "is a set"),
        (lambda m: [{"params": [m.w]}, {"params": [m.w]}], "listed in param groups 0 and 1"),
        (lambda m: [torch.nn.Parameter(torch.zeros(3))], "not a parameter of the ZeroDDP-wrapped module"),
        (lambda m: 3, "iterable of parameters or of group dicts"),
    ],
)
def test_bad_params_name_the_fault(params, match):
    """Bad ``params=`` raise a ConfigError naming the fault, never an engine error; leaving out a
    trainable parameter is refused (torch would never update it, while ZeroDDP reduces its gradient)."""
    module = zero_cases.Odd()
    model = ZeroDDP(module, chunk_size=100)
    with pytest.raises(ConfigError, match=match):
        ZeroOptimizer(model, torch.optim.AdamW, params=params(module), lr=1e-3)
    with pytest.raises(ConfigError, match="not both"):
        ZeroOptimizer(model, torch.optim.AdamW, params=module.parameters(), param_groups=[{"params": [module.w]}])


def test_step_and_state_dict_hooks_run():
    model = ZeroDDP(zero_cases.Odd(), chunk_size=100)
    optim = ZeroOptimizer(model, torch.optim.Adam, **ADAMW)
    calls = []
    optim.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    optim.register_step_post_hook(lambda o, a, k: calls.append("post"))
    optim.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    optim.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre"))
    optim.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    optim.backward(zero_cases.odd_loss(model, zero_cases.batches("odd", 1, 2)[0]))
    optim.step()
    sd = optim.state_dict()
    optim.load_state_dict(sd)
    assert calls == ["pre", "post", "load-pre", "load-post"] and sd["extra"] == 1


def test_checkpoint_keeps_a_never_stepped_tensor_without_state(tmp_path):
    """find_unused_parameters: ``unused`` never gets a gradient; after save/load its state stays absent
    and training continues exactly as without the round trip."""
    def build():
        model = ZeroDDP(zero_cases.Odd(with_unused=True), chunk_size=100, find_unused_parameters=True)
        return model, ZeroOptimizer(
            model,
            torch.optim.AdamW,
            max_norm=0.5,
            param_groups=[{"params": ["unused"], "lr": 0.3}],
            weight_decay=0.1,
            **ADAMW,
        )

    data = zero_cases.batches("odd", 3, 2)
    model, optim = build()
    _train_odd(model, optim, data[:2])
    optim.param_groups[1]["lr"] = 4e-3  # as a scheduler would
    save_checkpoint(tmp_path, model, optim, step=2)
    meta = read_meta(tmp_path, 2).optimizer
    assert meta.tensor_steps == {"unused": 0} and meta.hyperparameters["max_norm"] == 0.5
    assert [g["lr"] for g in meta.param_groups] == [0.3, 4e-3] and meta.param_groups[0]["params"] == ["unused"]
    from chunkzero.inspection import format_inspection, inspect_checkpoint

    text = format_inspection(inspect_checkpoint(tmp_path))
    assert "param group 0: 1 tensor(s), lr=0.3" in text and "param group 1:" in text and "unused=0" in text, text
    other, other_optim = build()
    other_optim.max_norm = None
    load_checkpoint(tmp_path, other, other_optim)
    assert other_optim.max_norm == 0.5 and [g["lr"] for g in other_optim.param_groups] == [0.3, 4e-3]
    assert other_optim.tensor_steps() == optim.tensor_steps() and "unused" not in other_optim.state_dict()["state"]
    for m, o in ((model, optim), (other, other_optim)):
        o.backward(zero_cases.odd_loss(m, data[2]))
        o.step()
    # bitwise: the same engine and kernels step the restored state on the same batch
    zero_cases.assert_state_close(other.state_dict(), model.state_dict(), rtol=0, atol=0)

    # groups of other tensors are refused before anything is loaded (or kept with load_hyperparameters=False)
    model3 = ZeroDDP(zero_cases.Odd(with_unused=True), chunk_size=100, find_unused_parameters=True)
    optim3 = ZeroOptimizer(model3, torch.optim.AdamW, param_groups=[{"params": ["w"]}], **ADAMW)
    before = model3.state_dict()
    with pytest.raises(CheckpointError, match="param group 0 differs"):
        load_checkpoint(tmp_path, model3, optim3)
    zero_cases.assert_state_close(model3.state_dict(), before, rtol=0, atol=0)  # a refused load writes nothing
    load_checkpoint(tmp_path, model3, optim3, load_hyperparameters=False)
    assert optim3.param_groups[0]["lr"] == ADAMW["lr"]


def test_old_checkpoint_without_groups_keeps_several_groups_own(tmp_path, caplog):
    model = ZeroDDP(zero_cases.Odd(), chunk_size=100)
    optim = ZeroOptimizer(model, torch.optim.Adam, lr=0.5)
    optim.backward(zero_cases.odd_loss(model, zero_cases.batches("odd", 1, 2)[0]))
    optim.step()
    meta_path = save_checkpoint(tmp_path, model, optim, step=1)
    from torch_backend.checkpoint import optim_shards

    saved = read_meta(meta_path).optimizer
    saved.param_groups = None  # as written before param groups
    one = ZeroOptimizer(ZeroDDP(zero_cases.Odd(), chunk_size=100), torch.optim.Adam, lr=0.1)
    optim_shards.load_hyperparameters(one, saved)
    assert one.param_groups[0]["lr"] == 0.5
    two = ZeroOptimizer(
        ZeroDDP(zero_cases.Odd(), chunk_size=100), torch.optim.Adam, lr=0.1, param_groups=[{"params": ["w"]}]
    )
    with caplog.at_level(logging.WARNING, logger="chunkzero.checkpoint"):
        optim_shards.load_hyperparameters(two, saved)
    assert [g["lr"] for g in two.param_groups] == [0.1, 0.1] and "keep their own" in caplog.text


@pytest.mark.parametrize("engine", ["zero", "ddp"])
def test_train_engine_decays_matrices_only(engine):
    """``chunkzero train``'s optimizer: nanoGPT's two groups, weight decay on tensors of >= 2 dimensions."""
    from chunkzero.train_config import TrainConfig, with_device_defaults
    from torch_backend.train.adapter import TorchAdapter
    from torch_backend.train.gpt import GPT, gpt_config

    cfg = with_device_defaults(TrainConfig(engine=engine, weight_decay=0.1), "cpu")  # as validate() fills it
    e = TorchAdapter(GPT(gpt_config("gpt-tiny")), cfg, torch.device("cpu"))
    groups = e.param_groups()
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    dims = [{p.dim() >= 2 for p in g["params"]} for g in groups] if engine == "ddp" else [
        {len(e.model.layout.tensor(n).shape) >= 2 for n in names} for names in e.optim.group_names]
    assert dims == [{True}, {False}]
    e.set_lr(1e-4)
    assert [g["lr"] for g in groups] == [1e-4, 1e-4]


def test_pieces_follow_a_replaced_master():
    """If a chunk's master tensor is replaced (same values), the pieces step the new one: the run equals
    one without the replacement (bf16, so the low-precision shard is refreshed from the master)."""
    runs = []
    for replace in (False, True):
        model = ZeroDDP(zero_cases.Odd(), chunk_size=100, mixed_precision="bf16")
        optim = ZeroOptimizer(model, torch.optim.Adam, **ADAMW)
        for i, batch in enumerate(zero_cases.batches("odd", 2, 2)):
            if replace and i == 1:
                for c in model.chunks:
                    if c.requires_grad:
                        c.master = torch.nn.Parameter(c.master.detach().clone())
            optim.backward(zero_cases.odd_loss(model, batch))
            optim.step()
            optim.zero_grad()
        runs.append(model.state_dict())
    zero_cases.assert_state_close(runs[1], runs[0], rtol=0, atol=0)  # bitwise: the same engine on the same values


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_skips_in_a_row_at_the_minimum_loss_scale_raise(precision):
    """Gradients that are always inf: the fp16 scale backs off 4 → 2 → 1 (hysteresis 1), then the third
    skip at scale 1 raises ``LossScaleError`` naming the step and the scale (bf16 runs at scale 1, its
    minimum, from the start). A finite step in between restarts the count; ``None`` never raises."""
    from chunkzero.errors import LossScaleError

    (batch,) = zero_cases.batches("odd", 1, 2)

    def run(pattern: str, limit):
        model = ZeroDDP(zero_cases.Odd(), chunk_size=100, mixed_precision=precision)
        optim = ZeroOptimizer(model, torch.optim.AdamW, initial_scale=4.0, hysteresis=1,
                              max_skipped_at_min_scale=limit, **ADAMW)
        for i, kind in enumerate(pattern, 1):  # "x": an inf loss, ".": a finite one
            loss = zero_cases.odd_loss(model, batch) * (float("inf") if kind == "x" else 1.0)
            optim.backward(loss)
            try:
                applied = optim.step()
            except LossScaleError as e:
                return i, e, optim
            assert applied == (kind == "."), (i, kind)
            optim.zero_grad()
        return None, None, optim

    first_at_min = 3 if precision == "fp16" else 1  # the first step whose backward ran at scale 1
    step, err, optim = run("x" * 10, 3)
    assert step == first_at_min + 2 and (err.step, err.scale, err.skipped) == (step, 1.0, 3)
    assert f"step {step}: 3 steps in a row" in str(err) and "minimum loss scale 1" in str(err)
    assert optim.skipped_steps == step and optim.loss_scale == 1.0
    # a finite step (applied) restarts the count
    step, err, _ = run("x" * (first_at_min + 1) + "." + "xxx", 3)
    assert step == first_at_min + 5 and err.skipped == 3
    assert run("x" * 30, None)[0] is None
    with pytest.raises(ConfigError, match="max_skipped_at_min_scale"):
        ZeroOptimizer(ZeroDDP(zero_cases.Odd(), chunk_size=100), max_skipped_at_min_scale=0)


class _ReplacingMomentum(torch.optim.Optimizer):
    """An elementwise optimizer that replaces its state tensor every step instead of updating it in place
    (``state["m"] = ...`` or ``state.update(m=...)``), as a custom optimizer may."""

    def __init__(self, params, lr=0.1, write="setitem"):
        super().__init__(params, dict(lr=lr))
        self.write = write

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - torch's signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m = 0.9 * state["m"] + p.grad if "m" in state else p.grad.clone()
                if self.write == "setitem":
                    state["m"] = m
                else:
                    state.update(m=m)
                p.sub_(group["lr"] * m)


@pytest.mark.parametrize("write", ["setitem", "update"])
def test_state_replaced_every_step_is_checkpointed(tmp_path, write):
    """The state an optimizer writes anew at every step reaches the checkpoint (Note [adopt what was written]):
    a run resumed from step 2 takes step 3 exactly as the uninterrupted run. A ZeroOptimizer that moved the
    state into its buffers at the first step only would save step 1's momentum, and the resumed step differ."""
    def build():
        model = ZeroDDP(zero_cases.Odd(), chunk_size=100)
        return model, ZeroOptimizer(model, _ReplacingMomentum, lr=0.05, write=write)

    data = zero_cases.batches("odd", 3, 2)
    model, optim = build()
    _train_odd(model, optim, data[:2])
    save_checkpoint(tmp_path, model, optim, step=2)
    other, other_optim = build()
    load_checkpoint(tmp_path, other, other_optim)
    for m, o in ((model, optim), (other, other_optim)):
        o.backward(zero_cases.odd_loss(m, data[2]))
        o.step()
    zero_cases.assert_state_close(other.state_dict(), model.state_dict(), rtol=0, atol=0)


class _SetdefaultMomentum(torch.optim.Optimizer):
    """In-place momentum whose state entries are made with ``self.state.setdefault(p, {})``, a plain dict."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - torch's signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state.setdefault(p, {})
                    if "m" not in state:
                        state["m"] = torch.zeros_like(p)
                    state["m"].mul_(0.9).add_(p.grad)
                    p.sub_(group["lr"] * state["m"])


class _LateUse(torch.nn.Module):
    """A layer, and a bias used only when asked: it gets its first gradient late."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.late = torch.nn.Parameter(torch.randn(4))
        self.use_late = False

    def forward(self, x):
        y = self.a(x)
        return (y + self.late if self.use_late else y).square().sum()


def test_state_made_late_by_setdefault_is_checkpointed(tmp_path):
    """A resumed run (every entry watched, nothing left to adopt) in which a tensor gets its first gradient:
    its state, a plain dict put in by ``state.setdefault``, reaches the next checkpoint, so a run resumed from
    it steps as the uninterrupted one (Note [adopt what was written]; a map that missed the write saved zeros).
    An entry the map cannot watch keeps the states to adopt after every step."""
    def build():
        model = ZeroDDP(_LateUse(), chunk_size=100, find_unused_parameters=True)
        return model, ZeroOptimizer(model, _SetdefaultMomentum, lr=0.05)

    def step(model, optim, i, use_late):
        model.module.use_late = use_late
        optim.backward(model(torch.full((2, 4), 0.1 * i)))
        optim.step()
        optim.zero_grad()

    model, optim = build()
    step(model, optim, 0, False)
    save_checkpoint(tmp_path / "a", model, optim, step=1)
    model, optim = build()
    load_checkpoint(tmp_path / "a", model, optim)
    step(model, optim, 1, False)
    assert not optim.piece_states.stale.value  # all adopted, and every entry watched
    step(model, optim, 2, True)  # ``late`` gets its first gradients
    step(model, optim, 3, True)
    assert optim.piece_states.stale.value and dict in {type(e) for e in optim.state.values()}
    save_checkpoint(tmp_path / "b", model, optim, step=4)
    other, other_optim = build()
    load_checkpoint(tmp_path / "b", other, other_optim)
    for m, o in ((model, optim), (other, other_optim)):
        step(m, o, 4, True)
    zero_cases.assert_state_close(other.state_dict(), model.state_dict(), rtol=0, atol=0)


def test_state_copies_are_torchs_and_nothing_keeps_the_buffers_alive():
    """``deepcopy(optim.state)`` is torch's ``defaultdict`` of plain dicts, equal to the live state (not a copy of
    the model's chunks through the entries' owner); and the state buffers go with the optimizer, without waiting
    for the cycle collector."""
    import gc
    import weakref

    model = ZeroDDP(zero_cases.Odd(), chunk_size=100)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    optim.backward(zero_cases.odd_loss(model, zero_cases.batches("odd", 1, 2)[0]))
    optim.step()
    copied = copy.deepcopy(optim.state)
    assert type(copied) is collections.defaultdict and {type(e) for e in copied.values()} == {dict}
    assert [sorted(e) for e in copied.values()] == [sorted(e) for e in optim.state.values()]
    assert all(torch.equal(c[k], e[k]) for c, e in zip(copied.values(), optim.state.values()) for k in e)
    states = weakref.ref(optim.piece_states)
    gc.disable()
    try:
        del optim, copied
        assert states() is None
    finally:
        gc.enable()
