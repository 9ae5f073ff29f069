"""Size-only model configs: parameter counts, names and shapes."""

from __future__ import annotations

import pytest

from chunkzero import ChunkLayout, ConfigError
from chunkzero.configs import MODEL_CONFIGS, model_config, model_specs, param_numel


def nanogpt_numel(vocab, block, n_layer, d):
    """nanoGPT with biases and a tied head: per block 12d² + 13d, plus embeddings and ln_f."""
    return n_layer * (12 * d * d + 13 * d) + vocab * d + block * d + 2 * d


@pytest.mark.parametrize("name,expected", [
    ("hf-gpt2", 124_439_808),  # Hugging Face GPT2LMHeadModel.num_parameters()
    ("hf-gpt2-medium", 354_823_168),
    # 2 · 32000·2048 + 16 · (4·2048² + 3·2048·5632 + 2·2048) + 2048
    ("llama-1b", 2 * 32000 * 2048 + 16 * (4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048) + 2048),
    ("gpt-tiny", nanogpt_numel(256, 128, 2, 64)),
    ("gpt-small", nanogpt_numel(256, 256, 6, 384)),
    ("gpt-mini", nanogpt_numel(256, 256, 2, 256)),  # chunkzero train's CPU default: 1,711,104
    ("gpt2", nanogpt_numel(256, 1024, 12, 768)),  # the byte-level GPT-2 shape train builds: 86.0M
])
def test_parameter_counts(name, expected):
    assert param_numel(name) == expected
    assert len({s.name for s in model_specs(name)}) == len(model_specs(name))


def test_gpt2_names_and_hf_conv1d_shapes():
    specs = {s.name: s for s in model_specs("hf-gpt2")}
    assert specs["transformer.wte.weight"].shape == (50257, 768)
    assert specs["transformer.wte.weight"].aliases == ("lm_head.weight",)
    assert specs["transformer.wpe.weight"].shape == (1024, 768)
    assert specs["transformer.h.0.attn.c_attn.weight"].shape == (768, 2304)  # Conv1D (in, out)
    assert specs["transformer.h.11.mlp.c_proj.weight"].shape == (3072, 768)
    assert specs["transformer.h.11.mlp.c_fc.bias"].shape == (3072,)
    assert "lm_head.weight" not in specs
    assert list(specs)[:4] == ["transformer.wte.weight", "transformer.wpe.weight",
                               "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"]
    assert list(specs)[-2:] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert len(specs) == 2 + 12 * 12 + 2


def test_nanogpt_linear_shapes():
    specs = {s.name: s for s in model_specs("gpt-tiny")}
    assert specs["transformer.h.1.attn.c_attn.weight"].shape == (192, 64)  # nn.Linear (out, in)
    assert specs["transformer.h.1.attn.c_proj.weight"].shape == (64, 64)
    assert specs["transformer.h.1.mlp.c_fc.weight"].shape == (256, 64)
    assert specs["transformer.h.1.mlp.c_proj.weight"].shape == (64, 256)
    assert specs["transformer.wpe.weight"].shape == (128, 64)
    assert specs["transformer.wte.weight"].aliases == ("lm_head.weight",)


def test_llama_names_untied():
    specs = {s.name: s for s in model_specs("llama-1b", dtype="bf16")}
    assert specs["model.embed_tokens.weight"].shape == (32000, 2048)
    assert specs["lm_head.weight"].shape == (32000, 2048) and specs["model.embed_tokens.weight"].aliases == ()
    assert specs["model.layers.15.mlp.gate_proj.weight"].shape == (5632, 2048)
    assert specs["model.layers.15.mlp.down_proj.weight"].shape == (2048, 5632)
    assert specs["model.layers.0.input_layernorm.weight"].shape == (2048,)
    assert specs["model.norm.weight"].dtype == "bfloat16"
    assert not any(n.endswith(".bias") for n in specs)
    assert model_config("llama-1b").n_kv_head == 32


def test_specs_build_a_layout_with_aliases():
    layout = ChunkLayout.build(model_specs("gpt-small"), 2**20, 3)
    assert layout.tensor("lm_head.weight") is layout.tensor("transformer.wte.weight")
    assert layout.utilized_numel == param_numel("gpt-small")


def test_unknown_model():
    with pytest.raises(ConfigError, match="'gpt5'.*gpt2"):
        model_specs("gpt5")
    assert set(MODEL_CONFIGS) == {"hf-gpt2", "hf-gpt2-medium", "llama-1b", "hf-gpt2-xl", "llama-7b", "llama-70b",
                                  "gpt-tiny", "gpt-mini", "gpt-small", "gpt2", "gpt2-medium"}


def test_scaling_shapes_have_their_published_sizes():
    """GPT-2 XL 1.5B (Radford et al. 2019), Llama 2 7B and 70B (Touvron et al. 2023; 70B with GQA)."""
    assert param_numel("hf-gpt2-xl") == 1_557_611_200
    assert param_numel("llama-7b") == 6_738_415_616
    assert param_numel("llama-70b") == 68_976_648_192
    specs = {s.name: s for s in model_specs("llama-70b")}
    assert specs["model.layers.79.self_attn.k_proj.weight"].shape == (1024, 8192)


def test_one_vocabulary_with_train():
    """Every ``chunkzero train --model`` name is a size-only config with the shapes train builds: the byte-level
    GPT's (vocab 256), not Hugging Face GPT-2's, which is ``hf-gpt2``."""
    from chunkzero.configs import GPT_CONFIGS

    for name, c in GPT_CONFIGS.items():
        specs = {s.name: s for s in model_specs(name)}
        assert specs["transformer.wte.weight"].shape == (c.vocab_size, c.n_embd) == (256, c.n_embd), name
        assert specs["transformer.wpe.weight"].shape == (c.block_size, c.n_embd), name
    assert param_numel("gpt2") == 86_039_040 != param_numel("hf-gpt2")
