"""Size-only model configurations: the ordered tensor list of a model, without any framework.

Each config yields ``list[TensorSpec]`` in parameter order (module registration order, what
``model.named_parameters()`` returns, tied weights once with the other name as an alias), so the
chunk-size search and the cost model can be run on models far too big to instantiate here.

Registered names (:data:`MODEL_CONFIGS`), one vocabulary with ``chunkzero train --model``:

- every name of :data:`GPT_CONFIGS` — ``"gpt-tiny"``, ``"gpt-mini"``, ``"gpt-small"``, ``"gpt2"``,
  ``"gpt2-medium"`` — the byte-level nanoGPT-style model of ``torch_backend.train.gpt`` that ``chunkzero train``
  builds under that name (vocab 256, ``nn.Linear`` weights ``(out, in)``, biases, tied head); ``"gpt2"``
  is the GPT-2 124M shape with the 256-byte vocabulary (86.0M parameters);
- ``"hf-gpt2"`` — Hugging Face GPT-2 small (Radford et al. 2019): vocab 50257, 1024 positions,
  12 layers, d 768, 12 heads; 124,439,808 parameters. HF parameter names; HF ``Conv1D`` weights are
  ``(in, out)`` (``attn.c_attn.weight`` is ``(768, 2304)``); ``lm_head.weight`` is an alias of
  ``transformer.wte.weight``;
- ``"hf-gpt2-medium"`` — the same with 24 layers, d 1024, 16 heads; 354,823,168 parameters;
- ``"llama-1b"`` — a Llama-style 1B config (Touvron et al. 2023; HF ``LlamaForCausalLM`` names):
  vocab 32000, d 2048, 16 layers, 32 heads and 32 key/value heads (no GQA), SwiGLU intermediate
  5632, RMSNorm (weight only, no biases), untied ``lm_head``; 953,223,168 parameters;
- ``"hf-gpt2-xl"`` — HF GPT-2 XL: 48 layers, d 1600, 25 heads; 1,557,611,200 parameters;
- ``"llama-7b"`` — the Llama 2 7B shape: d 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000;
  6,738,415,616 parameters;
- ``"llama-70b"`` — the Llama 2 70B shape: d 8192, 80 layers, 64 heads with 8 key/value heads (GQA),
  intermediate 28672, vocab 32000; 68,976,648,192 parameters.

The last three are for the cost model only (``chunkzero layout --nodes``): far too big to build here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .errors import ConfigError
from .layout import TensorSpec


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters that determine a model's tensor shapes.

    Attributes:
        family: ``"hf-gpt2"`` (HF GPT-2, Conv1D ``(in, out)`` weights), ``"nanogpt"`` (nn.Linear
            ``(out, in)`` weights) or ``"llama"`` (HF Llama).
        vocab_size: token vocabulary.
        n_positions: learned positions (GPT families); Llama's ``max_position_embeddings`` (RoPE, no tensor).
        n_layer, n_head, n_embd: depth, attention heads, hidden size ``d``.
        n_kv_head: key/value heads (Llama; equals ``n_head`` when there is no GQA).
        intermediate_size: MLP hidden size (``4·d`` for GPT-2; Llama's SwiGLU width).
        tie_embeddings: the output head shares the token-embedding matrix.
        head_dim: Llama's per-head width (0: ``n_embd // n_head``).
        qkv_bias, o_bias, mlp_bias: Llama's projection biases: on ``q/k/v_proj``, on ``o_proj``, on the
            three MLP projections (Hugging Face ``attention_bias`` sets the first two; Qwen2 has the first only).
    """

    family: str
    vocab_size: int
    n_positions: int
    n_layer: int
    n_head: int
    n_embd: int
    intermediate_size: int
    n_kv_head: int = 0
    tie_embeddings: bool = True
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @property
    def hidden_size(self) -> int:
        """``d``; Gemini's recommended search interval (``hidden_dim``)."""
        return self.n_embd


MODEL_CONFIGS: dict[str, ModelConfig] = {
    "hf-gpt2": ModelConfig("hf-gpt2", 50257, 1024, 12, 12, 768, 4 * 768),
    "hf-gpt2-medium": ModelConfig("hf-gpt2", 50257, 1024, 24, 16, 1024, 4 * 1024),
    "llama-1b": ModelConfig("llama", 32000, 0, 16, 32, 2048, 5632, n_kv_head=32, tie_embeddings=False),
    "hf-gpt2-xl": ModelConfig("hf-gpt2", 50257, 1024, 48, 25, 1600, 4 * 1600),
    "llama-7b": ModelConfig("llama", 32000, 0, 32, 32, 4096, 11008, n_kv_head=32, tie_embeddings=False),
    "llama-70b": ModelConfig("llama", 32000, 0, 80, 64, 8192, 28672, n_kv_head=8, tie_embeddings=False),
}
"""Every named size-only model config (the one registry of names)."""


