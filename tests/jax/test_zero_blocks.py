"""The staged models the ZeRO-3 step runs (jax_backend.blocks): the GPT program computes what the Flax GPT
computes, and the Llama program what Hugging Face ``LlamaForCausalLM`` computes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from chunkzero.configs import ModelConfig, model_specs
from chunkzero.errors import ConfigError
from jax_backend.blocks import gpt_program, gpt_reference_loss, llama_program, model_program, random_batch
from jax_backend.gpt import gpt_config

FP32_RTOL = 1e-5


def test_gpt_program_equals_flax_gpt():
    program = gpt_program(gpt_config("gpt-tiny"))
    params = program.init(3)
    batch = random_batch(program, 2, 16, seed=5)
    ours = float(program.loss(params, batch))
    ref = float(gpt_reference_loss(program.config)(params, batch))
    assert abs(ours - ref) <= FP32_RTOL * abs(ref)
    assert [s.name for s in program.stages][:2] == ["embed", "h.0"] and program.stages[-1].name == "head"
    assert "transformer.wte.weight" in program.stages[-1].tensors  # the tied head reads the embedding


def test_llama_program_equals_hugging_face():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = ModelConfig("llama", 64, 0, 2, 4, 32, 48, n_kv_head=2, tie_embeddings=False)
    program = llama_program(cfg, rms_norm_eps=1e-5)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert [s.name for s in program.specs] == list(sd)  # HF registration order, what model_specs lists
    batch = random_batch(program, 2, 12, seed=1)
    with torch.no_grad():
        logits = hf(torch.tensor(np.array(batch["idx"]), dtype=torch.long)).logits
        ref = float(
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), torch.tensor(np.array(batch["targets"]), dtype=torch.long).flatten()
            )
        )
    ours = float(program.loss({k: jnp.asarray(v) for k, v in sd.items()}, batch))
    assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)


def test_model_program_by_config_name():
    p = model_program("hf-gpt2")
    assert p.vocab_size == 50257 and p.max_seq_len == 1024
    assert [s.numel for s in p.specs] == [s.numel for s in model_specs("hf-gpt2")]  # same layout as HF GPT-2
    assert [s.name for s in model_program("llama-1b").specs] == [s.name for s in model_specs("llama-1b")]
    with pytest.raises(ConfigError, match="unknown model config 'gpt5'"):
        model_program("gpt5")
