"""Models as a sequence of blocks: pure functions of the named tensors each block reads.

A ZeRO-3 schedule needs to know *which* parameters a piece of computation uses and *when*, so it can
gather a chunk right before the first block that reads it and release it after the last one
(:mod:`jax_backend.schedule`). A :class:`Program` gives exactly that: an ordered list of
:class:`Stage` s, each naming the torch-named tensors it reads and a function
``fn(tensors, h, batch) -> h'`` — the first stage gets ``h=None`` and embeds ``batch["idx"]``, the last
returns the **sum** of token cross-entropies of its (local) batch as an f32 scalar. Composing the
stages is the model; differentiating them one at a time (``jax.vjp`` per stage) is its backward.

Programs:

- :func:`gpt_program` — the Flax NNX GPT of :mod:`jax_backend.gpt` (nanoGPT/GPT-2: embeddings, one
  stage per transformer block, ``ln_f`` + the tied head). Blocks and ``ln_f`` run the *same*
  ``nnx`` modules as :class:`jax_backend.gpt.GPT` (merged from the tensors), so the program computes
  what ``GPT.__call__`` computes.
- :func:`llama_program` — a Llama-style decoder (Touvron et al. 2023; Hugging Face ``LlamaForCausalLM``
  names and ``nn.Linear`` ``(out, in)`` shapes, as :func:`chunkzero.configs.model_specs` lists them):
  RMSNorm, rotary position embeddings (``rotate_half`` convention), SwiGLU MLP, grouped-query attention,
  untied or tied head, optional biases. :func:`hf_llama_program` builds it from a Hugging Face
  ``config.json`` (``model_type`` llama, mistral, qwen2) and refuses by name what it does not compute;
  its logits are HF's torch model's (``tests/jax/test_jax_llama.py``).
- :func:`model_program` — either, by a :mod:`chunkzero.configs` name (``"hf-gpt2"``, ``"hf-gpt2-medium"``,
  ``"llama-1b"``, or a byte-level ``chunkzero train`` name: ``"gpt-tiny"``, ``"gpt-mini"``, ``"gpt-small"``,
  ``"gpt2"``, ``"gpt2-medium"``) or a :class:`chunkzero.configs.GPTConfig`.

Note on names: in :mod:`chunkzero.configs`, ``"hf-gpt2"``/``"hf-gpt2-medium"`` are Hugging Face GPT-2
(vocab 50257, ``Conv1D`` ``(in, out)`` weights). :func:`model_program` runs them as this repository's
GPT with the same sizes (vocab 50257, 1024 positions), whose linear weights are ``nn.Linear``
``(out, in)``: the same tensors in the same order with the same numels (so the same chunk layout),
only the two dimensions of each projection swapped.

Batches are ``{"idx": int32[B, T], "targets": int32[B, T]}``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from chunkzero.configs import (
    HF_LLAMA_DEFAULTS,
    ModelConfig,
    as_gpt_config,
    hf_llama_config,
    model_config,
    model_specs,
)
from chunkzero.errors import ConfigError
from chunkzero.layout import TensorSpec

from .convert import flax_to_torch, gpt_from_torch, hf_gpt2_config, param_rules, param_specs
from .gpt import Block, GPTConfig, init_gpt

Batch = Mapping[str, jax.Array]
StageFn = Callable[[Mapping[str, jax.Array], Any, Batch], Any]


@dataclass(frozen=True)
class Stage:
    """One piece of the model.

    Attributes:
        name: e.g. ``"embed"``, ``"h.3"``, ``"head"``.
        tensors: torch names of the parameters ``fn`` reads (primary names of the program's specs).
        fn: ``fn(tensors, h, batch) -> h'`` (``h`` is ``None`` for the first stage; the last returns
            the f32 sum of cross-entropies over the batch's tokens). Pure, no collectives.
    """

    name: str
    tensors: tuple[str, ...]
    fn: StageFn = field(compare=False)


@dataclass(frozen=True)
class Program:
    """A model as stages, with its parameters.

    Attributes:
        name: the model's name.
        specs: :class:`TensorSpec` per parameter in parameter order (the chunk layout's input).
        stages: the stages in forward order.
        init: ``init(seed) -> {torch_name: f32 array}`` full-shaped initial parameters.
        vocab_size, max_seq_len: what a batch may hold.
        config: the model configuration (:class:`GPTConfig` or :class:`chunkzero.configs.ModelConfig`).
        head_logits: ``head_logits(tensors, h) -> logits [B, T, vocab]``: the last stage's output layer
            before its loss (``None`` where the program has none), for :meth:`logits`.
    """

    name: str
    specs: tuple[TensorSpec, ...]
    stages: tuple[Stage, ...]
    init: Callable[[int], dict[str, jax.Array]] = field(compare=False)
    vocab_size: int = 0
    max_seq_len: int = 0
    config: Any = None
    head_logits: Callable[[Mapping[str, jax.Array], jax.Array], jax.Array] | None = field(default=None, compare=False)

    def logits(self, params: Mapping[str, jax.Array], idx: jax.Array) -> jax.Array:
        """Logits ``f32[B, T, vocab]`` of tokens ``idx`` (``int[B, T]``) with full-shaped ``params``.

        Raises:
            ConfigError: the program has no :attr:`head_logits`.
        """
        if self.head_logits is None:
            raise ConfigError(f"program {self.name} computes no logits")
        h, batch = None, {"idx": idx}
        for s in self.stages[:-1]:
            h = s.fn({n: params[n] for n in s.tensors}, h, batch)
        return self.head_logits({n: params[n] for n in self.stages[-1].tensors}, h)

    def loss_sum(self, params: Mapping[str, jax.Array], batch: Batch) -> jax.Array:
        """Sum of token cross-entropies of ``batch`` with full-shaped ``params`` (all stages composed); with
        ``batch["weights"]`` (``f32[B]``), each row's weighted."""
        h = None
        for s in self.stages:
            h = s.fn({n: params[n] for n in s.tensors}, h, batch)
        return h

    def loss(self, params: Mapping[str, jax.Array], batch: Batch) -> jax.Array:
        """Mean token cross-entropy of ``batch`` (f32 scalar)."""
        return self.loss_sum(params, batch) / batch["targets"].size

    def check_batch(self, batch: Batch) -> None:
        """Raises ConfigError: missing keys, shapes that differ, or a sequence longer than ``max_seq_len``."""
        for k in ("idx", "targets"):
            if k not in batch:
                raise ConfigError(f"batch has no {k!r} (keys: {sorted(batch)})")
        if np.shape(batch["idx"]) != np.shape(batch["targets"]) or len(np.shape(batch["idx"])) != 2:
            raise ConfigError(
                f"batch idx {np.shape(batch['idx'])} and targets {np.shape(batch['targets'])} must both be [B, T]"
            )
        if self.max_seq_len and np.shape(batch["idx"])[1] > self.max_seq_len:
            raise ConfigError(f"sequence length {np.shape(batch['idx'])[1]} exceeds {self.max_seq_len} of {self.name}")


def _cross_entropy_sum(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Sum of the token cross-entropies; with ``weights`` (``f32[B]``), each row's weighted (0 drops a row)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return (ce if weights is None else ce * weights[:, None]).sum()


def random_batch(program: Program, batch_size: int, seq_len: int, seed: int = 0) -> dict[str, jax.Array]:
    """Uniform random tokens ``{"idx", "targets"}``, int32 ``[batch_size, seq_len]`` (targets = idx shifted)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, program.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
    return {"idx": jnp.asarray(data[:, :-1]), "targets": jnp.asarray(data[:, 1:])}


# ---------------------------------------------------------------------------------------------------- GPT
def _nnx_merge(graphdef, abstract_state, pure: dict):
    state = jax.tree.map(lambda x: x, abstract_state)  # a fresh copy to fill
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _set(tree: dict, path: Sequence, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


@functools.lru_cache(maxsize=8)
def gpt_program(config: Any, name: str | None = None, *, hf_conv1d: bool = False) -> Program:
    """The GPT of :mod:`jax_backend.gpt` as stages: ``embed`` (``wte``, ``wpe``), ``h.0`` … ``h.{L-1}``
    (one per transformer block), ``head`` (``ln_f`` and the tied ``wte``).

    Args:
        config: a :class:`chunkzero.configs.GPTConfig` (or anything :func:`chunkzero.configs.as_gpt_config`
            takes); ``dropout`` must be 0.
        hf_conv1d: the tensors of Hugging Face ``GPT2LMHeadModel`` instead of ``nn.Linear``'s: the same
            names, but the four projection weights (``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``,
            ``mlp.c_proj``) are ``Conv1D`` ``(in, out)`` — Flax's kernel layout, read without a transpose.
            The specs, ``init`` and every stage then speak HF's shapes, so a chunk layout of an HF
            GPT-2 (the torch engine's) trains here as it is.

    Raises:
        ConfigError: dropout > 0 (stages are deterministic).
    """
    cfg = as_gpt_config(config)
    if cfg.dropout > 0:
        raise ConfigError(f"the staged GPT needs dropout=0, got {cfg.dropout}")
    rules = {r.torch_name: r for r in param_rules(cfg)}
    specs = tuple(param_specs(cfg))
    if hf_conv1d:  # Conv1D (in, out): the transposed Linear shape, the kernel's own
        specs = tuple(dataclasses.replace(s, shape=s.shape[::-1]) if rules[s.name].transpose else s for s in specs)
    transposed = {n for n, r in rules.items() if r.transpose and not hf_conv1d}
    block_gd, block_abs = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
    ln_gd, ln_abs = nnx.split(nnx.eval_shape(
        lambda: nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_eps, use_bias=cfg.bias, use_fast_variance=False,
                              rngs=nnx.Rngs(0))))

    def module(graphdef, abstract, tensors, strip: int):
        pure: dict = {}
        for n, v in tensors.items():
            r = rules[n]
            _set(pure, r.flax_path[strip:], v.T if n in transposed else v)
        return _nnx_merge(graphdef, abstract, pure)

    def embed(t, h, batch):
        idx = batch["idx"]
        wte, wpe = t["transformer.wte.weight"], t["transformer.wpe.weight"]
        return jnp.take(wte, idx, axis=0) + jnp.take(wpe, jnp.arange(idx.shape[1]), axis=0)[None]

    def block(t, h, batch):  # the tensors of block i, named transformer.h.{i}.*: strip 3 path parts
        return module(block_gd, block_abs, t, 3)(h)

    def head_logits(t, h):
        ln = module(ln_gd, ln_abs, {k: v for k, v in t.items() if k.startswith("transformer.ln_f.")}, 2)
        return jnp.dot(ln(h), t["transformer.wte.weight"].T)  # nnx.Embed.attend: tied output head

    def head(t, h, batch):
        return _cross_entropy_sum(head_logits(t, h), batch["targets"], batch.get("weights"))

    names = [s.name for s in specs]
    stages = [Stage("embed", ("transformer.wte.weight", "transformer.wpe.weight"), embed)]
    for i in range(cfg.n_layer):
        prefix = f"transformer.h.{i}."
        stages.append(Stage(f"h.{i}", tuple(n for n in names if n.startswith(prefix)), block))
    stages.append(
        Stage("head", tuple(n for n in names if n.startswith("transformer.ln_f.")) + ("transformer.wte.weight",), head)
    )

    def init(seed: int = 0) -> dict[str, jax.Array]:
        params = flax_to_torch(init_gpt(cfg, seed))
        return {n: v if n in transposed or not rules[n].transpose else v.T for n, v in params.items()}

    return Program(name or "gpt", specs, tuple(stages), init, cfg.vocab_size, cfg.block_size, cfg, head_logits)


def gpt_reference_loss(config: Any) -> Callable[[Mapping[str, jax.Array], Batch], jax.Array]:
    """``loss(params, batch)``: mean cross-entropy of :class:`jax_backend.gpt.GPT` itself (``GPT.__call__``
    with torch-named parameters), the unsharded reference the staged program is checked against."""
    cfg = as_gpt_config(config)

    def loss(params, batch):
        model = gpt_from_torch(params, cfg)
        logits = model(batch["idx"])
        return _cross_entropy_sum(logits, batch["targets"]) / batch["targets"].size

    return loss


# ---------------------------------------------------------------------------------------------------- Llama
def _rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y.astype(x.dtype)) * w


ROPE_TYPES = ("default", "linear", "llama3")
"""The Hugging Face ``rope_type`` s :func:`rope_inv_freq` computes."""


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> np.ndarray:
    """Rotary inverse frequencies ``f32[head_dim // 2]`` as Hugging Face computes them (in f32): ``1 /
    theta^(2i / head_dim)``, rescaled by ``scaling`` (HF's rope parameters: ``rope_type`` ``"default"``,
    ``"linear"`` with ``factor``, or ``"llama3"`` with ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``).

    Raises:
        ConfigError: another ``rope_type``, or a missing parameter of one (named).
    """
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_type {kind!r} is not implemented (only {', '.join(ROPE_TYPES)})")
    need = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
    missing = [k for k in need if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise ConfigError(f"rope_type {kind!r} needs a number {missing[0]}")
    inv = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    if kind == "linear":
        inv = inv / np.float32(scaling["factor"])
    elif kind == "llama3":  # Llama 3.1: long wavelengths divided by factor, a smooth blend in between
        f, lo, hi = (np.float32(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old = np.float32(scaling["original_max_position_embeddings"])
        wavelen = np.float32(2 * np.pi) / inv
        scaled = np.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blend = (1 - smooth) * scaled / f + smooth * scaled
        inv = np.where((wavelen >= old / hi) & (wavelen <= old / lo), blend, scaled)
    return inv.astype(np.float32)


def _rope(x, inv_freq: np.ndarray):
    """Rotary embedding of ``x`` ``[B, T, N, H]`` (Hugging Face ``rotate_half`` convention: the two halves
    of a head, not interleaved pairs, rotate together)."""
    t, hd = x.shape[1], x.shape[-1]
    ang = np.arange(t, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = jnp.asarray(np.cos(emb), x.dtype)[None, :, None], jnp.asarray(np.sin(emb), x.dtype)[None, :, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


@functools.lru_cache(maxsize=8)
def llama_program(config: ModelConfig | str, name: str | None = None, *, rms_norm_eps: float = 1e-5,
                  rope_theta: float = 10000.0, rope_scaling: tuple[tuple[str, Any], ...] = (),
                  max_seq_len: int = 2048) -> Program:
    """A Llama-style decoder as stages: ``embed``, ``layers.0`` … , ``head`` (``model.norm`` + ``lm_head``).

    Tensor names and shapes are :func:`chunkzero.configs.model_specs`'s (Hugging Face ``LlamaForCausalLM``,
    ``nn.Linear`` weights ``(out, in)``): grouped-query attention (``n_kv_head``), ``head_dim``, the
    biases and the tied head of ``config``. ``rope_scaling`` is the items of HF's rope parameters
    (:func:`rope_inv_freq`); :func:`hf_llama_program` builds all of it from a ``config.json``.

    Raises:
        ConfigError: a config that is not of the ``"llama"`` family, or a rope scaling not implemented.
    """
    cfg = model_config(config) if isinstance(config, str) else config
    if cfg.family != "llama":
        raise ConfigError(f"llama_program needs a 'llama' family config, got {cfg.family!r}")
    specs = tuple(model_specs(cfg))
    nh, nkv = cfg.n_head, cfg.n_kv_head or cfg.n_head
    hd = cfg.head_dim or cfg.n_embd // nh
    inv_freq = rope_inv_freq(hd, rope_theta, dict(rope_scaling))
    head_weight = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"

    def embed(t, h, batch):
        return jnp.take(t["model.embed_tokens.weight"], batch["idx"], axis=0)

    def layer(i):
        p = f"model.layers.{i}."

        def linear(t, x, proj):
            y = x @ t[p + proj + ".weight"].T
            return y + t[p + proj + ".bias"] if p + proj + ".bias" in t else y

        def fn(t, x, batch):
            B, T, _ = x.shape
            a = _rms_norm(x, t[p + "input_layernorm.weight"], rms_norm_eps)
            q = linear(t, a, "self_attn.q_proj").reshape(B, T, nh, hd)
            k = linear(t, a, "self_attn.k_proj").reshape(B, T, nkv, hd)
            v = linear(t, a, "self_attn.v_proj").reshape(B, T, nkv, hd)
            y = jax.nn.dot_product_attention(_rope(q, inv_freq), _rope(k, inv_freq), v, is_causal=True)
            x = x + linear(t, y.reshape(B, T, nh * hd), "self_attn.o_proj")
            m = _rms_norm(x, t[p + "post_attention_layernorm.weight"], rms_norm_eps)
            g = jax.nn.silu(linear(t, m, "mlp.gate_proj")) * linear(t, m, "mlp.up_proj")
            return x + linear(t, g, "mlp.down_proj")

        return fn

    def head_logits(t, x):
        return _rms_norm(x, t["model.norm.weight"], rms_norm_eps) @ t[head_weight].T

    def head(t, x, batch):
        return _cross_entropy_sum(head_logits(t, x), batch["targets"], batch.get("weights"))

    names = [s.name for s in specs]
    stages = [Stage("embed", ("model.embed_tokens.weight",), embed)]
    for i in range(cfg.n_layer):
        prefix = f"model.layers.{i}."
        stages.append(Stage(f"layers.{i}", tuple(n for n in names if n.startswith(prefix)), layer(i)))
    stages.append(Stage("head", ("model.norm.weight", head_weight), head))

    def init(seed: int = 0) -> dict[str, jax.Array]:
        key = jax.random.key(seed)
        out = {}
        for i, s in enumerate(specs):
            if s.name.endswith("norm.weight"):
                out[s.name] = jnp.ones(s.shape, jnp.float32)
            elif s.name.endswith(".bias"):
                out[s.name] = jnp.zeros(s.shape, jnp.float32)
            else:
                out[s.name] = 0.02 * jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32)
        return out

    return Program(name or "llama", specs, tuple(stages), init, cfg.vocab_size, max_seq_len, cfg, head_logits)


def hf_llama_program(config: Mapping[str, Any], name: str | None = None) -> Program:
    """The program of a Hugging Face Llama-family model (``model_type`` llama, mistral or qwen2) from its
    ``config.json`` as a dict, under HF's tensor names and ``(out, in)`` shapes: what its
    ``...ForCausalLM`` computes (RMSNorm, HF's rotary embeddings, SwiGLU, grouped-query attention).

    Raises:
        ConfigError: one line naming the field the program does not compute: a ``hidden_act`` other than
            silu, ``attention_dropout`` > 0, a sliding window that can bind, per-layer or partial rotary
            embeddings, a ``rope_type`` other than default/linear/llama3; or another ``model_type``.
    """
    cfg = hf_llama_config(config)
    kind = config["model_type"]
    c = {**HF_LLAMA_DEFAULTS[kind], **config}
    if c.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {c['hidden_act']!r} is not implemented (only 'silu')")
    if float(c.get("attention_dropout") or 0.0) > 0:
        raise ConfigError(f"attention_dropout {c['attention_dropout']} is not implemented (the program has no dropout)")
    window = c.get("sliding_window") if kind == "mistral" or c.get("use_sliding_window") else None
    if window is not None and window < cfg.n_positions:
        raise ConfigError(f"sliding_window {window} is not implemented (below max_position_embeddings "
                          f"{cfg.n_positions}, it masks attention)")
    if any(t != "full_attention" for t in c.get("layer_types") or ()):
        raise ConfigError("layer_types other than 'full_attention' are not implemented")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if any(isinstance(v, Mapping) for v in rope.values()):
        raise ConfigError("per-layer rope_parameters are not implemented")
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial_rotary_factor other than 1 is not implemented")
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":  # HF prefers the config's own field
        scaling.setdefault("original_max_position_embeddings", cfg.n_positions)
        if isinstance(c.get("original_max_position_embeddings"), int):
            scaling["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    return llama_program(cfg, name or kind, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                         rope_scaling=tuple(sorted(scaling.items())), max_seq_len=cfg.n_positions)


HF_MODEL_TYPES = ("gpt2", *HF_LLAMA_DEFAULTS)
"""The Hugging Face ``model_type`` s :func:`hf_program` computes."""


def hf_program(config: Mapping[str, Any]) -> Program:
    """The program of a Hugging Face causal LM from its ``config.json`` as a dict, under HF's tensor names and
    shapes: GPT-2 (:func:`gpt_program` with ``hf_conv1d``) or the Llama family (:func:`hf_llama_program`).

    Raises:
        ConfigError: another ``model_type``, or a variant the program does not compute (naming the field).
    """
    kind = config.get("model_type")
    if kind == "gpt2":
        return gpt_program(hf_gpt2_config(config), "hf-gpt2", hf_conv1d=True)
    if kind in HF_LLAMA_DEFAULTS:
        return hf_llama_program(config, f"hf-{kind}")
    raise ConfigError(f"model_type {kind!r} has no JAX program (only {', '.join(HF_MODEL_TYPES)})")


# ---------------------------------------------------------------------------------------------------- by name
def model_program(model: str | GPTConfig | ModelConfig) -> Program:
    """The :class:`Program` of a :mod:`chunkzero.configs` model name, a :class:`GPTConfig` or a
    :class:`chunkzero.configs.ModelConfig` (see the module docstring for GPT-2's shapes).

    Raises:
        ConfigError: an unknown name (listing the known ones).
    """
    if isinstance(model, GPTConfig):
        return gpt_program(model)
    cfg = model_config(model) if isinstance(model, str) else model
    name = model if isinstance(model, str) else cfg.family
    if cfg.family == "llama":
        return llama_program(cfg, name)
    if cfg.family in ("hf-gpt2", "nanogpt"):
        if not cfg.tie_embeddings or cfg.intermediate_size != 4 * cfg.n_embd:
            raise ConfigError(f"{name}: the GPT program needs a tied head and a 4·d MLP")
        return gpt_program(GPTConfig(block_size=cfg.n_positions, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer,
                                     n_head=cfg.n_head, n_embd=cfg.n_embd), name)
    raise ConfigError(f"no program for model family {cfg.family!r}")


__all__ = ["HF_MODEL_TYPES", "ROPE_TYPES", "Batch", "Program", "Stage", "gpt_program", "gpt_reference_loss",
           "hf_llama_program", "hf_program", "llama_program", "model_program", "random_batch", "rope_inv_freq"]
