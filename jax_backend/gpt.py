"""A Flax NNX GPT, the same model as :class:`torch_backend.train.gpt.GPT` (same configuration, same math).

GPT-2 architecture as in nanoGPT (Karpathy, https://github.com/karpathy/nanoGPT): learned token and
position embeddings, pre-LayerNorm blocks of causal self-attention and a tanh-GELU MLP, a final
LayerNorm, and an output head tied to the token embedding (Press & Wolf 2017) computed with
``wte.attend``. Shapes: ``idx`` is ``int[B, T]`` of token ids (``T <= block_size``); logits are
``float32[B, T, vocab_size]``.

Both backends take the one :class:`chunkzero.configs.GPTConfig` of the framework-free core. The
module tree repeats the torch model's (``transformer.wte``, ``transformer.h.0.attn.c_attn``, …), so
torch parameter names map onto Flax state paths by a renaming rule: :mod:`jax_backend.convert` holds
it, with the loaders from torch parameters, chunk arrays, checkpoints and Hugging Face GPT-2.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from chunkzero.configs import GPT_CONFIGS, GPTConfig, as_gpt_config, gpt_config  # noqa: F401 (re-exported)
from chunkzero.errors import ConfigError


def _normal(std: float):
    return jax.nn.initializers.normal(stddev=std)


def _dropout(config: GPTConfig, rngs: nnx.Rngs) -> nnx.Dropout:
    return nnx.Dropout(config.dropout, rngs=rngs if config.dropout > 0 else None)


def _layer_norm(config: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # use_fast_variance=False: E[(x-mean)^2] like torch, not E[x^2]-mean^2.
    return nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_eps, use_bias=config.bias,
                         use_fast_variance=False, rngs=rngs)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention: ``c_attn`` (C -> 3C) gives q, k, v; softmax(q kᵀ/√d) v; ``c_proj``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        if config.n_embd % config.n_head:
            raise ConfigError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
        self.n_head = config.n_head
        std, proj_std = 0.02, 0.02 / np.sqrt(2 * config.n_layer)
        self.c_attn = nnx.Linear(
            config.n_embd, 3 * config.n_embd, use_bias=config.bias, kernel_init=_normal(std), rngs=rngs
        )
        self.c_proj = nnx.Linear(
            config.n_embd, config.n_embd, use_bias=config.bias, kernel_init=_normal(proj_std), rngs=rngs
        )
        self.resid_dropout = _dropout(config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        B, T, C = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        shape = (B, T, self.n_head, C // self.n_head)  # dot_product_attention takes [B, T, N, H]
        y = jax.nn.dot_product_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), is_causal=True)
        return self.resid_dropout(self.c_proj(y.reshape(B, T, C)))


class MLP(nnx.Module):
    """``c_fc`` (C -> 4C), tanh-approximate GELU, ``c_proj`` (4C -> C)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        std, proj_std = 0.02, 0.02 / np.sqrt(2 * config.n_layer)
        self.c_fc = nnx.Linear(
            config.n_embd, 4 * config.n_embd, use_bias=config.bias, kernel_init=_normal(std), rngs=rngs
        )
        self.c_proj = nnx.Linear(
            4 * config.n_embd, config.n_embd, use_bias=config.bias, kernel_init=_normal(proj_std), rngs=rngs
        )
        self.dropout = _dropout(config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True)))


class Block(nnx.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.ln_1 = _layer_norm(config, rngs)
        self.attn = CausalSelfAttention(config, rngs=rngs)
        self.ln_2 = _layer_norm(config, rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nnx.Module):
    """The torch model's ``transformer`` ModuleDict: ``wte``, ``wpe``, ``drop``, ``h``, ``ln_f``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(config.vocab_size, config.n_embd, embedding_init=_normal(0.02), rngs=rngs)
        self.wpe = nnx.Embed(config.block_size, config.n_embd, embedding_init=_normal(0.02), rngs=rngs)
        self.drop = _dropout(config, rngs)
        self.h = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layer)])
        self.ln_f = _layer_norm(config, rngs)


class GPT(nnx.Module):
    """GPT-2 in Flax NNX, the same model as ``torch_backend.train.gpt.GPT``.

    Args:
        config: a :class:`GPTConfig`, a dict of its fields or a name in :data:`GPT_CONFIGS`
            (:func:`chunkzero.configs.as_gpt_config`).
        rngs: initializer randomness (same distributions as torch: N(0, 0.02), residual projections
            N(0, 0.02/√(2·n_layer)), zero biases, unit LayerNorm scales; not the same values).
    """

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        self.config = as_gpt_config(config)
        self.transformer = Transformer(self.config, rngs=rngs)

    def __call__(self, idx: jax.Array) -> jax.Array:
        """Logits ``float32[B, T, vocab_size]`` for token ids ``int[B, T]``.

        Raises:
            ConfigError: ``T`` exceeds ``block_size``.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ConfigError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(jnp.arange(T)))
        for block in tr.h:
            x = block(x)
        return tr.wte.attend(tr.ln_f(x))  # tied output head: x @ wteᵀ

    def num_params(self) -> int:
        """Parameters counted once (the tied head has none of its own)."""
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(self, nnx.Param)))


def init_gpt(config: Any, seed: int = 0) -> GPT:
    """A freshly initialized :class:`GPT` (initializers compiled as one XLA program, much faster
    than op-by-op on CPU)."""
    config = as_gpt_config(config)
    return nnx.jit(lambda: GPT(config, rngs=nnx.Rngs(seed)))()


@nnx.jit
def logits(model: GPT, idx: jax.Array) -> jax.Array:
    """Jitted ``model(idx)``: ``float32[B, T, vocab_size]``."""
    return model(idx)


__all__ = ["GPT", "GPT_CONFIGS", "Block", "CausalSelfAttention", "GPTConfig", "MLP", "Transformer", "gpt_config",
           "init_gpt", "logits"]
