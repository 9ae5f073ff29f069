"""A Llama-shaped decoder for memory measurements: embeddings, ``layers`` blocks of RMSNorm →
multi-head attention (q, k, v, o projections, no bias, causal SDPA) → RMSNorm → SwiGLU MLP (gate, up,
down), a final RMSNorm and an untied output head — the parameter shapes of ``LlamaForCausalLM``
(rotary embeddings have no parameters and are left out). Every submodule defines
``reset_parameters()``, so it can be built under ``torch.device("meta")`` and materialized by
``ZeroDDP``, ``fully_shard`` + ``to_empty`` or ``to_empty`` + reset.

:data:`LLAMA_SIZES` names the shapes the memory benchmark uses; :func:`llama_numel` counts parameters
without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

__all__ = ["LLAMA_SIZES", "LlamaShape", "LlamaShaped", "llama_numel"]


@dataclass(frozen=True)
class LlamaShape:
    """Sizes of a Llama-shaped decoder (elements)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int = 32000


LLAMA_SIZES = {
    "0.1B": LlamaShape(hidden=768, layers=8, heads=12, intermediate=2048),
    "0.5B": LlamaShape(hidden=1536, layers=16, heads=16, intermediate=4096),
    "1B": LlamaShape(hidden=2048, layers=16, heads=16, intermediate=5632),
}
"""Named shapes: 0.1B (≈0.11B parameters), 0.5B (the 551M shape: hidden 1536, 16 layers), 1B (≈1.1B,
TinyLlama's shape)."""


def llama_numel(s: LlamaShape) -> int:
    """Parameters of :class:`LlamaShaped` for shape ``s`` (elements)."""
    h, i, v = s.hidden, s.intermediate, s.vocab
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    return 2 * v * h + s.layers * per_layer + h


class _Block(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        h, i = s.hidden, s.intermediate
        self.heads = s.heads
        self.attn_norm = nn.RMSNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(h)
        self.gate, self.up = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        y = self.attn_norm(x)
        q, k, v = (p(y).view(b, t, self.heads, h // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.o(a)
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class LlamaShaped(nn.Module):
    """The decoder; ``forward(ids)`` (int64 ``[batch, tokens]``) returns the mean next-token
    cross-entropy (fp32 0-d)."""

    def __init__(self, s: LlamaShape):
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
