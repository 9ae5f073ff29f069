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

Param groups. A torch checkpoint's groups may differ in ``lr`` and ``weight_decay`` (nanoGPT's: no
decay on biases and LayerNorm), and a chunk may hold tensors of several groups. :func:`param_groups_adamw`
keeps them exact on the chunk arrays: ``scale_by_adam``, then per element ``u ← (u + wd_g·p)·lr_g/lr``,
then ``-lr`` — torch's ``p ← p·(1 − lr_g·wd_g) − lr_g·adam`` for the element's group ``g``. The group of
each element is an ``uint8`` (``int32`` past 255 groups) array per chunk in the optax state, built from
the layout's tensor offsets and sharded like the chunk, so inside ``shard_map`` each device sees the
groups of its own shard; padding belongs to group 0 and stays zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkzero.checkpoint import OptimizerMeta, chunk_key
from chunkzero.errors import ConfigError
from chunkzero.layout import ChunkLayout

from .layout import Chunks, OptimizerChunks

ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""torch AdamW's per-element state names, the optimizer-state keys of a checkpoint."""

TORCH_ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
"""``torch.optim.AdamW`` defaults, used for hyper-parameters a checkpoint does not record."""


GROUP_KEYS = ("lr", "weight_decay")
"""The hyper-parameters in which param groups may differ on the JAX side (:func:`param_groups_adamw`)."""


def adamw_hyperparameters(optimizer_meta: OptimizerMeta, *, groups_may_differ: bool = False) -> dict[str, float]:
    """``{"learning_rate", "b1", "b2", "eps", "weight_decay"}`` for ``optax.adamw`` from torch AdamW metadata
    (the first param group's).

    Args:
        groups_may_differ: accept param groups that differ in :data:`GROUP_KEYS` (for
            :func:`param_groups_adamw`); they must still agree in everything else.

    Raises:
        ConfigError: the optimizer is not AdamW, uses ``amsgrad`` / ``maximize``, has param groups whose
            hyper-parameters differ (in :data:`GROUP_KEYS` only unless ``groups_may_differ``), or tensors
            at different steps (none of which is mirrored).
    """
    name = optimizer_meta.class_name
    if not name.lower().endswith("adamw"):
        raise ConfigError(f"optimizer {name!r} is not AdamW; only torch.optim.AdamW / optax.adamw state is mirrored")
    groups = optimizer_meta.param_groups or []
    for i, g in enumerate(groups[1:], 1):
        for key in (*TORCH_ADAMW_DEFAULTS, "amsgrad", "maximize"):
            if g.get(key) != groups[0].get(key) and not (groups_may_differ and key in GROUP_KEYS):
                how = ("pass the layout (adamw_from_meta(meta, layout=...)) to keep per-group lr and weight_decay"
                       if key in GROUP_KEYS else "only lr and weight_decay may differ between groups")
                raise ConfigError(
                    f"param group {i} has {key}={g.get(key)!r}, group 0 has {groups[0].get(key)!r}: {how}"
                )
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


class ParamGroupsState(NamedTuple):
    """State of :func:`scale_by_param_groups`: ``group_index``, per chunk the group of each element
    (``uint8[size]`` or ``int32[size]``, sharded like the chunk). Never changes."""

    group_index: Any