def model_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` called ``name``.

    Raises:
        ConfigError: naming the unknown model and listing the known ones.
    """
    return _lookup(MODEL_CONFIGS, name, "model config")


def model_specs(name: str | ModelConfig, dtype: str = "float32") -> list[TensorSpec]:
    """The tensors of model ``name`` in parameter order, as :class:`TensorSpec` of ``dtype``.

    Args:
        name: a key of :data:`MODEL_CONFIGS` or a :class:`ModelConfig`.
        dtype: dtype given to every tensor (``"float32"``, ``"bf16"`` …).

    Returns:
        One spec per unique tensor; a tied head is the alias ``lm_head.weight`` of
        ``transformer.wte.weight``.

    Raises:
        ConfigError: unknown name, family or dtype.
    """
    cfg = name if isinstance(name, ModelConfig) else model_config(name)
    builders = {"hf-gpt2": _gpt_specs, "nanogpt": _gpt_specs, "llama": _llama_specs}
    try:
        build = builders[cfg.family]
    except KeyError:
        raise ConfigError(f"unknown model family {cfg.family!r}; known: {', '.join(builders)}") from None
    return [TensorSpec(n, s, dtype, aliases) for n, s, aliases in build(cfg)]


def param_numel(name: str | ModelConfig) -> int:
    """Parameters of the model (tied tensors counted once)."""
    return sum(s.numel for s in model_specs(name))


def _linear(prefix: str, cfg: ModelConfig, d_in: int, d_out: int, bias: bool = True):
    """A projection ``d_in -> d_out``: HF Conv1D stores ``(in, out)``, nn.Linear ``(out, in)``."""
    shape = (d_in, d_out) if cfg.family == "hf-gpt2" else (d_out, d_in)
    out = [(f"{prefix}.weight", shape, ())]
    if bias:
        out.append((f"{prefix}.bias", (d_out,), ()))
    return out


def _gpt_specs(cfg: ModelConfig):
    d = cfg.n_embd
    head = ("lm_head.weight",) if cfg.tie_embeddings else ()
    specs = [
        ("transformer.wte.weight", (cfg.vocab_size, d), head),
        ("transformer.wpe.weight", (cfg.n_positions, d), ()),
    ]
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}"
        specs += [(f"{p}.ln_1.weight", (d,), ()), (f"{p}.ln_1.bias", (d,), ())]
        specs += _linear(f"{p}.attn.c_attn", cfg, d, 3 * d)
        specs += _linear(f"{p}.attn.c_proj", cfg, d, d)
        specs += [(f"{p}.ln_2.weight", (d,), ()), (f"{p}.ln_2.bias", (d,), ())]
        specs += _linear(f"{p}.mlp.c_fc", cfg, d, cfg.intermediate_size)
        specs += _linear(f"{p}.mlp.c_proj", cfg, cfg.intermediate_size, d)
    specs += [("transformer.ln_f.weight", (d,), ()), ("transformer.ln_f.bias", (d,), ())]
    if not cfg.tie_embeddings:
        specs.append(("lm_head.weight", (cfg.vocab_size, d), ()))
    return specs


def _llama_specs(cfg: ModelConfig):
    d, ff = cfg.n_embd, cfg.intermediate_size
    if not cfg.head_dim and d % cfg.n_head:
        raise ConfigError(f"n_embd {d} is not divisible by n_head {cfg.n_head}")
    hd = cfg.head_dim or d // cfg.n_head
    q, kv = cfg.n_head * hd, (cfg.n_kv_head or cfg.n_head) * hd
    head = ("lm_head.weight",) if cfg.tie_embeddings else ()
    specs = [("model.embed_tokens.weight", (cfg.vocab_size, d), head)]
    for i in range(cfg.n_layer):  # HF LlamaDecoderLayer registers self_attn, mlp, then the two norms
        p = f"model.layers.{i}"
        specs += _linear(f"{p}.self_attn.q_proj", cfg, d, q, bias=cfg.qkv_bias)
        specs += _linear(f"{p}.self_attn.k_proj", cfg, d, kv, bias=cfg.qkv_bias)
        specs += _linear(f"{p}.self_attn.v_proj", cfg, d, kv, bias=cfg.qkv_bias)
        specs += _linear(f"{p}.self_attn.o_proj", cfg, q, d, bias=cfg.o_bias)
        specs += _linear(f"{p}.mlp.gate_proj", cfg, d, ff, bias=cfg.mlp_bias)
        specs += _linear(f"{p}.mlp.up_proj", cfg, d, ff, bias=cfg.mlp_bias)
        specs += _linear(f"{p}.mlp.down_proj", cfg, ff, d, bias=cfg.mlp_bias)
        specs += [(f"{p}.input_layernorm.weight", (d,), ()), (f"{p}.post_attention_layernorm.weight", (d,), ())]
    specs.append(("model.norm.weight", (d,), ()))
    if not cfg.tie_embeddings:
        specs.append(("lm_head.weight", (cfg.vocab_size, d), ()))
    return specs


HF_LLAMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096},
}
"""The Llama-family ``model_type`` s whose tensors :func:`hf_llama_config` reads, each with the defaults of
its ``transformers`` config class that differ from the family's (``hidden_act`` silu, ``rms_norm_eps``
1e-6, untied head, ``num_key_value_heads`` = heads, no biases) for a ``config.json`` that omits them."""


def hf_llama_config(config: Mapping[str, Any]) -> ModelConfig:
    """The tensor shapes of a Hugging Face Llama-family model (``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM``) from its ``config.json`` as a dict, as ``named_parameters()`` lists them.

    Raises:
        ConfigError: another ``model_type``, a missing or non-integer size field, or heads that key/value heads
            do not divide (named).
    """
    kind = config.get("model_type")
    if kind not in HF_LLAMA_DEFAULTS:
        raise ConfigError(f"model_type {kind!r} is not of the Llama family ({', '.join(HF_LLAMA_DEFAULTS)})")
    c = {**HF_LLAMA_DEFAULTS[kind], **config}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(c.get(key), int):
            raise ConfigError(f"a {kind!r} config.json needs an integer {key}, got {c.get(key)!r}")
    heads, llama = c["num_attention_heads"], kind == "llama"  # Mistral has no bias fields, Qwen2 fixed ones
    attention_bias = kind == "qwen2" or (llama and bool(c.get("attention_bias")))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    return ModelConfig("llama", c["vocab_size"], int(c["max_position_embeddings"]), c["num_hidden_layers"], heads,
                       c["hidden_size"], c["intermediate_size"], n_kv_head=kv_heads,
                       tie_embeddings=bool(c.get("tie_word_embeddings", False)), head_dim=int(c.get("head_dim") or 0),
                       qkv_bias=attention_bias, o_bias=attention_bias and kind != "qwen2",
                       mlp_bias=llama and bool(c.get("mlp_bias")))


_BLOCK_RE = re.compile(r"^(.*?\.(?:h|layers)\.\d+)\.")


def transformer_block_unit(name: str) -> str:
    """The FSDP wrapping unit of tensor ``name``: its transformer block (``"transformer.h.3"``,
    ``"model.layers.3"``) or ``"root"`` for everything outside the blocks (embeddings, final norm,
    head) — the usual FSDP2 recipe of ``fully_shard`` on every block, then on the root module."""
    m = _BLOCK_RE.match(name)
    return m.group(1) if m else "root"


__all__ = ["HF_LLAMA_DEFAULTS", "MODEL_CONFIGS", "ModelConfig", "hf_llama_config", "model_config", "model_specs",
           "param_numel", "transformer_block_unit"]


# ---------------------------------------------------------------------------- the byte-level GPT
@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of the byte-level GPT that both backends build (``torch_backend.train.gpt.GPT`` and
    ``jax_backend.gpt.GPT``). ``vocab_size`` 256 means byte-level tokens; ``block_size`` is the
    longest sequence in tokens; ``layer_norm_eps`` is LayerNorm's epsilon."""

    block_size: int = 256
    vocab_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True
    layer_norm_eps: float = 1e-5

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GPTConfig:
        """Raises: ConfigError naming unknown keys."""
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown GPT config keys: {sorted(unknown)}")
        return cls(**d)


GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=64),
    "gpt-mini": GPTConfig(block_size=256, n_layer=2, n_head=4, n_embd=256),
    "gpt-small": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024),
}
"""Byte-level GPT sizes by name (GPT-2 shapes with a 256-token vocabulary) — the models
``chunkzero train --model`` builds; :data:`MODEL_CONFIGS` has each of them under the same name (the
Hugging Face GPT-2 sizes are ``"hf-gpt2"`` and ``"hf-gpt2-medium"`` there)."""


def gpt_config(name: str) -> GPTConfig:
    """The :class:`GPTConfig` called ``name``.

    Raises:
        ConfigError: naming the unknown model and listing the known ones.
    """
    return _lookup(GPT_CONFIGS, name, "model")


def as_gpt_config(config: Any) -> GPTConfig:
    """A :class:`GPTConfig` from a GPTConfig, a dict, a name, or any object with ``to_dict()``.

    Raises:
        ConfigError: unknown name or keys, or an unsupported type.
    """
    if isinstance(config, GPTConfig):
        return config
    if isinstance(config, str):
        return gpt_config(config)
    if isinstance(config, Mapping):
        return GPTConfig.from_dict(config)
    if hasattr(config, "to_dict"):
        return GPTConfig.from_dict(config.to_dict())
    raise ConfigError(f"expected a GPTConfig, a dict or a model name, got {type(config).__name__}")


def _lookup(registry: Mapping[str, Any], name: str, what: str) -> Any:
    try:
        return registry[name]
    except KeyError:
        raise ConfigError(f"unknown {what} {name!r}; known: {', '.join(registry)}") from None


# The byte-level GPTs' shapes, size-only (nn.Linear weights, tied head), from the one GPT_CONFIGS table:
# every name `chunkzero train --model` accepts, with the same meaning.
MODEL_CONFIGS.update({
    name: ModelConfig("nanogpt", c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd, 4 * c.n_embd)
    for name, c in GPT_CONFIGS.items()
})
