"""GPT parameters between torch names, Flax NNX state, chunk arrays and Hugging Face GPT-2.

The chunk layout, checkpoints and the torch backend name a parameter by its torch name
(``named_parameters()``); the Flax :class:`jax_backend.gpt.GPT` holds it at an NNX state path. The
rules (:func:`param_rules`, derived from the Flax module tree) are

=============================  =====================================  ==============================
torch (``named_parameters``)   Flax NNX state path                    value
=============================  =====================================  ==============================
``<linear>.weight`` (out, in)  ``<linear>/kernel`` (in, out)          transposed (``nn.Linear`` -> ``nnx.Linear``)
``<linear>.bias`` (out,)       ``<linear>/bias``                      as is
``<layernorm>.weight`` (C,)    ``<layernorm>/scale``                  as is
``<layernorm>.bias`` (C,)      ``<layernorm>/bias``                   as is
``<embedding>.weight`` (V, C)  ``<embedding>/embedding``              as is
``lm_head.weight``             (none: tied, ``transformer.wte.attend``) alias of ``transformer.wte.weight``
=============================  =====================================  ==============================

where a module path ``transformer.h.0.attn.c_attn`` becomes ``("transformer", "h", 0, "attn", "c_attn")``.

- torch parameters <-> Flax: :func:`torch_to_flax`, :func:`flax_to_torch`, :func:`gpt_from_torch`;
  :func:`param_specs` gives the torch-named tensor specs a chunk layout is built from.
- chunk arrays and checkpoints -> Flax: :func:`check_layout`, :func:`gpt_from_chunks`, :func:`restore_gpt`.
- Hugging Face GPT-2 (``transformers`` ``GPT2LMHeadModel``) -> Flax or torch naming:
  :func:`load_hf_gpt2`, :func:`hf_gpt2_to_flax`, :func:`hf_gpt2_to_torch`, :func:`hf_gpt2_config`. HF
  uses the same names, but its ``Conv1D`` weights are already ``(in, out)`` and are taken without
  transposing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from chunkzero.configs import GPTConfig, as_gpt_config
from chunkzero.errors import CheckpointError, ConfigError, ShapeMismatchError
from chunkzero.layout import ChunkLayout, TensorSpec

from .gpt import GPT, init_gpt
from .layout import flatten_names, unflatten
from .mesh import DEFAULT_AXIS


# ---------------------------------------------------------------------------- torch <-> Flax names
@dataclass(frozen=True)
class ParamRule:
    """How one torch parameter maps to Flax.

    Attributes:
        torch_name: e.g. ``"transformer.h.0.attn.c_attn.weight"``.
        torch_shape: its shape in torch (``nn.Linear`` weights ``(out, in)``).
        flax_path: NNX state path, e.g. ``("transformer", "h", 0, "attn", "c_attn", "kernel")``.
        transpose: the value is transposed between the two (Linear weight <-> kernel).
    """

    torch_name: str
    torch_shape: tuple[int, ...]
    flax_path: tuple[str | int, ...]
    transpose: bool

    @property
    def flax_name(self) -> str:
        return "/".join(map(str, self.flax_path))


TIED_ALIASES = {"transformer.wte.weight": ("lm_head.weight",)}
"""Torch names that are aliases of another parameter (the tied output head)."""


def _torch_order(config: GPTConfig) -> list[str]:
    """Torch ``named_parameters()`` order (module registration order, ``lm_head`` deduplicated)."""
    lin = ["weight", "bias"] if config.bias else ["weight"]
    block = [f"ln_1.{p}" for p in lin] + [f"attn.c_attn.{p}" for p in lin] + [f"attn.c_proj.{p}" for p in lin]
    block += [f"ln_2.{p}" for p in lin] + [f"mlp.c_fc.{p}" for p in lin] + [f"mlp.c_proj.{p}" for p in lin]
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(config.n_layer):
        names += [f"transformer.h.{i}.{b}" for b in block]
    return names + [f"transformer.ln_f.{p}" for p in lin]


@functools.lru_cache(maxsize=16)
def param_rules(config: GPTConfig) -> tuple[ParamRule, ...]:
    """The torch -> Flax rule of every parameter, in torch ``named_parameters()`` order.

    Derived from the Flax module tree (``nnx.Linear`` -> transposed ``kernel``, ``nnx.LayerNorm`` ->
    ``scale``, ``nnx.Embed`` -> ``embedding``, ``bias`` as is), built abstractly (no arrays).
    """
    config = as_gpt_config(config)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    rules: dict[str, ParamRule] = {}
    for path, module in nnx.iter_modules(model):
        prefix = ".".join(map(str, path))
        if isinstance(module, nnx.Linear):
            k = module.kernel.shape
            rules[f"{prefix}.weight"] = ParamRule(f"{prefix}.weight", (k[1], k[0]), (*path, "kernel"), True)
        elif isinstance(module, nnx.LayerNorm):
            rules[f"{prefix}.weight"] = ParamRule(f"{prefix}.weight", module.scale.shape, (*path, "scale"), False)
        elif isinstance(module, nnx.Embed):
            rules[f"{prefix}.weight"] = ParamRule(
                f"{prefix}.weight", module.embedding.shape, (*path, "embedding"), False
            )
        else:
            continue
        if getattr(module, "bias", None) is not None:
            rules[f"{prefix}.bias"] = ParamRule(f"{prefix}.bias", module.bias.shape, (*path, "bias"), False)
    order = _torch_order(config)
    if sorted(order) != sorted(rules):
        raise AssertionError(f"GPT name table out of sync: {sorted(set(order) ^ set(rules))}")  # a bug, not input
    return tuple(rules[n] for n in order)


def param_specs(config: Any) -> list[TensorSpec]:
    """Torch-named :class:`TensorSpec` s of the GPT in ``named_parameters()`` order, ``lm_head.weight``
    an alias of ``transformer.wte.weight``: ``ChunkLayout.build(param_specs(cfg), chunk_size, W)``
    gives the layout the torch backend builds for the same model (float32 parameters)."""
    return [
        TensorSpec(r.torch_name, r.torch_shape, "float32", TIED_ALIASES.get(r.torch_name, ()))
        for r in param_rules(as_gpt_config(config))
    ]


def _to_numpy(x: Any) -> Any:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return x


def _lookup(flat: Mapping[str, Any], name: str) -> Any:
    for n in (name, *TIED_ALIASES.get(name, ())):
        if n in flat:
            return flat[n]
    return None


def _to_state(flat: Mapping[str, Any], config: GPTConfig, *, linear_in_out: bool, source: str) -> nnx.State:
    rules = param_rules(config)
    pure: dict = {}
    for r in rules:
        value = _lookup(flat, r.torch_name)
        if value is None:
            raise ConfigError(f"{source}: missing parameter {r.torch_name!r} (shape {r.torch_shape}) for {r.flax_name}")
        value = _to_numpy(value)
        transpose = r.transpose and not linear_in_out
        expected = r.torch_shape if not (r.transpose and linear_in_out) else r.torch_shape[::-1]
        if tuple(np.shape(value)) != expected:
            raise ShapeMismatchError(r.torch_name, expected, np.shape(value), f"{source} -> Flax {r.flax_name}")
        value = jnp.asarray(value)
        node = pure
        for p in r.flax_path[:-1]:
            node = node.setdefault(p, {})
        node[r.flax_path[-1]] = value.T if transpose else value
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    return state


def torch_to_flax(params_by_torch_name: Mapping[str, Any], config: Any) -> nnx.State:
    """The Flax ``nnx.Param`` state of a GPT from torch-named parameters (rules in the module docstring).

    Args:
        params_by_torch_name: ``{"transformer.wte.weight": array, ...}`` (flat, or nested as
            :func:`jax_backend.unflatten` returns) of numpy / jax arrays or torch tensors, torch
            shapes; ``lm_head.weight`` may stand in for ``transformer.wte.weight``; extra keys are ignored.
        config: the model's configuration.

    Returns:
        An ``nnx.State`` to ``nnx.update(model, state)`` or ``nnx.merge(graphdef, state)``; arrays keep
        their sharding, kernels are transposed views.

    Raises:
        ConfigError: a parameter is missing (names it and the Flax path).
        ShapeMismatchError: a parameter's shape differs from the model's (names it and both shapes).
    """
    return _to_state(
        flatten_names(params_by_torch_name), as_gpt_config(config), linear_in_out=False, source="torch parameters"
    )


def flax_to_torch(
    model_or_state: GPT | nnx.State, config: Any = None, *, include_aliases: bool = False
) -> dict[str, jax.Array]:
    """Torch-named, torch-shaped parameters of a Flax GPT (the reverse of :func:`torch_to_flax`).

    Args:
        model_or_state: a :class:`GPT`, or its ``nnx.state(model, nnx.Param)`` (then ``config`` is needed).
        include_aliases: add ``"lm_head.weight"`` (the same array as ``transformer.wte.weight``), as
            torch's ``state_dict()`` has it.

    Returns:
        ``{torch_name: Array}`` in ``named_parameters()`` order (then the aliases, in ``state_dict()`` order).

    Raises:
        ConfigError: a state without ``config``.
    """
    if isinstance(model_or_state, GPT):
        config = model_or_state.config if config is None else config
        state = nnx.state(model_or_state, nnx.Param)
    else:
        if config is None:
            raise ConfigError("flax_to_torch of an nnx.State needs config=")
        state = model_or_state
    pure = nnx.to_pure_dict(state)
    out: dict[str, jax.Array] = {}
    for r in param_rules(as_gpt_config(config)):
        node = pure
        for p in r.flax_path:
            node = node[p] if p in node else node[str(p)]
        out[r.torch_name] = node.T if r.transpose else node
    if include_aliases:  # after every parameter, where torch's state_dict() has lm_head.weight
        for name, aliases in TIED_ALIASES.items():
            for alias in aliases:
                out[alias] = out[name]
    return out


def _assemble(config: GPTConfig, params: nnx.State, seed: int = 0) -> GPT:
    if config.dropout > 0:  # the model carries dropout RNG state: initialize it for real (one jit), then load
        model = init_gpt(config, seed)
        nnx.update(model, params)
        return model
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(seed))))
    return nnx.merge(graphdef, params)


def gpt_from_torch(params_by_torch_name: Mapping[str, Any], config: Any) -> GPT:
    """A :class:`GPT` holding torch-named parameters (see :func:`torch_to_flax` for arguments and errors)."""
    config = as_gpt_config(config)
    return _assemble(config, torch_to_flax(params_by_torch_name, config))


# ---------------------------------------------------------------------------- chunks and checkpoints
def check_layout(layout: ChunkLayout, config: Any) -> None:
    """Check that ``layout``'s tensors are exactly the Flax GPT's parameters with the same shapes.

    Raises:
        ShapeMismatchError: the first tensor (in parameter order) whose shape differs, naming it,
            the model's shape (expected) and the checkpoint's (got), and its Flax path.
        CheckpointError: the first model parameter the layout lacks, or the first layout tensor the
            model does not have.
    """
    config = as_gpt_config(config)
    rules = param_rules(config)
    known = set()
    for r in rules:
        known.update((r.torch_name, *TIED_ALIASES.get(r.torch_name, ())))
        name = next((n for n in (r.torch_name, *TIED_ALIASES.get(r.torch_name, ())) if n in layout), None)
        if name is None:
            raise CheckpointError(
                f"checkpoint layout has no tensor {r.torch_name!r} (shape {r.torch_shape}) that the Flax GPT needs "
                f"for {r.flax_name}"
            )
        got = layout.tensor(name).shape
        if got != r.torch_shape:
            raise ShapeMismatchError(
                r.torch_name, r.torch_shape, got, f"Flax GPT {r.flax_name} vs the checkpoint layout"
            )
    for t in layout.tensors:
        if t.name not in known:
            raise CheckpointError(
                f"checkpoint layout tensor {t.name!r} (shape {t.shape}) is not a parameter of the Flax GPT"
            )


def gpt_from_chunks(chunks: Mapping[str, Any], layout: ChunkLayout, config: Any) -> GPT:
    """A :class:`GPT` whose parameters are sliced out of chunk arrays.

    Raises:
        ShapeMismatchError / CheckpointError: ``layout`` does not match the model (:func:`check_layout`).
    """
    config = as_gpt_config(config)
    check_layout(layout, config)
    return gpt_from_torch(unflatten(chunks, layout, nested=False, include_aliases=True), config)


def restore_gpt(
    path: str | os.PathLike, mesh: Mesh, *, config: Any = None, axis: str = DEFAULT_AXIS, step: int | None = None
):
    """Restore a chunkzero GPT checkpoint as a Flax :class:`GPT` on ``mesh``.

    Args:
        path: step directory or root (latest step).
        mesh: a mesh with axis ``axis`` (any size; chunks are re-padded).
        config: the model configuration; default ``meta.model_config`` of the checkpoint.

    Returns:
        ``(model, restored)``: the GPT and the :class:`jax_backend.checkpoint.RestoredCheckpoint`.

    Raises:
        ConfigError: no config given nor stored; a mesh without ``axis``.
        ShapeMismatchError / CheckpointError: layout vs model mismatch; checkpoint errors.
    """
    from .checkpoint import restore_checkpoint

    restored = restore_checkpoint(path, mesh, axis=axis, step=step)
    if config is None:
        if not restored.meta.model_config:
            raise ConfigError(f"{restored.path}: checkpoint stores no model_config; pass config=")
        config = GPTConfig.from_dict(restored.meta.model_config)
    return gpt_from_chunks(restored.chunks, restored.layout, config), restored


# ---------------------------------------------------------------------------- Hugging Face GPT-2
_HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")


def hf_gpt2_config(hf_config: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a ``transformers.GPT2Config`` (or its ``to_dict()``).

    Dropout is not carried (the GPT it returns has ``dropout=0``).

    Raises:
        ConfigError: an activation other than the tanh GELU (``gelu_new`` / ``gelu_pytorch_tanh``), or a
            GPT-2 variant this GPT does not compute (naming the field): an MLP width ``n_inner`` other
            than ``4·n_embd``, unscaled or layer-scaled attention, an untied head, cross-attention.
    """
    d = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"Hugging Face GPT-2 activation {act!r} is not the tanh GELU this GPT uses")
    n_inner = d.get("n_inner")
    variants = {"n_inner": n_inner is not None and n_inner != 4 * d["n_embd"],
                "scale_attn_weights": not d.get("scale_attn_weights", True),
                "scale_attn_by_inverse_layer_idx": bool(d.get("scale_attn_by_inverse_layer_idx", False)),
                "tie_word_embeddings": not d.get("tie_word_embeddings", True),
                "add_cross_attention": bool(d.get("add_cross_attention", False))}
    for key, unsupported in variants.items():
        if unsupported:
            raise ConfigError(f"Hugging Face GPT-2 {key}={d.get(key)!r} is a variant this GPT does not compute "
                              "(it has a 4·n_embd MLP, 1/sqrt(head size) attention, a tied head, no cross-attention)")
    return GPTConfig(block_size=d["n_positions"], vocab_size=d["vocab_size"], n_layer=d["n_layer"], n_head=d["n_head"],
                     n_embd=d["n_embd"], dropout=0.0, bias=True, layer_norm_eps=d.get("layer_norm_epsilon", 1e-5))