def _group_runs(layout: ChunkLayout, groups: list[dict[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per chunk key: (start offsets, group ids) of the runs of consecutive elements of one group.

    Raises:
        ConfigError: a group names a tensor the layout does not have.
    """
    group_of: dict[str, int] = {}
    for g, group in enumerate(groups):
        for name in group.get("params", []):
            if name not in layout:
                raise ConfigError(f"param group {g} names tensor {name!r}, which the layout does not have")
            group_of[layout.tensor(name).name] = g
    runs = {}
    for c in layout.chunks:
        starts, ids = [0], [0]
        for t in layout.chunk_tensors(c.index):
            g = group_of.get(t.name, 0)
            if g != ids[-1]:
                if starts[-1] == t.offset:
                    ids[-1] = g
                else:
                    starts.append(t.offset)
                    ids.append(g)
        runs[chunk_key(c.index)] = (np.asarray(starts, np.int64), np.asarray(ids))
    return runs


def scale_by_param_groups(layout: ChunkLayout, groups: list[dict[str, Any]]) -> optax.GradientTransformation:
    """``u ← (u + wd_g·p) · lr_g / lr_0`` per element, ``g`` the element's param group (torch's AdamW
    decay and per-group learning rate, before ``scale_by_learning_rate(lr_0)``).

    Args:
        layout: the chunk layout of the parameter pytree ``{chunk_key: f32[size]}`` (any world size: the
            offsets are the same).
        groups: torch param groups ``{"lr", "weight_decay", "params": [tensor names]}`` (a checkpoint's
            ``OptimizerMeta.param_groups``); tensors in none of them count as group 0.

    Raises:
        ConfigError: a group names a tensor the layout does not have; group 0's lr is 0 and another's is not.
    """
    runs = _group_runs(layout, groups)
    dtype = jnp.uint8 if len(groups) <= 255 else jnp.int32
    decay = jnp.asarray(
        [float(g.get("weight_decay", TORCH_ADAMW_DEFAULTS["weight_decay"])) for g in groups], jnp.float32
    )
    lrs = [float(g.get("lr", TORCH_ADAMW_DEFAULTS["lr"])) for g in groups]
    if lrs[0] == 0 and any(lrs):
        raise ConfigError(f"param group 0 has lr 0 and others do not ({lrs}): the other groups' lr is kept as a ratio "
                          "to group 0's, which is undefined here")
    lr_scale = jnp.asarray([lr / lrs[0] if lrs[0] else 1.0 for lr in lrs], jnp.float32)

    def index_of(path, p):
        starts, ids = runs[path[-1].key]
        run = jnp.searchsorted(jnp.asarray(starts), jnp.arange(p.shape[0]), side="right") - 1
        return jnp.asarray(ids, dtype)[run]

    def init_fn(params):
        return ParamGroupsState(jax.tree_util.tree_map_with_path(index_of, params))

    def update_fn(updates, state, params):
        if params is None:
            raise ConfigError("scale_by_param_groups needs the parameters (weight decay)")
        new = jax.tree.map(lambda u, p, g: ((u + decay[g] * p) * lr_scale[g]).astype(u.dtype),
                           updates, params, state.group_index)
        return new, state

    return optax.GradientTransformation(init_fn, update_fn)


def param_groups_adamw(learning_rate: Any, b1: float, b2: float, eps: float, layout: ChunkLayout,
                       groups: list[dict[str, Any]]) -> optax.GradientTransformation:
    """torch AdamW with per-group ``lr`` and ``weight_decay`` on chunk arrays: ``optax.adamw``'s chain
    with :func:`scale_by_param_groups` in place of its one ``add_decayed_weights``. ``learning_rate``
    (a number or an optax schedule) is group 0's; group ``g`` runs at ``learning_rate · lr_g / lr_0``."""
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), scale_by_param_groups(layout, groups),
                       optax.scale_by_learning_rate(learning_rate))


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


def adamw_from_meta(optimizer_meta: OptimizerMeta, *, layout: ChunkLayout | None = None,
                    **overrides: Any) -> optax.GradientTransformation:
    """torch AdamW as optax, from a checkpoint's metadata: ``optax.adamw`` with the saved
    hyper-parameters, or, where the param groups differ in ``lr`` / ``weight_decay`` and ``layout`` is
    given, :func:`param_groups_adamw` (exact per group). ``overrides`` win (``learning_rate=schedule``:
    group 0's; the other groups keep their ratio to it).

    Raises:
        ConfigError: as :func:`adamw_hyperparameters` (groups that differ and no ``layout``); a group
            names a tensor ``layout`` does not have; a ``weight_decay`` override for groups that differ.
    """
    hp = {**adamw_hyperparameters(optimizer_meta, groups_may_differ=layout is not None), **overrides}
    groups = optimizer_meta.param_groups or []
    if layout is not None and any(g.get(k) != groups[0].get(k) for g in groups[1:] for k in GROUP_KEYS):
        if "weight_decay" in overrides:
            raise ConfigError(
                "weight_decay cannot be overridden when the param groups differ: each group keeps its own"
            )
        return param_groups_adamw(hp["learning_rate"], hp["b1"], hp["b2"], hp["eps"], layout, groups)
    return optax.adamw(**hp)


