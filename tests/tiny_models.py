"""The small models the tests build, in one place (spawned ranks import this module by name too).

Each test module used to spell its own ``GPTConfig`` / ``GPT2Config``; the shapes two or more modules
share are named here, and a test that needs another shape states only how it differs
(``gpt_config(n_layer=1)``), so its reader sees what is special about it.
"""

from __future__ import annotations

GPT_TINY = dict(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
"""``torch_backend.train.gpt.GPTConfig`` fields of a GPT of 34,176 parameters."""

HF_GPT2_TINY = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0,
                    tie_word_embeddings=True)
"""``transformers.GPT2Config`` fields of a two-block Hugging Face GPT-2 with tied embeddings."""

HF_GPT2_FOR_TRAIN = dict(HF_GPT2_TINY, vocab_size=256, n_positions=64, n_layer=1)
"""A one-block Hugging Face GPT-2 that ``chunkzero train --model DIR`` can train on a byte corpus
(vocabulary 256, 64 positions: ``SMALL``'s 32-token sequences fit)."""


def gpt_config(**overrides):
    """``GPTConfig`` of :data:`GPT_TINY` with ``overrides``."""
    from torch_backend.train.gpt import GPTConfig

    return GPTConfig(**{**GPT_TINY, **overrides})


def hf_gpt2_config(base: dict = HF_GPT2_TINY, **overrides):
    """``transformers.GPT2Config`` of ``base`` (:data:`HF_GPT2_TINY`) with ``overrides``."""
    import transformers

    return transformers.GPT2Config(**{**base, **overrides})
