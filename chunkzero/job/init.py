"""The byte-level GPT's initial weights as numpy, the same bytes for both engines.

GPT-2's initialization (nanoGPT's ``_init_weights``): every linear and embedding weight normal with std
0.02, the residual projections (``attn.c_proj``, ``mlp.c_proj``) with std ``0.02 / sqrt(2 · n_layer)``,
biases zero, LayerNorm weights one. Tensor *i* of the parameter order (:func:`chunkzero.configs.model_specs`)
draws from ``numpy.random.default_rng([seed, i])``, so a tensor's values do not depend on the others
(or on how many there are). The torch GPT loads them (``torch_backend.train.gpt.GPT``); the JAX engine
packs them into its chunks.
"""

from __future__ import annotations

import math

import numpy as np

from chunkzero.configs import GPTConfig, ModelConfig, as_gpt_config, model_specs

INIT_STD = 0.02
"""GPT-2's standard deviation of the weight matrices and embeddings."""


def gpt_specs(config: GPTConfig):
    """The byte-level GPT's :class:`chunkzero.TensorSpec` list (``nn.Linear`` ``(out, in)`` weights, tied head)."""
    c = as_gpt_config(config)
    return model_specs(ModelConfig("nanogpt", c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd, 4 * c.n_embd))


def gpt_initial_params(config: GPTConfig, seed: int) -> dict[str, np.ndarray]:
    """The initial weights of the byte-level GPT of ``config``: ``{name: float32 array}`` in parameter order,
    one entry per tensor (the tied ``lm_head.weight`` is ``transformer.wte.weight``'s alias, not a key).

    Raises:
        ConfigError: a config :func:`chunkzero.configs.as_gpt_config` refuses; ``config.bias`` False (the
            specs have biases).
    """
    c = as_gpt_config(config)
    residual_std = INIT_STD / math.sqrt(2 * c.n_layer)
    out = {}
    for i, spec in enumerate(gpt_specs(c)):
        name = spec.name
        if name.endswith(".bias"):
            out[name] = np.zeros(spec.shape, np.float32)
        elif ".ln_" in name or name.startswith("transformer.ln_f"):
            out[name] = np.ones(spec.shape, np.float32)
        else:
            std = residual_std if name.endswith("c_proj.weight") else INIT_STD
            rng = np.random.default_rng([seed, i])
            out[name] = (rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(std))
    return out
