"""``chunkzero export --ema``: a tiny Hugging Face GPT-2 trained with ZeroDDP and a ZeroEMA, saved, and
its EMA weights exported to safetensors (loaded with ``from_pretrained``) and to an Orbax parameter
tree (restored with ``StandardCheckpointer``), equal bit for bit to the weights ``ema_weights()`` shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import hf_gpt2_config

from chunkzero.cli import main as cli

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(root with EMA, root without, live state dict, EMA state dict)`` after 3 steps (``wpe`` frozen)."""
    from torch_backend import ZeroDDP, ZeroEMA, ZeroOptimizer, save_checkpoint

    torch.manual_seed(0)
    module = transformers.GPT2LMHeadModel(hf_gpt2_config())
    module.transformer.wpe.weight.requires_grad_(False)
    model = ZeroDDP(module, chunk_size=3000)
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    ema = ZeroEMA(optim, 0.5)
    for i in range(3):
        x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(i))
        optim.backward(model(x, labels=x).loss)
        optim.step()
        optim.zero_grad()
    base = tmp_path_factory.mktemp("export_ema")
    save_checkpoint(base / "ckpt", model, optim, step=3)
    save_checkpoint(base / "plain", model, step=3)  # no optimizer: no EMA
    with ema.ema_weights():
        averaged = model.state_dict()
    return base / "ckpt", base / "plain", model.state_dict(), averaged


def test_export_ema_loads_in_hugging_face(trained, tmp_path, capsys):
    root, _, live, averaged = trained
    out = tmp_path / "hf-ema"
    assert cli(["export", str(root), "--format", "safetensors", str(out), "--ema"]) == 0
    assert "(EMA weights)" in capsys.readouterr().out
    hf = transformers.GPT2LMHeadModel.from_pretrained(out)
    got = hf.state_dict()
    for k, v in averaged.items():
        assert torch.equal(got[k], v), k
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # re-tied
    # the test can fail: without --ema the live weights come out, and they differ from the EMA
    plain = tmp_path / "hf-live"
    assert cli(["export", str(root), "--format", "safetensors", str(plain)]) == 0
    live_hf = transformers.GPT2LMHeadModel.from_pretrained(plain).state_dict()
    assert all(torch.equal(live_hf[k], v) for k, v in live.items())
    assert not torch.equal(live["transformer.h.0.attn.c_attn.weight"], averaged["transformer.h.0.attn.c_attn.weight"])
    assert torch.equal(got["transformer.wpe.weight"], live["transformer.wpe.weight"])  # frozen: as saved
    x = torch.randint(0, 96, (1, 8))
    hf.eval()
    assert not torch.equal(hf(x).logits, transformers.GPT2LMHeadModel.from_pretrained(plain).eval()(x).logits)


def test_export_ema_as_orbax_params(trained, tmp_path):
    import jax
    import orbax.checkpoint as ocp

    root, _, _, averaged = trained
    out = tmp_path / "params-ema"
    assert cli(["export", str(root), "--format", "orbax-params", str(out), "--ema", "--dtype", "float32"]) == 0
    tree = ocp.StandardCheckpointer().restore(out.absolute())
    flat = {".".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_leaves_with_path(tree)}
    assert sorted(flat) == sorted(k for k in averaged if k != "lm_head.weight")
    for k, v in flat.items():
        assert np.array_equal(v, averaged[k].numpy()), k


def test_inspect_shows_the_ema(trained, capsys):
    root, plain, _, _ = trained
    assert cli(["inspect", str(root)]) == 0
    assert "EMA of the weights: decay 0.5, 3 updates" in capsys.readouterr().out
    assert cli(["inspect", str(plain)]) == 0
    assert "EMA" not in capsys.readouterr().out


def test_export_ema_of_a_checkpoint_without_one_fails(trained, tmp_path, capsys):
    _, plain, _, _ = trained
    assert cli(["export", str(plain), "--format", "safetensors", str(tmp_path / "x"), "--ema"]) == 2
    assert "holds no EMA" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
