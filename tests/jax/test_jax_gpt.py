"""The Flax NNX GPT mirrors torch_backend.train.gpt.GPT (jax_backend.gpt), and torch, chunk and Hugging Face
parameters convert onto it (jax_backend.convert)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jaxtest_utils import rel_err, torch_param_specs

import jax_backend as jb
from chunkzero import CheckpointError, ChunkLayout, ConfigError, ShapeMismatchError, TensorSpec
from jax_backend import convert as jconvert
from jax_backend import gpt as jgpt
from torch_backend.train import gpt as tgpt

FP32_RTOL = 1e-5
"""fp32 logits: max |jax - torch| / max |torch| (DESIGN.md §7)."""


def test_configs_match_torch():
    assert {k: v.to_dict() for k, v in jb.GPT_CONFIGS.items()} == {k: v.to_dict() for k, v in tgpt.GPT_CONFIGS.items()}
    assert [f.name for f in dataclasses.fields(jb.GPTConfig)] == [f.name for f in dataclasses.fields(tgpt.GPTConfig)]
    assert jb.GPTConfig().to_dict() == tgpt.GPTConfig().to_dict()
    with pytest.raises(ConfigError, match="unknown model 'gpt-huge'"):
        jb.gpt_config("gpt-huge")


@pytest.mark.parametrize(
    "cfg", [tgpt.GPT_CONFIGS["gpt-tiny"], tgpt.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=8, bias=False)]
)
def test_param_specs_are_torch_named_parameters(cfg):
    model = tgpt.GPT(cfg)
    assert jb.param_specs(cfg) == torch_param_specs(model)


def test_torch_flax_rules():
    cfg = tgpt.GPT_CONFIGS["gpt-tiny"]
    torch.manual_seed(1)
    tm = tgpt.GPT(cfg)
    sd = {n: p.detach().numpy() for n, p in tm.named_parameters()}
    state = jb.torch_to_flax(sd, cfg)
    pure = nnx.to_pure_dict(state)
    tr = pure["transformer"]
    np.testing.assert_array_equal(tr["h"][0]["attn"]["c_attn"]["kernel"], sd["transformer.h.0.attn.c_attn.weight"].T)
    np.testing.assert_array_equal(tr["h"][1]["mlp"]["c_proj"]["bias"], sd["transformer.h.1.mlp.c_proj.bias"])
    np.testing.assert_array_equal(tr["h"][0]["ln_2"]["scale"], sd["transformer.h.0.ln_2.weight"])
    np.testing.assert_array_equal(tr["wte"]["embedding"], sd["transformer.wte.weight"])
    assert "lm_head" not in pure  # tied: wte.attend
    back = jb.flax_to_torch(state, cfg, include_aliases=True)
    assert list(back)[: len(sd)] == list(sd) and back["lm_head.weight"] is back["transformer.wte.weight"]
    for n, x in sd.items():
        np.testing.assert_array_equal(np.asarray(back[n]), x)
    # torch tensors are accepted, and a model round-trips
    model = jb.gpt_from_torch(dict(tm.named_parameters()), cfg)
    for n, x in jb.flax_to_torch(model).items():
        np.testing.assert_array_equal(np.asarray(x), sd[n])
    assert model.num_params() == tm.num_params()


@pytest.mark.parametrize(
    "cfg",
    [
        tgpt.GPT_CONFIGS["gpt-tiny"],
        tgpt.GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32, bias=False, layer_norm_eps=1e-6),
        tgpt.GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16, dropout=0.1),
    ],
    ids=["gpt-tiny", "no-bias", "dropout-eval"],
)
def test_logits_match_torch(cfg, eval_tokens):
    torch.manual_seed(2)
    tm = tgpt.GPT(cfg).eval()
    idx = eval_tokens[:, : min(cfg.block_size, eval_tokens.shape[1])]
    with torch.no_grad():
        ref = tm(torch.from_numpy(idx)).numpy()
    model = jb.gpt_from_torch(dict(tm.named_parameters()), cfg)
    model.eval()
    out = np.asarray(jgpt.logits(model, jnp.asarray(idx)))
    assert out.shape == ref.shape and out.dtype == np.float32
    assert rel_err(out, ref) < FP32_RTOL


def test_flax_init_is_runnable_and_checks_length():
    cfg = jb.GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=8)
    model = jgpt.init_gpt(cfg, seed=0)
    assert jgpt.logits(model, jnp.zeros((1, 8), jnp.int32)).shape == (1, 8, 256)
    with pytest.raises(ConfigError, match="exceeds block_size 8"):
        jgpt.logits(model, jnp.zeros((1, 9), jnp.int32))


def test_hf_gpt2_loader_matches_transformers(eval_tokens):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    idx = eval_tokens[:, :40]
    with torch.no_grad():
        ref = hf(torch.from_numpy(idx)).logits.numpy()
    model = jb.load_hf_gpt2(hf)
    assert rel_err(np.asarray(jgpt.logits(model, jnp.asarray(idx))), ref) < FP32_RTOL
    # Conv1D (in, out) is the Flax kernel as is; the torch naming transposes it to nn.Linear (out, in)
    sd = hf.state_dict()
    np.testing.assert_array_equal(np.asarray(model.transformer.h[0].attn.c_attn.kernel[...]),
                                  sd["transformer.h.0.attn.c_attn.weight"].numpy())
    tsd = jb.hf_gpt2_to_torch(sd)
    cfg = jconvert.hf_gpt2_config(hf_cfg)
    tm = tgpt.GPT(tgpt.GPTConfig(**cfg.to_dict())).eval()
    tm.load_state_dict({k: torch.from_numpy(v) for k, v in tsd.items()}, strict=False)
    with torch.no_grad():
        assert rel_err(tm(torch.from_numpy(idx)).numpy(), ref) < FP32_RTOL


def test_hf_loader_bad_input():
    with pytest.raises(ConfigError, match="'relu'"):
        jconvert.hf_gpt2_config({"n_positions": 8, "vocab_size": 8, "n_layer": 1, "n_head": 1, "n_embd": 4,
                             "activation_function": "relu"})
    cfg = jb.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=4)
    sd = {n: np.zeros(s.shape[::-1] if n.endswith(jconvert._HF_CONV1D) else s.shape, np.float32)
          for n, s in ((s.name, s) for s in jb.param_specs(cfg))}
    jb.load_hf_gpt2(sd, cfg)  # well-formed
    bad = dict(sd, **{"transformer.h.0.mlp.c_fc.weight": np.zeros((16, 4), np.float32)})
    with pytest.raises(ShapeMismatchError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight.*\(4, 16\).*\(16, 4\)"):
        jb.load_hf_gpt2(bad, cfg)
    with pytest.raises(ConfigError, match="not tied"):
        jb.load_hf_gpt2(dict(sd, **{"lm_head.weight": np.ones((16, 4), np.float32)}), cfg)


def test_layout_mismatch_names_first_tensor_and_both_shapes(torch_run):
    chunks, layout = jb.restore_chunks(torch_run.root, jb.make_mesh(2))
    wrong = dataclasses.replace(jb.GPT_CONFIGS["gpt-tiny"], block_size=64)  # wpe is (64, 64), saved (128, 64)
    with pytest.raises(
        ShapeMismatchError, match=r"'transformer\.wpe\.weight': expected \(64, 64\), got \(128, 64\)"
    ) as e:
        jb.gpt_from_chunks(chunks, layout, wrong)
    assert "transformer/wpe/embedding" in str(e.value)
    with pytest.raises(ShapeMismatchError, match=r"transformer\.wpe\.weight"):
        jb.restore_gpt(torch_run.root, jb.make_mesh(1), config=wrong)
    deeper = dataclasses.replace(jb.GPT_CONFIGS["gpt-tiny"], n_layer=3)
    with pytest.raises(CheckpointError, match=r"no tensor 'transformer\.h\.2\.ln_1\.weight'"):
        jb.gpt_from_chunks(chunks, layout, deeper)
    extra = ChunkLayout.build([*jb.param_specs(torch_run.config), TensorSpec("extra.w", (3,))], 30_000, 2)
    with pytest.raises(CheckpointError, match="'extra.w'.*not a parameter"):
        jb.check_layout(extra, torch_run.config)


def test_restore_gpt_needs_a_config(torch_run, tmp_path):
    chunks, layout = jb.restore_chunks(torch_run.root, jb.make_mesh(1))
    jb.save_checkpoint(tmp_path, chunks, layout, step=0)  # no model_config recorded
    with pytest.raises(ConfigError, match="stores no model_config; pass config="):
        jb.restore_gpt(tmp_path, jb.make_mesh(1))
    model, _ = jb.restore_gpt(tmp_path, jb.make_mesh(1), config="gpt-tiny")
    assert model.config == jb.GPT_CONFIGS["gpt-tiny"]


def test_both_engines_start_from_the_numpy_initialization():
    """torch's GPT and the JAX engine load chunkzero.job.init's weights of the run's seed (no torch in JAX's)."""
    from chunkzero.job.init import gpt_initial_params
    from chunkzero.train_config import TrainConfig
    from jax_backend.train.adapter import initial_params, run_program

    cfg = TrainConfig(model="gpt-tiny", seed=11)
    cfg.model_kind = "gpt"
    want = gpt_initial_params(tgpt.GPT_CONFIGS["gpt-tiny"], 11)
    torch_sd = tgpt.GPT(tgpt.GPT_CONFIGS["gpt-tiny"], seed=11).state_dict()
    jax_init = initial_params(cfg, run_program(cfg).specs)
    for name, value in want.items():
        np.testing.assert_array_equal(torch_sd[name].numpy(), value)
        np.testing.assert_array_equal(jax_init[name], value)
    assert not np.array_equal(gpt_initial_params(tgpt.GPT_CONFIGS["gpt-tiny"], 12)["transformer.wte.weight"],
                              want["transformer.wte.weight"])


def test_jax_sampler_is_the_models_greedy_continuation():
    """With top-k 1 the JAX sampler's tokens are the argmax of the unpadded forward at each length (the right
    padding of its fixed window is never read), also once the context slides past the window; seeded alike."""
    from chunkzero.job.init import gpt_initial_params
    from jax_backend.blocks import gpt_program
    from jax_backend.train.sampling import sample_ids

    cfg = tgpt.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    program = gpt_program(cfg)
    params = gpt_initial_params(cfg, 3)
    prompt, window = [5, 9, 2], 6
    ids = sample_ids(program, params, prompt, 6, window=window, seed=0, top_k=1)
    want = list(prompt)
    for _ in range(6):
        ctx = np.asarray([want[-window:]], np.int32)
        want.append(int(np.argmax(np.asarray(program.logits(params, ctx))[0, -1])))
    assert ids == want
    a = sample_ids(program, params, prompt, 8, window=window, seed=1)
    assert a == sample_ids(program, params, prompt, 8, window=window, seed=1) and len(a) == 11
