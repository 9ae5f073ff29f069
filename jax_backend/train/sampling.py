"""Text from the JAX engine's trained weights, sampled in JAX: the run's ``sample.txt``.

After the prompt (:func:`chunkzero.job.report.prompt_ids`), each token is drawn from the last position's
logits of the staged GPT program (:meth:`jax_backend.blocks.Program.logits`), divided by ``--temperature``
and cut to the ``--top-k`` largest, with ``jax.random`` keys from ``--seed``. The context is a fixed window
of ``min(block size, --seq-len)`` tokens (the prompt right-padded until it fills), so the step compiles
once. Every process draws the same tokens. It need not equal the torch engine's sample (another RNG).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from chunkzero.job.report import prompt_ids
from chunkzero.train_config import TrainConfig

from ..blocks import Program


def sample_ids(program: Program, params: Mapping[str, np.ndarray], prompt: list[int], n_tokens: int, *,
               window: int, seed: int, temperature: float = 1.0, top_k: int | None = None) -> list[int]:
    """``prompt`` followed by ``n_tokens`` sampled token ids.

    Args:
        params: full-shaped fp32 tensors by name (the program's primary names).
        window: the longest context the model reads (at most its block size).
    """
    params = {k: jnp.asarray(v) for k, v in params.items()}
    vocab = program.vocab_size

    @jax.jit
    def draw(params, ctx, last, key):
        logits = program.logits(params, ctx[None])[0, last].astype(jnp.float32) / max(temperature, 1e-8)
        if top_k is not None:
            kth = jax.lax.top_k(logits, min(top_k, vocab))[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits)

    ids = list(prompt)
    key = jax.random.key(seed)
    for _ in range(n_tokens):
        ctx = ids[-window:]
        last = len(ctx) - 1
        ctx = np.asarray(ctx + [0] * (window - len(ctx)), np.int32)  # right padding: a causal model never reads it
        key, sub = jax.random.split(key)
        ids.append(int(draw(params, ctx, last, sub)))
    return ids


def sample_text(program: Program, params: Mapping[str, np.ndarray], corpus, cfg: TrainConfig) -> tuple[str, str]:
    """``(prompt, text)`` of the run: the prompt and the prompt followed by ``cfg.sample_tokens`` tokens."""
    ids = prompt_ids(corpus, cfg)
    out = sample_ids(program, params, ids, cfg.sample_tokens, window=min(cfg.block_size, cfg.seq_len),
                     seed=cfg.seed, temperature=cfg.temperature, top_k=cfg.top_k)
    return corpus.tokenizer.decode(ids), corpus.tokenizer.decode(out)
