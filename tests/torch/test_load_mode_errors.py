"""``load_checkpoint``'s refusals and name remapping: a plain module, ``force`` outside inference, a
weights-only load that matches nothing (and ``prefix=`` / ``model_prefix=`` that make it match), a
resume that lists every tensor it lacks, and ``WeightsLoad`` read like torch's ``load_state_dict`` result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from chunkzero.errors import CheckpointError, ConfigError
from torch_backend import ZeroDDP
from torch_backend.checkpoint.sharded import load_checkpoint, save_checkpoint
from torch_backend.train.gpt import GPT, GPTConfig

CFG = dict(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16, dropout=0.0)


class Wrapped(nn.Module):
    """A module that holds the saved model as ``self.backbone`` (its names carry ``backbone.``) and a new head."""

    def __init__(self, head: bool = False):
        super().__init__()
        self.backbone = GPT(GPTConfig(**CFG))
        if head:
            self.head = nn.Linear(CFG["n_embd"], 2)

    def forward(self, x):
        return self.backbone(x)


def _values(model) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def _saved(root, module: nn.Module, seed: int) -> dict[str, np.ndarray]:
    model = ZeroDDP(module)
    save_checkpoint(root, model, None, step=1)
    return _values(model)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("remap")
    torch.manual_seed(0)
    gpt = _saved(base / "gpt", GPT(GPTConfig(**CFG)), 0)
    torch.manual_seed(1)
    wrapped = _saved(base / "wrapped", Wrapped(head=True), 1)
    return {"gpt": (base / "gpt", gpt), "wrapped": (base / "wrapped", wrapped)}


def _fresh(module_fn, seed=7) -> ZeroDDP:
    torch.manual_seed(seed)
    return ZeroDDP(module_fn())


def test_a_plain_module_is_refused_with_what_to_do(ckpts, tmp_path):
    root, _ = ckpts["gpt"]
    plain = GPT(GPTConfig(**CFG))
    for mode in ("finetune", "resume", "inference"):
        with pytest.raises(ConfigError, match=r"ZeroDDP-wrapped model, got a plain GPT.*chunkzero export"):
            load_checkpoint(root, plain, mode=mode)
    with pytest.raises(ConfigError, match="save_checkpoint takes the ZeroDDP-wrapped model"):
        save_checkpoint(tmp_path / "x", plain, None, step=0)


def test_force_outside_inference_is_refused(ckpts):
    root, _ = ckpts["gpt"]
    model = _fresh(lambda: GPT(GPTConfig(**CFG)))
    before = _values(model)
    for mode in ("resume", "pretrain", "finetune"):
        with pytest.raises(ConfigError, match="force=True applies to mode='inference' only"):
            load_checkpoint(root, model, mode=mode, force=True)
    assert all(np.array_equal(v, before[k]) for k, v in _values(model).items())  # nothing loaded


def test_finetune_that_matches_nothing_raises_and_names_the_prefix(ckpts):
    root, _ = ckpts["gpt"]
    model = _fresh(Wrapped)
    before = _values(model)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root, model, mode="finetune")
    msg = str(e.value)
    assert "no tensor of the model matched" in msg and "'backbone.' before the checkpoint's" in msg
    assert "model_prefix=" in msg and "'transformer.wte.weight'" in msg and "'backbone.transformer.wte.weight'" in msg
    with pytest.raises(CheckpointError, match="no tensor of the model matched"):
        load_checkpoint(root, model, mode="inference", force=True)  # force cannot make an empty load useful
    assert all(np.array_equal(v, before[k]) for k, v in _values(model).items())


def test_model_prefix_loads_into_a_wrapping_module(ckpts):
    root, want = ckpts["gpt"]
    model = _fresh(lambda: Wrapped(head=True))
    init = _values(model)
    missing, unexpected = load_checkpoint(root, model, mode="finetune", model_prefix="backbone.")
    assert missing == ["head.weight", "head.bias"] and unexpected == []
    got = _values(model)
    for k, v in want.items():
        assert np.array_equal(got["backbone." + k], v), k
    assert np.array_equal(got["head.weight"], init["head.weight"])  # the new head keeps its init


def test_prefix_loads_a_sub_model_and_reports_the_rest_as_saved(ckpts):
    root, want = ckpts["wrapped"]
    model = _fresh(lambda: GPT(GPTConfig(**CFG)))
    res = load_checkpoint(root, model, mode="finetune", prefix="backbone.")
    assert res.missing_keys == [] and res.unexpected_keys == ["head.weight", "head.bias"]  # names as saved
    got = _values(model)
    assert sorted(got) == sorted(k.removeprefix("backbone.") for k in want if k.startswith("backbone."))
    assert all(np.array_equal(v, want["backbone." + k]) for k, v in got.items())
    with pytest.raises(ConfigError, match="weights-only"):
        load_checkpoint(root, model, prefix="backbone.")  # resume restores the same tensors only


def test_weights_load_unpacks_and_shows_the_keys_first(ckpts):
    root, _ = ckpts["gpt"]
    model = _fresh(lambda: Wrapped(head=True))
    res = load_checkpoint(root, model, mode="finetune", model_prefix="backbone.")
    missing, unexpected = res
    assert (missing, unexpected) == (res.missing_keys, res.unexpected_keys) == (["head.weight", "head.bias"], [])
    text = repr(res)
    assert text.startswith("WeightsLoad(missing_keys=['head.weight', 'head.bias'], unexpected_keys=[]")
    assert "mode='finetune'" in text and "step 1" in text and len(text) < 300  # not the whole metadata
    assert res.meta.step == 1 and res.step == 0


def test_resume_lists_every_missing_tensor_and_suggests_finetune(ckpts):
    root, _ = ckpts["gpt"]
    model = _fresh(lambda: Wrapped(head=True))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root, model)
    msg = str(e.value)
    # every model tensor is missing here: the first ten are listed, the rest counted
    assert "'backbone.transformer.wte.weight'" in msg and "'backbone.transformer.h.0.ln_1.weight'" in msg
    assert "more)" in msg and "mode='finetune'" in msg and "'transformer.wte.weight'" in msg


def test_resume_error_lists_all_up_to_the_cap():
    from torch_backend.checkpoint.load_modes import check_complete

    with pytest.raises(CheckpointError) as e:
        check_complete([f"t{i}" for i in range(3)], [], "ck")
    assert all(f"'t{i}'" in str(e.value) for i in range(3)) and "more" not in str(e.value)
    with pytest.raises(CheckpointError) as e:
        check_complete([f"t{i}" for i in range(15)], ["x"], "ck")
    assert (
        "'t9'" in str(e.value) and "'t10'" not in str(e.value) and "(5 more)" in str(e.value) and "'x'" in str(e.value)
    )
