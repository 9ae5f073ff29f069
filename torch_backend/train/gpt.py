"""A byte-level GPT in plain nanoGPT style (Karpathy, https://github.com/karpathy/nanoGPT).

Parameter names match Hugging Face GPT-2's where the structure is the same
(``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight`` …), but linear layers are
``nn.Linear`` (weight shape ``(out_features, in_features)``) where HF uses ``Conv1D`` ``(in, out)``.
``lm_head.weight`` is tied to ``transformer.wte.weight``. The JAX backend mirrors this model.

Shapes: ``idx`` is ``int64[B, T]`` of byte values (``T <= block_size``); logits are
``float[B, T, vocab_size]``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from chunkzero.configs import GPT_CONFIGS, GPTConfig, gpt_config  # noqa: F401 (re-exported)
from chunkzero.errors import ConfigError
from chunkzero.job.init import gpt_initial_params


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ConfigError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


def _retie_lm_head(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` of a state dict that stores the tied weight once, under
    ``transformer.wte.weight`` (a ``chunkzero export --format safetensors`` file, like Hugging Face's):
    ``lm_head.weight`` is the same tensor, so it is filled in from it and a strict load succeeds. A state
    dict that holds both names is loaded as it is."""
    wte, head = prefix + "transformer.wte.weight", prefix + "lm_head.weight"
    if wte in state_dict and head not in state_dict:
        state_dict[head] = state_dict[wte]


class GPT(nn.Module):
    """GPT-2 architecture (pre-LayerNorm, learned positions, tied output head).

    ``load_state_dict`` accepts a state dict without ``lm_head.weight`` (the tied head, stored once under
    ``transformer.wte.weight`` as a safetensors export writes it), strict included.

    Args:
        config: a :class:`GPTConfig`.
        seed: the seed of the initial weights (:meth:`init_weights`: the same seed, the same weights on any
            machine and in the JAX engine); ``None`` draws it from torch's default generator, so
            ``torch.manual_seed`` decides, as for any torch module.
    """

    def __init__(self, config: GPTConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied (GPT-2, Press & Wolf 2017)
        self.register_load_state_dict_pre_hook(_retie_lm_head)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Load GPT-2's initialization drawn by :func:`chunkzero.job.init.gpt_initial_params` from ``seed``
        (numpy: the JAX engine starts from the same bytes; ``None``: a seed drawn from torch's default
        generator). A build on the meta device is left as it is."""
        if self.lm_head.weight.is_meta:
            return
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()))
        values = gpt_initial_params(self.config, seed)
        for name, p in self.named_parameters():  # the tied head once, as transformer.wte.weight
            p.copy_(torch.from_numpy(values[name]))

    def num_params(self) -> int:
        """Parameters counted once (the tied head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``float[B, T, vocab_size]`` for tokens ``int64[B, T]``.

        Raises:
            ConfigError: ``T`` exceeds ``block_size``.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ConfigError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (``int64[B, T]``); returns ``int64[B, T+max_new_tokens]``."""
        return generate(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, *, block_size: int | None = None,
             temperature: float = 1.0, top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Autoregressive sampling with any callable returning logits ``[B, T, V]`` (a GPT or a ZeroDDP-wrapped GPT)
    or a Hugging Face ``ModelOutput`` with ``.logits`` (then pass ``block_size``).

    All ranks of a data-parallel group must call it together (the wrapped model gathers chunks).
    """
    if block_size is None:
        block_size = getattr(model, "config", getattr(getattr(model, "module", None), "config", None)).block_size
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -block_size:]
        out = model(idx_cond)
        logits = getattr(out, "logits", out)[:, -1, :].float() / max(temperature, 1e-8)  # tensor or HF ModelOutput
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
        probs = F.softmax(logits, dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, num_samples=1, generator=generator)), dim=1)
    return idx
