"""The model a run trains on the torch engine: :func:`build_module` builds ``--model`` (a byte-level GPT of
:mod:`torch_backend.train.gpt` by name, or a local Hugging Face causal-LM directory loaded offline) on CPU in
fp32, the same on every rank; its loss and its sample. What the job reads of the model without torch (kind,
block size, tokenizer, corpus) is :mod:`chunkzero.job.models`'.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from chunkzero.errors import ConfigError
from chunkzero.job import data as data_mod
from chunkzero.job.report import prompt_ids
from chunkzero.train_config import TrainConfig

from .gpt import GPT, GPT_CONFIGS, generate


def build_module(cfg: TrainConfig) -> nn.Module:
    """The model to train, on CPU in fp32, the same on every rank (with ``--activation-checkpointing``, its
    blocks checkpointed: :func:`checkpoint_blocks`): a byte-level GPT with the numpy
    initialization of ``cfg.seed`` (:func:`chunkzero.job.init.gpt_initial_params`, the JAX engine's too), or a
    Hugging Face directory's weights (any tensor they lack drawn after ``torch.manual_seed(cfg.seed)``).

    Raises:
        ConfigError: a Hugging Face directory whose model cannot be loaded.
    """
    if cfg.model_kind == "hf":
        torch.manual_seed(cfg.seed)
        from transformers import AutoModelForCausalLM

        try:
            module = AutoModelForCausalLM.from_pretrained(cfg.model, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - re-raised as ConfigError
            raise ConfigError(f"--model {cfg.model}: cannot load the model: {str(e).splitlines()[0]}") from None
        module = module.float()  # fp32 master values whatever the stored dtype; ZeroDDP casts for compute
    else:
        module = GPT(GPT_CONFIGS[cfg.model], seed=cfg.seed)
    return checkpoint_blocks(module) if cfg.activation_checkpointing else module


def build_meta_module(cfg: TrainConfig) -> nn.Module:
    """``cfg.model`` on the meta device (no memory, no weights read); ``cfg.model_kind`` must be resolved."""
    with torch.device("meta"):
        if cfg.model_kind == "hf":
            from transformers import AutoConfig, AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model, local_files_only=True))
        return GPT(GPT_CONFIGS[cfg.model])


def transformer_blocks(module: nn.Module) -> nn.ModuleList:
    """The model's stack of blocks: the longest ``nn.ModuleList`` in it (``transformer.h`` of the byte-level
    GPT and HF GPT-2, ``model.layers`` of Llama).

    Raises:
        ConfigError: the model has no ``nn.ModuleList``.
    """
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ConfigError("--activation-checkpointing: the model has no nn.ModuleList of blocks to checkpoint")
    return max(lists, key=len)


def checkpoint_blocks(module: nn.Module) -> nn.Module:
    """Recompute each block's activations in backward (``torch.utils.checkpoint``, non-reentrant): each
    block's ``forward`` is wrapped in place; returns ``module``."""
    from torch.utils.checkpoint import checkpoint

    for block in transformer_blocks(module):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return module


def logits_of(output) -> torch.Tensor:
    """Logits ``[B, T, V]`` from a model's output (a tensor, or a Hugging Face ``ModelOutput``)."""
    return getattr(output, "logits", output)


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token, fp32 scalar) of a model's ``output`` (logits
    ``[B, T, V]``, any float dtype, or a ``ModelOutput``) against ``targets`` (``int64[B, T]``)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def sample_text(model: nn.Module, corpus: data_mod.Corpus, cfg: TrainConfig, device: torch.device) -> tuple[str, str]:
    """``(prompt, text)``: the prompt (:func:`chunkzero.job.report.prompt_ids`) and the prompt followed by
    ``cfg.sample_tokens`` tokens sampled from ``model``. Every rank must call it (each forward gathers chunks);
    all ranks sample the same tokens (same seed)."""
    tok = corpus.tokenizer
    ids = prompt_ids(corpus, cfg)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    model.eval()
    out = generate(model, idx, cfg.sample_tokens, block_size=min(cfg.block_size, cfg.seq_len),
                   temperature=cfg.temperature, top_k=cfg.top_k, generator=gen)
    model.train()
    return tok.decode(ids), tok.decode(out[0].tolist())
