"""torch ``AdamW`` state as optax ``adamw`` state, on chunk arrays.

A chunkzero checkpoint written by torch stores AdamW's per-element state as the optimizer-state
chunks ``exp_avg`` (first moment) and ``exp_avg_sq`` (second moment) and the number of steps taken
as ``meta.optimizer.step``. ``optax.adamw`` (Loshchilov & Hutter 2019, decoupled weight decay) with
the same ``lr``, ``b1, b2 = betas``, ``eps`` and ``weight_decay`` is the same update:

* torch: ``t += 1; p *= 1 - lr·wd; m = b1·m + (1-b1)·g; v = b2·v + (1-b2)·g²;
  p -= lr/(1-b1ᵗ) · m / (√v/√(1-b2ᵗ) + eps)``
* optax: ``t' = count + 1; m̂ = m/(1-b1ᵗ'); v̂ = v/(1-b2ᵗ'); p -= lr·(m̂/(√v̂ + eps) + wd·p)``

Both bias corrections use the 1-based step after incrementing, so optax's ``count`` is set to the
steps already taken (``meta.optimizer.step``) and ``mu``/``nu`` to ``exp_avg``/``exp_avg_sq``. The two
differ only in rounding (``√(v/c)`` vs ``√v/√c``): within 1e-7 relative per element. Chunk padding
stays zero (zero gradient, zero parameter, zero moments).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from chunkzero.checkpoint import OptimizerMeta
from chunkzero.errors import ConfigError

from .layout import Chunks, OptimizerChunks

ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""torch AdamW's per-element state names, the optimizer-state keys of a checkpoint."""

TORCH_ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
"""``torch.optim.AdamW`` defaults, used for hyper-parameters a checkpoint does not record."""


def adamw_hyperparameters(optimizer_meta: OptimizerMeta) -> dict[str, float]:
    """``{"learning_rate", "b1", "b2", "eps", "weight_decay"}`` for ``optax.adamw`` from torch AdamW metadata.

    Raises:
        ConfigError: the optimizer is not AdamW, uses ``amsgrad`` / ``maximize``, has param groups whose
            hyper-parameters differ, or tensors at different steps (none of which is mirrored).
    """
    name = optimizer_meta.class_name
    if not name.lower().endswith("adamw"):
        raise ConfigError(f"optimizer {name!r} is not AdamW; only torch.optim.AdamW / optax.adamw state is mirrored")
    groups = optimizer_meta.param_groups or []
    for i, g in enumerate(groups[1:], 1):
        for key in (*TORCH_ADAMW_DEFAULTS, "amsgrad", "maximize"):
            if g.get(key) != groups[0].get(key):
                raise ConfigError(
                    f"param group {i} has {key}={g.get(key)!r}, group 0 has {groups[0].get(key)!r}: one optax.adamw over "
                    "the chunk arrays takes one set of hyper-parameters, so per-group ones are not mirrored")
    if optimizer_meta.tensor_steps:
        some = next(iter(optimizer_meta.tensor_steps))
        raise ConfigError(f"{len(optimizer_meta.tensor_steps)} tensor(s) (e.g. {some!r}) are at another step than "
                          f"{optimizer_meta.step}: optax keeps one step count for all of them")
    hp = {**TORCH_ADAMW_DEFAULTS, **optimizer_meta.hyperparameters}
    for flag in ("amsgrad", "maximize"):
        if hp.get(flag):
            raise ConfigError(f"AdamW with {flag}=True is not mirrored in optax")
    b1, b2 = hp["betas"]
    return {"learning_rate": float(hp["lr"]), "b1": float(b1), "b2": float(b2), "eps": float(hp["eps"]),
            "weight_decay": float(hp["weight_decay"])}


def adamw_meta(*, learning_rate: float, b1: float, b2: float, eps: float, weight_decay: float,
               max_norm: float | None = None) -> OptimizerMeta:
    """The checkpoint metadata of ``optax.adamw(learning_rate, b1, b2, eps, weight_decay=...)`` in torch
    AdamW's names (``lr``, ``betas``, ``eps``, ``weight_decay``; ``max_norm`` for global-norm clipping),
    at step 0 — the inverse of :func:`adamw_hyperparameters`, for a :class:`~jax_backend.ZeroTrainer`
    trained from scratch whose checkpoints torch resumes (``ZeroTrainer(..., optimizer_meta=...)``).

    Raises:
        ConfigError: a hyper-parameter is not a number (a schedule cannot be recorded as one value).
    """
    values = {"learning_rate": learning_rate, "b1": b1, "b2": b2, "eps": eps, "weight_decay": weight_decay}
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{key} must be a number to be saved for torch, got {v!r}")
    hp = {"lr": float(learning_rate), "betas": [float(b1), float(b2)], "eps": float(eps),
          "weight_decay": float(weight_decay), "amsgrad": False, "maximize": False,
          "max_norm": None if max_norm is None else float(max_norm)}
    return OptimizerMeta("torch.optim.AdamW", hp, list(ADAMW_STATE_KEYS), 0)