def _hf_flat(hf_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in hf_state_dict.items():
        if k.endswith(_HF_BUFFERS):
            continue
        if not (k.startswith("transformer.") or k.startswith("lm_head.")):
            k = "transformer." + k  # GPT2Model (no LM head) has no "transformer." prefix
        out[k] = v
    head = out.pop("lm_head.weight", None)
    if head is not None and "transformer.wte.weight" in out:
        if not np.array_equal(_to_numpy(head), _to_numpy(out["transformer.wte.weight"])):
            raise ConfigError("Hugging Face lm_head.weight is not tied to transformer.wte.weight; this GPT ties them")
    return out


def hf_gpt2_to_torch(hf_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Hugging Face GPT-2 state dict -> this project's torch naming and shapes.

    ``Conv1D`` weights ``(in, out)`` are transposed to ``nn.Linear`` ``(out, in)``; the attention mask
    buffers (``attn.bias``, ``attn.masked_bias``) are dropped; ``lm_head.weight`` must be tied.
    Values are numpy arrays (torch tensors are converted).
    """
    out = {}
    for k, v in _hf_flat(hf_state_dict).items():
        v = _to_numpy(v)
        out[k] = np.ascontiguousarray(np.swapaxes(v, 0, 1)) if k.endswith(_HF_CONV1D) else v
    return out


def hf_gpt2_to_flax(hf_state_dict: Mapping[str, Any], config: Any) -> nnx.State:
    """Hugging Face GPT-2 state dict (``GPT2LMHeadModel.state_dict()``) -> Flax ``nnx.Param`` state.

    ``Conv1D`` weights are ``(in, out)``, already Flax's ``kernel`` layout: taken as is.

    Raises:
        ConfigError, ShapeMismatchError: as :func:`torch_to_flax`.
    """
    return _to_state(_hf_flat(hf_state_dict), as_gpt_config(config), linear_in_out=True, source="Hugging Face GPT-2")


def load_hf_gpt2(model_or_state_dict: Any, config: Any = None) -> GPT:
    """A Flax :class:`GPT` from a ``transformers`` ``GPT2LMHeadModel`` (or its state dict and ``config``).

    Args:
        model_or_state_dict: a ``GPT2LMHeadModel`` / ``GPT2Model`` or a state dict of it.
        config: default ``hf_gpt2_config(model.config)``; needed with a bare state dict.

    Raises:
        ConfigError, ShapeMismatchError: as :func:`hf_gpt2_to_flax`.
    """
    if hasattr(model_or_state_dict, "state_dict"):
        if config is None:
            config = hf_gpt2_config(model_or_state_dict.config)
        sd = model_or_state_dict.state_dict()
    else:
        if config is None:
            raise ConfigError("load_hf_gpt2 of a state dict needs config=")
        sd = model_or_state_dict
    config = as_gpt_config(config)
    return _assemble(config, hf_gpt2_to_flax(sd, config))


__all__ = ["TIED_ALIASES", "ParamRule", "check_layout", "flax_to_torch", "gpt_from_chunks", "gpt_from_torch",
           "hf_gpt2_config", "hf_gpt2_to_flax", "hf_gpt2_to_torch", "load_hf_gpt2", "param_rules", "param_specs",
           "restore_gpt", "torch_to_flax"]
