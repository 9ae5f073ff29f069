"""The model a run trains (``--model``), as far as the job needs it without a framework: its kind and
block size, its tensors, its tokenizer and its corpus.

``--model`` is a byte-level GPT by name (:data:`chunkzero.configs.GPT_CONFIGS`) or a local Hugging Face
causal-LM directory, read offline: its ``config.json`` as JSON (``transformers.AutoConfig`` imports
torch), its tokenizer through :class:`chunkzero.job.data.HFTokenizer`. Each engine builds the model
itself (``torch_backend.train.models.build_module``, ``jax_backend.train.adapter``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from chunkzero.configs import GPT_CONFIGS, HF_LLAMA_DEFAULTS, ModelConfig, hf_llama_config, model_specs
from chunkzero.errors import ConfigError
from chunkzero.layout import TensorSpec
from chunkzero.train_config import TrainConfig

from . import data as data_mod

GPT2_DEFAULTS = {"n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                 "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "tie_word_embeddings": True}
"""``transformers.GPT2Config``'s defaults of the fields the job reads, for a ``config.json`` that omits them."""


def is_hf_dir(model: str) -> bool:
    return Path(model).is_dir()


def hf_config(model_dir: str) -> dict:
    """The Hugging Face config of a local model directory: its ``config.json`` as a dict (GPT-2's defaults
    filled in for the fields :data:`GPT2_DEFAULTS` names).

    Raises:
        ConfigError: no config.json, or one that is not a JSON object with a ``model_type``.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model directory {model_dir} has no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--model {model_dir}: cannot read its config.json: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"--model {model_dir}: cannot read its config.json: Unrecognized model (no \"model_type\")")
    return {**GPT2_DEFAULTS, **config} if config["model_type"] == "gpt2" else config


def check_hf_weights(model_dir: str, *, safetensors_only: bool = False) -> None:
    """A Hugging Face ``--model`` directory must hold the weights a run starts from: ``*.safetensors`` (a file,
    or shards with their index), or, unless ``safetensors_only`` (the JAX engine reads safetensors with numpy),
    ``pytorch_model*.bin``. Checked before any worker starts, which would fail loading them.

    Raises:
        ConfigError: none of them is there.
    """
    d = Path(model_dir)
    patterns = ("*.safetensors",) if safetensors_only else ("*.safetensors", "pytorch_model*.bin")
    if not any(any(d.glob(p)) for p in patterns):
        raise ConfigError(f"--model directory {model_dir} holds no weights ({' or '.join(patterns)}): a run starts "
                          "from the model's saved weights")


def hf_has_tokenizer(model_dir: str) -> bool:
    return any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer.model"))


def model_block_size(model: str) -> tuple[str, int, int]:
    """``(kind, block_size, vocab_size)`` of ``--model``; kind is ``"gpt"`` or ``"hf"``.

    Raises:
        ConfigError: an unknown name (listing the known ones) or an unreadable directory.
    """
    if is_hf_dir(model):
        c = hf_config(model)
        block = c.get("n_positions") or c.get("max_position_embeddings") or 1 << 30
        if not isinstance(c.get("vocab_size"), int):
            raise ConfigError(f"--model {model}: its config.json has no integer vocab_size")
        return "hf", int(block), int(c["vocab_size"])
    if model in GPT_CONFIGS:
        c = GPT_CONFIGS[model]
        return "gpt", c.block_size, c.vocab_size
    if os.sep in model or "/" in model or model.startswith("."):
        if Path(model).exists():
            raise ConfigError(f"--model {model} is a file: pass a Hugging Face model directory (config.json + "
                              f"safetensors) or one of {', '.join(GPT_CONFIGS)}")
        raise ConfigError(f"--model directory {model} does not exist")
    hint = (f" ({model} is a size-only shape of chunkzero layout; train a Hugging Face model from its directory)"
            if model.startswith("hf-") or model == "llama-1b" else "")
    raise ConfigError(f"unknown model {model!r}; known: {', '.join(GPT_CONFIGS)}, "
                      f"or a local Hugging Face model directory (config.json + safetensors){hint}")


def model_tensor_specs(cfg: TrainConfig) -> list[TensorSpec]:
    """The model's parameters as :class:`chunkzero.TensorSpec` (names in ``named_parameters()`` order, tied
    names as aliases, shapes) from its config alone: a byte-level GPT, a Hugging Face GPT-2 directory
    (``Conv1D`` ``(in, out)`` weights) or a Llama-family one (``model_type`` llama, mistral, qwen2:
    :func:`chunkzero.configs.hf_llama_config`). ``cfg.model_kind`` must be resolved.

    Raises:
        ConfigError: a Hugging Face model of another ``model_type`` (its engine gives its own specs).
    """
    if cfg.model_kind != "hf":
        return model_specs(cfg.model)
    c = hf_config(cfg.model)
    if c["model_type"] in HF_LLAMA_DEFAULTS:
        return model_specs(hf_llama_config(c))
    if c["model_type"] != "gpt2":
        raise ConfigError(f"--model {cfg.model}: the tensors of a {c['model_type']!r} model come from its engine")
    shape = ModelConfig("hf-gpt2", c["vocab_size"], c["n_positions"], c["n_layer"], c["n_head"], c["n_embd"],
                        c.get("n_inner") or 4 * c["n_embd"], tie_embeddings=bool(c["tie_word_embeddings"]))
    return model_specs(shape)


def make_tokenizer(cfg: TrainConfig, vocab_size: int):
    """Bytes for the byte-level GPTs; the model's own tokenizer for a Hugging Face directory that has one.

    Raises:
        ConfigError: a Hugging Face model without a tokenizer whose vocabulary is smaller than 256.
    """
    if cfg.model_kind == "hf" and hf_has_tokenizer(cfg.model):
        return data_mod.HFTokenizer(cfg.model)
    if vocab_size < 256:
        raise ConfigError(f"--model {cfg.model} has no tokenizer and a vocabulary of {vocab_size} < 256, "
                          "so it cannot read byte tokens; give a tokenizer or a .bin token file")
    return data_mod.ByteTokenizer()


def load_run_corpus(cfg: TrainConfig) -> data_mod.Corpus:
    """The corpus of ``--data`` tokenized for ``--model`` (:func:`chunkzero.job.data.load_corpus`).

    Raises:
        ConfigError / DataError: naming the model or the path at fault.
    """
    _, _, vocab = model_block_size(cfg.model)
    return data_mod.load_corpus(cfg.data, seq_len=cfg.seq_len, tokenizer=make_tokenizer(cfg, vocab),
                                vocab_size=vocab, val_fraction=cfg.val_fraction)