def adamw_from_meta(optimizer_meta: OptimizerMeta, **overrides: Any) -> optax.GradientTransformation:
    """``optax.adamw`` with the checkpoint's torch AdamW hyper-parameters (``overrides`` win, e.g.
    ``learning_rate=schedule``). Raises ConfigError as :func:`adamw_hyperparameters`."""
    return optax.adamw(**{**adamw_hyperparameters(optimizer_meta), **overrides})


def adam_state_from_chunks(tx: optax.GradientTransformation, chunks: Mapping[str, jax.Array],
                           opt_state_chunks: Mapping[str, Mapping[str, jax.Array]], step: int) -> optax.OptState:
    """optax state for ``tx`` (an adamw) over the trainable chunk arrays, from torch AdamW state.

    Args:
        chunks: the trainable chunks' parameter arrays (``{chunk_key: f32[size]}``), the pytree ``tx`` updates.
        opt_state_chunks: ``{"exp_avg": {...}, "exp_avg_sq": {...}}`` with the same keys as ``chunks``.
        step: optimizer steps already taken (``meta.optimizer.step``), optax's ``count``.

    Raises:
        ConfigError: a state key is missing or its chunks differ from ``chunks``.
    """
    for key in ADAMW_STATE_KEYS:
        if key not in opt_state_chunks:
            raise ConfigError(f"optimizer state has no {key!r} (has {sorted(opt_state_chunks)})")
        if sorted(opt_state_chunks[key]) != sorted(chunks):
            raise ConfigError(f"optimizer state {key!r} covers chunks {sorted(opt_state_chunks[key])}, parameters {sorted(chunks)}")
    state = tx.init(dict(chunks))
    return optax.tree_utils.tree_set(
        state,
        mu=dict(opt_state_chunks["exp_avg"]),
        nu=dict(opt_state_chunks["exp_avg_sq"]),
        count=jnp.asarray(step, jnp.int32),
    )


def adam_state_to_chunks(state: optax.OptState) -> tuple[OptimizerChunks, int]:
    """``({"exp_avg": mu, "exp_avg_sq": nu}, count)`` of an optax adam/adamw state."""
    mu = optax.tree_utils.tree_get(state, "mu")
    nu = optax.tree_utils.tree_get(state, "nu")
    count = optax.tree_utils.tree_get(state, "count")
    return {"exp_avg": dict(mu), "exp_avg_sq": dict(nu)}, int(count)


def adamw_step(chunks: Mapping[str, jax.Array], grads: Mapping[str, jax.Array],
               opt_state_chunks: Mapping[str, Mapping[str, jax.Array]], optimizer_meta: OptimizerMeta
               ) -> tuple[Chunks, OptimizerChunks, OptimizerMeta]:
    """One torch-equivalent AdamW step on chunk arrays.

    Args:
        chunks: all parameter chunk arrays ``{chunk_key: f32[size]}`` (frozen ones pass through).
        grads: gradients of the trainable chunks, same shapes (and ideally shardings).
        opt_state_chunks: ``{"exp_avg": ..., "exp_avg_sq": ...}`` over the trainable chunks.
        optimizer_meta: the checkpoint's :class:`OptimizerMeta` (hyper-parameters and ``step``).

    Returns:
        ``(new_chunks, new_opt_state_chunks, new_optimizer_meta)`` with ``step + 1``, ready for
        :func:`jax_backend.save_checkpoint`.

    Raises:
        ConfigError: not AdamW, or state / gradients not covering the trainable chunks.
    """
    trainable = {k: chunks[k] for k in opt_state_chunks["exp_avg"]} if "exp_avg" in opt_state_chunks else {}
    missing = sorted(set(trainable) - set(grads))
    if missing:
        raise ConfigError(f"no gradient for trainable chunk {missing[0]}")
    tx = adamw_from_meta(optimizer_meta)
    state = adam_state_from_chunks(tx, trainable, opt_state_chunks, optimizer_meta.step)
    g = {k: grads[k] for k in trainable}
    updates, state = jax.jit(tx.update)(g, state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    new_opt, count = adam_state_to_chunks(state)
    same = set(optimizer_meta.state_keys) == set(new_opt)
    keys = list(optimizer_meta.state_keys) if same else list(new_opt)
    new_meta = dataclasses.replace(optimizer_meta, hyperparameters=dict(optimizer_meta.hyperparameters), state_keys=keys,
                                   step=count)
    return {**dict(chunks), **new_trainable}, new_opt, new_meta
