"""The model a run trains (``--model``): a byte-level GPT of :mod:`torch_backend.train.gpt` by name, or a
local Hugging Face causal-LM directory loaded offline, and the tokenizer that goes with it.

:func:`model_block_size` reads only configs (the launcher's checks); :func:`build_module` builds the
module on CPU in fp32, the same on every rank (``torch.manual_seed(cfg.seed)``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from chunkzero.errors import ConfigError
from chunkzero.train_config import TrainConfig

from . import data as data_mod
from .gpt import GPT, GPT_CONFIGS


def is_hf_dir(model: str) -> bool:
    return Path(model).is_dir()


def hf_config(model_dir: str):
    """The Hugging Face config of a local model directory (offline).

    Raises:
        ConfigError: no config.json, or transformers cannot read it.
    """
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"--model directory {model_dir} has no config.json (not a Hugging Face model directory)")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many kinds
        raise ConfigError(f"--model {model_dir}: cannot read its config.json: {str(e).splitlines()[0]}") from None


def hf_has_tokenizer(model_dir: str) -> bool:
    return any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer.model"))


def model_block_size(model: str) -> tuple[str, int, int]:
    """``(kind, block_size, vocab_size)`` of ``--model``; kind is ``"gpt"`` or ``"hf"``.

    Raises:
        ConfigError: an unknown name (listing the known ones) or an unreadable directory.
    """
    if is_hf_dir(model):
        c = hf_config(model)
        block = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None) or 1 << 30
        return "hf", int(block), int(c.vocab_size)
    if model in GPT_CONFIGS:
        c = GPT_CONFIGS[model]
        return "gpt", c.block_size, c.vocab_size
    if os.sep in model or "/" in model or model.startswith("."):
        raise ConfigError(f"--model directory {model} does not exist")
    hint = (f" ({model} is a size-only shape of chunkzero layout; train a Hugging Face model from its directory)"
            if model.startswith("hf-") or model == "llama-1b" else "")
    raise ConfigError(f"unknown model {model!r}; known: {', '.join(GPT_CONFIGS)}, "
                      f"or a local Hugging Face model directory (config.json + safetensors){hint}")


def build_module(cfg: TrainConfig) -> nn.Module:
    """The model to train, on CPU in fp32, initialised from ``torch.manual_seed(cfg.seed)``.

    Raises:
        ConfigError: a Hugging Face directory whose model cannot be loaded.
    """
    torch.manual_seed(cfg.seed)
    if cfg.model_kind == "hf":
        from transformers import AutoModelForCausalLM

        try:
            module = AutoModelForCausalLM.from_pretrained(cfg.model, local_files_only=True)
        except Exception as e:
            raise ConfigError(f"--model {cfg.model}: cannot load the model: {str(e).splitlines()[0]}") from None
        return module.float()  # fp32 master values whatever the stored dtype; ZeroDDP casts for compute
    return GPT(GPT_CONFIGS[cfg.model])


def logits_of(output) -> torch.Tensor:
    """Logits ``[B, T, V]`` from a model's output (a tensor, or a Hugging Face ``ModelOutput``)."""
    return getattr(output, "logits", output)


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token, fp32 scalar) of a model's ``output`` (logits
    ``[B, T, V]``, any float dtype, or a ``ModelOutput``) against ``targets`` (``int64[B, T]``)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


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
    """The corpus of ``--data`` tokenized for ``--model`` (:func:`torch_backend.train.data.load_corpus`).

    Raises:
        ConfigError / DataError: naming the model or the path at fault.
    """
    _, _, vocab = model_block_size(cfg.model)
    return data_mod.load_corpus(cfg.data, seq_len=cfg.seq_len, tokenizer=make_tokenizer(cfg, vocab),
                                vocab_size=vocab, val_fraction=cfg.val_fraction)
