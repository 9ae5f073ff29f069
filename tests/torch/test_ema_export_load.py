"""In-process (W = 1): what ``load_checkpoint`` says about a checkpoint's EMA — dropped by an optimizer
without a ZeroEMA (one warning), its decay replacing the ZeroEMA's (an info line, or kept with
``load_hyperparameters=False``) — ``chunkzero inspect`` of a hybrid checkpoint, and a byte-level GPT's
safetensors export (the tied head stored once) loading strictly into ``GPT``, EMA export included."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from torch_backend import ZeroDDP, ZeroEMA, ZeroOptimizer, load_checkpoint, save_checkpoint
from torch_backend.train.gpt import GPT, GPT_CONFIGS


def _gpt(ema_decay=None, seed=0):
    torch.manual_seed(seed)
    model = ZeroDDP(GPT(GPT_CONFIGS["gpt-tiny"]))
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    return model, optim, (None if ema_decay is None else ZeroEMA(optim, ema_decay))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A byte-level gpt-tiny after 2 steps with an EMA of decay 0.5, checkpointed at step 2; its state dict
    and its EMA's."""
    model, optim, ema = _gpt(0.5)
    for i in range(2):
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i))
        optim.backward(torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()))
        optim.step()
        optim.zero_grad()
    root = tmp_path_factory.mktemp("gpt") / "ckpt"
    save_checkpoint(root, model, optim, step=2)
    with ema.ema_weights():
        ema_state = {k: v.clone() for k, v in model.state_dict().items()}
    return root, {k: v.clone() for k, v in model.state_dict().items()}, ema_state


def _records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "chunkzero.checkpoint" and r.levelno == level]


def test_an_ema_the_optimizer_lacks_is_dropped_with_one_warning(saved, caplog):
    root, _, _ = saved
    model, optim, _ = _gpt()
    with caplog.at_level(logging.INFO, logger="chunkzero.checkpoint"):
        load_checkpoint(root, model, optim)
    warnings = [m for m in _records(caplog, logging.WARNING) if "EMA" in m]
    assert len(warnings) == 1 and "holds an EMA of the weights (decay 0.5, 2 updates)" in warnings[0] \
        and "the EMA is dropped" in warnings[0], warnings


def test_the_checkpoints_decay_replaces_the_zero_emas_and_says_so(saved, caplog):
    root, _, _ = saved
    model, optim, ema = _gpt(0.9)
    with caplog.at_level(logging.INFO, logger="chunkzero.checkpoint"):
        load_checkpoint(root, model, optim)
    assert ema.decay == 0.5 and ema.update_count == 2
    assert any("its EMA decay 0.5 replaces the ZeroEMA's 0.9" in m for m in _records(caplog, logging.INFO)), caplog.text
    caplog.clear()
    model, optim, ema = _gpt(0.9)
    with caplog.at_level(logging.INFO, logger="chunkzero.checkpoint"):
        load_checkpoint(root, model, optim, load_hyperparameters=False)
    assert ema.decay == 0.9 and ema.update_count == 2 and "replaces" not in caplog.text
    caplog.clear()
    model, optim, ema = _gpt(0.5)  # the same decay: nothing to say
    with caplog.at_level(logging.INFO, logger="chunkzero.checkpoint"):
        load_checkpoint(root, model, optim)
    assert "replaces" not in caplog.text and "EMA" not in caplog.text


@pytest.mark.parametrize("ema", [False, True])
def test_safetensors_export_loads_strictly_into_the_byte_level_gpt(saved, tmp_path, ema):
    from safetensors.torch import load_file

    from torch_backend.checkpoint.export import export_checkpoint

    root, live, ema_state = saved
    export_checkpoint(root, tmp_path / "st", format="safetensors", ema=ema)
    tensors = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert "lm_head.weight" not in tensors and "transformer.wte.weight" in tensors  # the tied head, stored once
    gpt = GPT(GPT_CONFIGS["gpt-tiny"])
    result = gpt.load_state_dict(tensors)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # still tied
    want = ema_state if ema else live
    for k, v in gpt.state_dict().items():
        assert torch.equal(v, want[k]), k
    both = gpt.state_dict()  # a state dict with both names loads as it is
    GPT(GPT_CONFIGS["gpt-tiny"]).load_state_dict(both)


def test_inspect_names_a_hybrid_checkpoints_s_r_and_w(saved, tmp_path, capsys):
    """A checkpoint saved by W = 4 ranks as S = 1 x R = 4 records replicas 4 beside the layout's world size."""
    import shutil

    from chunkzero.checkpoint import META_FILENAME, META_ITEM
    from chunkzero.cli import main
    from chunkzero.inspection import format_inspection, inspect_checkpoint

    root, _, _ = saved
    assert "world size 1," in format_inspection(inspect_checkpoint(root))  # flat: as before
    hybrid = tmp_path / "hybrid"
    shutil.copytree(root, hybrid)
    meta_path = hybrid / "2" / META_ITEM / META_FILENAME
    doc = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**doc, "replicas": 4}))
    info = inspect_checkpoint(hybrid)
    assert info["world_size"] == 1 and info["replicas"] == 4
    assert main(["inspect", str(hybrid)]) == 0
    out = capsys.readouterr().out
    assert "hybrid sharding: shard group size S = 1, R = 4 replicas, world size W = S·R = 4" in out, out
