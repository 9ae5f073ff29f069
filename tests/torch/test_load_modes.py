"""``load_checkpoint(mode=...)``: SwissArmyTransformer's three load modes.

- ``resume`` (SAT's ``pretrain``): everything, the optimizer and RNG included (the default; the
  resume tests cover it in depth, here only that SAT's spelling means the same);
- ``finetune``: weights only, step 0, no optimizer; a new head keeps its init, the rest equals the
  checkpoint exactly; missing and unexpected tensors are reported;
- ``inference``: weights only, ``eval()``; a missing tensor raises (naming it), on every rank, and
  leaves the model as it was, unless ``force=True``.

The checkpoint is saved by this process (world size 1); a world-size-2 run loads it too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_models import gpt_config

from chunkzero.errors import CheckpointError, ConfigError, ShapeMismatchError
from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend._testing import run_distributed
from torch_backend.checkpoint.load_modes import WeightsLoad
from torch_backend.checkpoint.sharded import load_checkpoint, save_checkpoint
from torch_backend.train.gpt import GPT, GPTConfig

HEAD = ["cls_head.weight", "cls_head.bias"]


class GPTWithHead(GPT):
    """The GPT with a new classification head (SAT's mixin): the tensors a pre-trained GPT lacks."""

    def __init__(self, config: GPTConfig, classes: int = 3):
        super().__init__(config)
        self.cls_head = nn.Linear(config.n_embd, classes)

    def forward(self, x):
        logits = super().forward(x)
        return logits + 0.0 * self.cls_head(self.transformer.wte(x)).sum()  # the head takes part in backward


def _wrap(module, chunk_size=3000):
    return ZeroDDP(module, chunk_size=chunk_size)


def _values(model) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def _trained_checkpoint(root, seed=0, module_cls=GPT):
    """A GPT trained 2 AdamW steps and saved as step 2 at world size 1; its weights."""
    torch.manual_seed(seed)
    model = _wrap(module_cls(gpt_config()))
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    for s in range(2):
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(s))
        logits = model(x)
        optim.backward(F.cross_entropy(logits.reshape(-1, 256), torch.roll(x, -1, 1).reshape(-1)))
        optim.step()
        optim.zero_grad()
    save_checkpoint(root, model, optim, step=2)
    return _values(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes") / "ckpt"
    return root, _trained_checkpoint(root)


def _fresh_with_head(seed=7):
    torch.manual_seed(seed)
    model = _wrap(GPTWithHead(gpt_config()), chunk_size=2000)  # another chunk size than the save's
    return model, _values(model)


def test_finetune_adds_a_head_that_keeps_its_init(saved):
    root, want = saved
    model, init = _fresh_with_head()
    rng_before = torch.get_rng_state()
    res = load_checkpoint(root, model, mode="finetune")
    assert isinstance(res, WeightsLoad) and res.step == 0 and res.meta.step == 2
    assert res.missing_keys == HEAD and res.unexpected_keys == []
    got = _values(model)
    for k in want:  # the pre-trained part equals the checkpoint exactly
        assert np.array_equal(got[k], want[k]), k
    for k in HEAD:  # the new head keeps the module's own init (not zeros, not anything saved)
        assert np.abs(init[k]).sum() > 0 and np.array_equal(got[k], init[k]), k
    assert torch.equal(torch.get_rng_state(), rng_before)  # no RNG restored
    assert model.training  # finetune does not switch to eval
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, eps=1e-6)  # the fresh optimizer
    assert optim.step_count == 0 and not optim.state_dict()["state"]
    x = torch.randint(0, 256, (2, 16))
    optim.backward(model(x).float().mean())
    assert optim.step()


def test_finetune_reports_unexpected_tensors(tmp_path):
    root = tmp_path / "ckpt"
    want = _trained_checkpoint(root, seed=3, module_cls=GPTWithHead)
    torch.manual_seed(1)
    model = _wrap(GPT(gpt_config()))
    res = load_checkpoint(root, model, mode="finetune")
    assert res.missing_keys == [] and res.unexpected_keys == HEAD
    got = _values(model)
    assert all(np.array_equal(got[k], want[k]) for k in got)
    with pytest.raises(CheckpointError, match="cls_head"):  # the strict resume refuses the same checkpoint
        load_checkpoint(root, _wrap(GPT(gpt_config())))


def test_inference_refuses_missing_tensors_unless_forced(saved):
    root, want = saved
    model, init = _fresh_with_head()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root, model, mode="inference")
    assert "'cls_head.weight'" in str(e.value) and "'cls_head.bias'" in str(e.value)
    assert all(np.array_equal(v, init[k]) for k, v in _values(model).items())  # nothing was loaded
    assert model.training
    res = load_checkpoint(root, model, mode="inference", force=True)
    assert res.missing_keys == HEAD and not model.training and not model.module.training
    got = _values(model)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_inference_of_a_complete_model_is_eval_and_exact(saved):
    root, want = saved
    torch.manual_seed(5)
    model = _wrap(GPT(gpt_config()))
    res = load_checkpoint(root, model, mode="inference")
    assert res.missing_keys == [] and res.unexpected_keys == [] and not model.training
    got = _values(model)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_pretrain_is_resume_and_restores_the_optimizer(saved):
    root, want = saved
    for mode in ("pretrain", "resume"):
        torch.manual_seed(9)
        model = _wrap(GPT(gpt_config()))
        optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
        meta = load_checkpoint(root, model, optim, mode=mode)
        assert meta.step == 2 and optim.step_count == 2  # the meta, as before; the optimizer restored
        assert set(optim.state_dict()["state"]) and all(
            np.array_equal(v, want[k]) for k, v in _values(model).items())


def test_bad_modes_and_shapes(saved):
    root, _ = saved
    model = _wrap(GPT(gpt_config()))
    with pytest.raises(ConfigError, match="'resume', 'finetune', 'inference'"):
        load_checkpoint(root, model, mode="train")
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ConfigError, match="optimizer=None"):  # a weights-only load never ignores an optimizer
        load_checkpoint(root, model, optim, mode="finetune")
    wider = _wrap(GPT(gpt_config(block_size=32)))
    with pytest.raises(ShapeMismatchError, match="wpe"):
        load_checkpoint(root, wider, mode="finetune")


def _load_at_two(rank, world, root):
    model, init = _fresh_with_head()
    res = load_checkpoint(root, model, mode="finetune")
    got = _values(model)
    fresh, _ = _fresh_with_head()
    try:
        load_checkpoint(root, fresh, mode="inference")
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"got": got if rank == 0 else None, "init": init if rank == 0 else None,
            "missing": res.missing_keys, "error": error}


def test_finetune_and_inference_at_world_size_two(saved):
    root, want = saved
    out = run_distributed(_load_at_two, 2, str(root), timeout=240)
    got, init = out[0]["got"], out[0]["init"]
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert all(np.array_equal(got[k], init[k]) for k in HEAD)
    for r in out:  # every rank reports the same keys and raises the same error
        assert r["missing"] == HEAD and r["error"] is not None and "'cls_head.weight'" in r["error"]