def adam_state_from_chunks(tx: optax.GradientTransformation, chunks: Mapping[str, jax.Array],
                           opt_state_chunks: Mapping[str, Mapping[str, jax.Array]], step: int, *,
                           schedule_step: int | None = None) -> optax.OptState:
    """optax state for ``tx`` (an adamw) over the trainable chunk arrays, from torch AdamW state.

    Args:
        chunks: the trainable chunks' parameter arrays (``{chunk_key: f32[size]}``), the pytree ``tx`` updates.
        opt_state_chunks: ``{"exp_avg": {...}, "exp_avg_sq": {...}}`` with the same keys as ``chunks``.
        step: optimizer steps already taken (``meta.optimizer.step``), optax's ``count``.
        schedule_step: the count of a learning-rate schedule in ``tx`` (optax's ``ScaleByScheduleState``), when
            it differs from ``step``: a training loop's steps, skipped ones included (``meta.step``), where
            skipped steps did not count for Adam (default: ``step``).

    Raises:
        ConfigError: a state key is missing or its chunks differ from ``chunks``.
    """
    for key in ADAMW_STATE_KEYS:
        if key not in opt_state_chunks:
            raise ConfigError(f"optimizer state has no {key!r} (has {sorted(opt_state_chunks)})")
        if sorted(opt_state_chunks[key]) != sorted(chunks):
            raise ConfigError(
                f"optimizer state {key!r} covers chunks {sorted(opt_state_chunks[key])}, parameters {sorted(chunks)}"
            )
    state = tx.init(dict(chunks))
    state = optax.tree_utils.tree_set(
        state,
        mu=dict(opt_state_chunks["exp_avg"]),
        nu=dict(opt_state_chunks["exp_avg_sq"]),
        count=jnp.asarray(step, jnp.int32),
    )
    if schedule_step is None:
        return state
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree.map(lambda s: s._replace(count=jnp.asarray(schedule_step, jnp.int32)) if is_schedule(s) else s,
                        state, is_leaf=is_schedule)


def adam_state_to_chunks(state: optax.OptState) -> tuple[OptimizerChunks, int]:
    """``({"exp_avg": mu, "exp_avg_sq": nu}, count)`` of an optax adam/adamw state (the count is Adam's
    own: a learning-rate schedule in the chain keeps another, the same number)."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    adam = [s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)]
    if len(adam) != 1:
        raise ConfigError(f"expected one Adam state in the optimizer state, found {len(adam)}")
    return {"exp_avg": dict(adam[0].mu), "exp_avg_sq": dict(adam[0].nu)}, int(adam[0].count)


def adamw_step(chunks: Mapping[str, jax.Array], grads: Mapping[str, jax.Array],
               opt_state_chunks: Mapping[str, Mapping[str, jax.Array]], optimizer_meta: OptimizerMeta,
               layout: ChunkLayout | None = None) -> tuple[Chunks, OptimizerChunks, OptimizerMeta]:
    """One torch-equivalent AdamW step on chunk arrays.

    Args:
        chunks: all parameter chunk arrays ``{chunk_key: f32[size]}`` (frozen ones pass through).
        grads: gradients of the trainable chunks, same shapes (and ideally shardings).
        opt_state_chunks: ``{"exp_avg": ..., "exp_avg_sq": ...}`` over the trainable chunks.
        optimizer_meta: the checkpoint's :class:`OptimizerMeta` (hyper-parameters and ``step``).
        layout: the chunks' layout, needed where the param groups differ (:func:`adamw_from_meta`).

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
    tx = adamw_from_meta(optimizer_meta, layout=layout)
    state = adam_state_from_chunks(tx, trainable, opt_state_chunks, optimizer_meta.step)
    g = {k: grads[k] for k in trainable}
    updates, state = jax.jit(tx.update)(g, state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    new_opt, count = adam_state_to_chunks(state)
    same = set(optimizer_meta.state_keys) == set(new_opt)
    keys = list(optimizer_meta.state_keys) if same else list(new_opt)
    new_meta = dataclasses.replace(
        optimizer_meta, hyperparameters=dict(optimizer_meta.hyperparameters), state_keys=keys, step=count
    )
    return {**dict(chunks), **new_trainable}, new_opt, new_meta
