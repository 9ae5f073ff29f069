"""Orbax checkpoints of a ZeroDDP model and its ZeroOptimizer (DESIGN.md §5).

The torch adapter of :mod:`chunkzero.checkpoint`, which owns the format and every read and write: here
the model's master shards and the optimizer's state shards become numpy arrays and back
(:mod:`.numpy_bridge`, :mod:`.optim_shards`), and the ranks agree through :mod:`.collectives`.

**Save** (all ranks in parallel). Each rank checksums its own shards; one all-gather of JSON collects
every rank's checksums and RNG state into the metadata, and what each rank was asked to save (the
directory, step and a digest of its layout: ranks that disagree fail together here,
:mod:`chunkzero.checkpoint.agreement`); then each rank writes only its own shards (hybrid sharding: each
shard once, by replica 0's ranks; the metadata records ``replicas``), as one JAX process
of a CPU ``jax.distributed`` group (:mod:`.parallel_write`), every wait for the others bounded by
``timeout_s``. Orbax writes into a temporary directory and renames it on commit, so a save killed
midway leaves the previous step as the latest. An asynchronous save returns once JAX holds a copy of
the shards; the next save, a load of the same directory, :func:`wait_until_finished` or the process's
exit waits for the commit.

**Load** (each rank reads alone, then one all-gather of JSON to agree). A rank computes, from the
saved layout and its model's layout, which element ranges of which saved arrays make up each of its
shards (at its shard rank) — by tensor name, so the world size, the shard group size *and* the chunk
size may differ
(:func:`~chunkzero.checkpoint.read_plan`) — and reads only those ranges with TensorStore
(:mod:`chunkzero.checkpoint.reader`), each verified against its checksums. By default into new
buffers: the model changes only once every rank has read everything and the ranks agree that they
read the same step (staged); with ``staged=False`` straight into the live CPU shards.

Nothing here unpickles: metadata is JSON validated by ``CheckpointMeta.from_dict``, arrays are
TensorStore/zarr, RNG states are JSON (:mod:`.rng`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from chunkzero.checkpoint import (
    META_ITEM,
    CheckpointMeta,
    ReadPiece,
    check_compatible,
    compare_layouts,
    latest_step,
    orbax_store,
    read_meta,
    read_plan,
    resolve_step_dir,
    shard_arrays,
)
from chunkzero.checkpoint import list_steps as checkpoint_steps
from chunkzero.checkpoint.agreement import check_agreement, failed_ranks, load_outcome, save_target
from chunkzero.checkpoint.orbax_store import wait_until_finished
from chunkzero.checkpoint.reader import ChunkReader, read_shards
from chunkzero.errors import CheckpointError, ConfigError
from chunkzero.layout import ChunkLayout

from ..zero.collectives import all_gather_json
from . import ema_shards, load_modes, optim_shards
from .load_modes import WeightsLoad
from .numpy_bridge import to_numpy, to_torch, torch_dtype
from .parallel_write import process_mesh, write_shards
from .rng import reseed, rng_state, set_rng_state

logger = logging.getLogger("chunkzero.checkpoint")

__all__ = [
    "ChunkReader",
    "ReadPiece",
    "check_compatible",
    "checkpoint_steps",
    "latest_step",
    "load_checkpoint",
    "process_mesh",
    "read_meta",
    "read_plan",
    "read_shards",
    "resolve_step_dir",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "to_numpy",
    "to_torch",
    "wait_until_finished",
    "write_shards",
]


def _json_ready(value: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} must be JSON-serializable: {e}") from None


def _model_config(model) -> dict | None:
    config = getattr(getattr(model, "module", model), "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        return json.loads(json.dumps(to_dict()))
    except (TypeError, ValueError):
        logger.warning("the model's config is not JSON-serializable; pass model_config= to save it")
        return None


def save_checkpoint(
    directory: str | os.PathLike,
    model,
    optimizer=None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
    max_to_keep: int | None = None,
    model_config: Mapping[str, Any] | None = None,
    data_position: Mapping[str, Any] | None = None,
    timeout_s: float = orbax_store.DEFAULT_TIMEOUT_S,
) -> Path:
    """Save ``model`` (a :class:`~torch_backend.ZeroDDP`) and ``optimizer`` as step ``step`` (collective).

    Every rank of the model's process group calls it; each writes only its own shards (see the module
    docstring). The checkpoint is ``directory/<step>/``, an Orbax checkpoint of the
    :mod:`chunkzero.checkpoint` format.

    Args:
        directory: checkpoint root (created if missing).
        step: training step (an int ``>= 0`` after every step already saved; never overwritten).
        optimizer: the :class:`~torch_backend.ZeroOptimizer`, or ``None`` for parameters only. Its
            :class:`~torch_backend.ZeroEMA` (``optimizer.ema``), when it has one, is saved too: the
            ``ema`` arrays and the metadata's ``ema`` record (decay, warm-up, update count).
        extra: anything JSON-serializable to keep in ``meta.extra``.
        async_save: return once the shards are copied to host memory and handed to Orbax; the next
            save, a load of ``directory`` or the process's exit waits for the write to commit.
        max_to_keep: keep only the newest ``max_to_keep`` steps (older ones are deleted after a commit).
        model_config: JSON-able model configuration (default: ``module.config.to_dict()`` if the
            wrapped module has one — GPT and Hugging Face models do).
        data_position: JSON-able data-loader position (e.g. a sampler's ``state_dict()``).
        timeout_s: the longest, in seconds, that any wait of the save for the other ranks may take
            (the start of ``jax.distributed`` and every Orbax barrier, an asynchronous save's commit
            included), so a rank that died or never arrives ends the save with an error. The gather
            before the write is bounded by the process group's own timeout.

    Returns:
        ``directory/<step>``.

    Raises:
        ConfigError: ``model`` is not a ZeroDDP, bad ``step``, ``max_to_keep`` or ``timeout_s``, or metadata
            that is not JSON-serializable.
        CheckpointError: the ranks were given different directories, steps, ``max_to_keep`` or chunk
            layouts (on every rank, before anything is written; names the field and both values);
            ``step`` exists already or is before the latest step; another rank did not arrive within
            ``timeout_s``; or Orbax failed.
    """
    load_modes.require_zero_ddp(model, "save_checkpoint")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    timeout_s = orbax_store.check_timeout(timeout_s)
    model.synchronize()  # no collective still writing a shard this save reads
    layout: ChunkLayout = model.layout
    rank = int(model.rank)
    shard_rank, replicas = int(getattr(model, "shard_rank", rank)), int(getattr(model, "replicas", 1))
    group = getattr(model, "process_group", None)
    own_rng = rng_state()
    params: dict[int, np.ndarray] = {}
    for c in layout.chunks:
        # views of the live shards: write_shards hands Orbax a JAX-owned copy before returning
        shard = model.master_shard(c.index)
        params[c.index] = to_numpy(shard if c.requires_grad else shard.to(torch_dtype(c.dtype)), copy=False)
    optim_meta, optim = (None, {}) if optimizer is None else optim_shards.optimizer_shards(model, optimizer)
    ema_meta, ema = ema_shards.ema_shards(model, optimizer)
    if model_config is None:
        model_config = _model_config(model)
    meta = CheckpointMeta(
        step=step,
        layout=layout,
        mixed_precision=str(getattr(model, "mixed_precision", "fp32")),
        optimizer=optim_meta,
        loss_scaler=None if optimizer is None else _json_ready(optimizer.loss_scaler_state(), "loss-scaler state"),
        model_config=None if model_config is None else _json_ready(dict(model_config), "model_config"),
        data_position=None if data_position is None else _json_ready(dict(data_position), "data_position"),
        extra=None if extra is None else _json_ready(dict(extra), "extra"),
        ema=ema_meta,
        replicas=replicas,
    )
    # One gather before any write: what each rank was asked to save (compared: ranks given different
    # directories or steps fail here, together, instead of waiting for each other inside Orbax), its
    # RNG state and the checksums of its own shards.
    target = save_target(directory, step, layout, max_to_keep=max_to_keep)
    own = {
        "target": target,
        "rng": own_rng,
        "sums": meta.shard_checksums(shard_rank, shard_arrays(meta, params, optim, ema)),
    }
    try:
        everyone = all_gather_json(own, group)
    except RuntimeError as e:  # a peer died, or did not call the save within the process group's timeout
        raise CheckpointError(f"the ranks could not agree on saving step {step} to {target['directory']!r}: {e}") from e
    check_agreement([e["target"] for e in everyone], "save")
    meta.rng_states = [e["rng"] for e in everyone]
    # each shard once: from replica 0's ranks (hybrid sharding; the group's first S ranks)
    meta.checksums = meta.checksums_from_ranks([e["sums"] for e in everyone][: layout.world_size])
    try:
        return write_shards(
            directory,
            meta,
            rank,
            params,
            optim,
            ema=ema,
            async_save=async_save,
            max_to_keep=max_to_keep,
            process_group=group,
            timeout_s=timeout_s,
        )
    finally:
        # Orbax and JAX draw from Python's and numpy's global RNGs (temporary names, ids): a save must
        # leave the training RNG streams exactly where they were, or runs with and without saves diverge.
        set_rng_state(own_rng, source="RNG state before the save")


def load_checkpoint(
    directory: str | os.PathLike,
    model,
    optimizer=None,
    step: int | None = None,
    *,
    load_rng: bool = True,
    load_hyperparameters: bool = True,
    staged: bool = True,
    mode: str = "resume",
    force: bool = False,
    prefix: str = "",
    model_prefix: str = "",
) -> CheckpointMeta | WeightsLoad:
    """Restore ``model`` and ``optimizer`` from a checkpoint of any world size or chunk size.

    Every rank of the model's process group calls it. Each rank reads only the element ranges its
    shards now hold (tensors matched by name; see the module docstring), then the ranks agree (one
    all-gather of JSON) that every one of them succeeded, and read the same step, before any rank
    changes its model. Files are never modified.

    Staged (the default): everything is read into new buffers — checked against the metadata, the
    model's layout and the checksums — the ranks agree, and only then is it copied into the model,
    so a failure on any rank (a truncated file, a checksum mismatch, another step) leaves every
    rank's model and optimizer exactly as they were. This holds a second copy of this rank's shards
    (parameters and optimizer state) in memory during the load. ``staged=False`` reads straight into
    the live CPU shards instead (TensorStore copies into them; no second copy): everything that can
    be checked without reading array data is still checked before the model is touched, but a read
    error *during* the reads leaves this rank's shards partly overwritten (the error says so).

    Restores: fp32 master shards (and the low-precision shards from them), optimizer state shards and
    step counts (per tensor where they differ), every param group's hyper-parameters (``lr``, ``betas``
    …, not kernel flags like ``foreach``) and ``max_norm``, the loss scaler, and — when the checkpoint
    was saved at this world size — each rank's Python, numpy, torch and CUDA RNG states. At another
    world size the RNGs are re-seeded from ``(step, rank)`` with a warning. The optimizer's
    :class:`~torch_backend.ZeroEMA` (``optimizer.ema``), when it has one, gets the saved EMA shards and
    update count (and, with ``load_hyperparameters``, the decay and warm-up); from a checkpoint saved
    without an EMA it restarts at the loaded weights (update count 0), with a warning.

    Args:
        directory: checkpoint root, or one step's directory.
        step: the step to load (default: the latest committed one).
        optimizer: the :class:`~torch_backend.ZeroOptimizer` to restore, or ``None`` (parameters only).
        load_rng: restore (or re-seed) the RNG states.
        load_hyperparameters: overwrite the optimizer's hyper-parameters (every group's, and
            ``max_norm``) with the saved ones; the saved groups must then hold the same tensors.
        staged: read everything before touching the model (see above).
        mode: what to restore (SwissArmyTransformer's three modes, :mod:`.load_modes`): ``"resume"``
            (SAT's ``"pretrain"``, also accepted): everything above. ``"finetune"``: the parameters
            only (no optimizer, no RNG; the run starts at step 0 with a fresh optimizer); the model's
            tensors the checkpoint lacks keep their current values (the module's own init) and
            the checkpoint's tensors the model lacks are skipped, both logged and returned.
            ``"inference"``: the parameters only, then ``model.eval()``; a tensor the checkpoint lacks
            raises unless ``force``.
        force: with ``mode="inference"`` only, load even if the checkpoint lacks some of the model's
            tensors (SAT's ``force_inference``; they keep their current values).
        prefix, model_prefix: weights-only modes: match the checkpoint's tensor names to the model's
            after removing ``prefix`` from them (only names under it are considered, as in
            :func:`~torch_backend.load_pretrained`'s ``prefix``: load a sub-model of the saved one) and
            then putting ``model_prefix`` before them (the model wraps the saved one, e.g.
            ``model_prefix="backbone."``).

    Returns:
        ``mode="resume"``: the checkpoint's :class:`~chunkzero.checkpoint.CheckpointMeta`
        (``meta.data_position``, ``meta.model_config``, ``meta.extra`` …). The weights-only modes: a
        :class:`~torch_backend.checkpoint.load_modes.WeightsLoad` (``missing_keys``,
        ``unexpected_keys``, ``mode``, ``step == 0``, ``meta``), which unpacks as
        ``missing, unexpected`` like torch's ``load_state_dict`` result.

    Raises:
        CheckpointError: no such step, a truncated or missing array (names the file and array), a
            tensor of the model missing from the checkpoint or vice versa, an optimizer of another class,
            a checkpoint without optimizer state, param groups of other tensors (with
            ``load_hyperparameters``), another rank failed (names it and its error), or the ranks
            resolved different step directories (names both); with ``mode="resume"`` every tensor
            the model lacks or the checkpoint lacks is listed (capped). A weights-only load that
            matches no tensor at all (names of both sides shown, a prefix suggested). On every rank together.
        CheckpointFormatError: malformed metadata (names the file and field).
        ShapeMismatchError: a tensor's shape differs between the model and the checkpoint.
        ConfigError: ``model`` is not a ZeroDDP, an unknown ``mode``, an optimizer given to a
            weights-only mode, ``force`` with another mode than ``"inference"``, or a prefix with
            ``mode="resume"``.
    """
    load_modes.require_zero_ddp(model, "load_checkpoint")
    mode = load_modes.resolve_mode(mode, optimizer, force)
    weights_only = mode != "resume"
    if (prefix or model_prefix) and not weights_only:
        raise ConfigError("prefix= and model_prefix= apply to the weights-only modes: mode='resume' restores the "
                          "optimizer state of the very same tensors; pass mode='finetune'")
    missing: list[str] = []
    unexpected: list[str] = []
    model.synchronize()  # no collective still writing a shard this load overwrites
    rank, world = int(model.rank), int(model.world_size)
    group = getattr(model, "process_group", None)
    error: BaseException | None = None
    reader: ChunkReader | None = None
    step_dir: Path | None = None
    try:
        step_dir = orbax_store.committed_step_dir(directory, step)
        meta = read_meta(step_dir)
        saved_layout, saved_names = load_modes.renamed(meta.layout, prefix, model_prefix)
        # the same layouts on every rank: every rank finds the same keys
        missing, unexpected = compare_layouts(saved_layout, model.layout, source=str(step_dir))
        unexpected = [saved_names.get(n, n) for n in unexpected]
        if weights_only:
            load_modes.check_matched(model.layout, meta.layout, missing, str(step_dir))
            load_modes.check_missing(mode, missing, force, str(step_dir))
        else:
            load_modes.check_complete(missing, unexpected, str(step_dir))
        optim_keys = _check_optimizer(model, optimizer, meta, step_dir, load_hyperparameters)
        read_from = meta if saved_layout is meta.layout else dataclasses.replace(meta, layout=saved_layout)
        reader = ChunkReader(step_dir, read_from)
        into = {} if staged else optim_shards.live_buffers(model, optimizer, optim_keys)
        shard_rank = int(getattr(model, "shard_rank", rank))  # the layout's rank (hybrid: in the shard group)
        params, optim = read_shards(step_dir, read_from, model.layout, shard_rank, optim_keys=optim_keys, reader=reader,
                                    into=into, missing_ok=weights_only)
        ema = ema_shards.read(step_dir, meta, model, optimizer, shard_rank, reader)
    except Exception as e:  # noqa: BLE001 - agree first, re-raise after
        error = e
        if not staged and reader is not None and reader.reads_started and isinstance(e, CheckpointError):
            error = type(e)(f"{e} (this rank's shards are now partly overwritten: load a good checkpoint, or load "
                            "staged, the default, to keep the model intact on failure)")
    model_state = (
        "no rank's model was changed"
        if staged
        else "this rank's shards were loaded; the ranks now disagree: load again"
    )
    try:
        outcomes = all_gather_json(load_outcome(step_dir, error), group)
    except RuntimeError as e:  # a peer died, or did not call the load within the process group's timeout
        here = "this rank's model is unchanged" if staged else "this rank's shards may be partly overwritten"
        raise CheckpointError(f"the ranks could not agree on the load of {str(directory)!r} ({here}): {e}") from (
            error or e
        )
    if error is not None:
        raise error
    failed = failed_ranks(outcomes)
    if failed:
        q, why = failed[0]
        raise CheckpointError(f"rank {q} failed to read the checkpoint under {str(directory)!r} ({model_state}): {why}")
    try:
        check_agreement([{"step_dir": o["step_dir"]} for o in outcomes], "load")
    except CheckpointError as e:
        raise CheckpointError(f"{e} ({model_state})") from None

    if weights_only:
        load_modes.keep_own_init(model, params, missing)
    for i, shard in params.items():
        model.load_master_shard(i, to_torch(shard))  # in place already: refreshes the low-precision shard
    if weights_only:
        result = load_modes.WeightsLoad(missing, unexpected, mode, meta)
        load_modes.report(result, rank, str(step_dir))
        load_modes.finish(model, mode)
        return result
    if optimizer is not None and meta.optimizer is not None:
        optim_shards.load_optimizer_state(model, optimizer, meta.optimizer, optim)
        if meta.loss_scaler is not None:
            optimizer.load_loss_scaler_state(meta.loss_scaler)
        if load_hyperparameters:
            optim_shards.load_hyperparameters(optimizer, meta.optimizer)
    ema_shards.load(optimizer, meta, ema, step_dir, load_hyperparameters=load_hyperparameters)
    if load_rng:
        if meta.rng_states is not None and len(meta.rng_states) == world:
            set_rng_state(meta.rng_states[rank], source=f"{step_dir}/{META_ITEM} rng_states[{rank}]")
        else:
            seed = (meta.step * 1_000_003 + rank) % 2**63
            saved = ("no RNG states (its run drew none, as a JAX run, or did not save them)" if meta.rng_states is None
                     else f"RNG states of {len(meta.rng_states)} ranks, this run has {world}")
            logger.warning("checkpoint %s holds %s: re-seeding rank %d's Python/numpy/torch RNGs with %d",
                           step_dir, saved, rank, seed)
            reseed(seed)
    return meta


def _check_optimizer(model, optimizer, meta: CheckpointMeta, step_dir: Path, load_hyperparameters: bool) -> list[str]:
    """The optimizer-state keys to read, once the checkpoint is known to hold this optimizer's state
    (and, with ``load_hyperparameters``, its param groups).

    Raises:
        CheckpointError: no optimizer state saved, another optimizer class, other param groups.
    """
    if optimizer is None:
        return []
    if meta.optimizer is None:
        raise CheckpointError(f"checkpoint {str(step_dir)!r} holds no optimizer state (saved without an optimizer)")
    inner = getattr(optimizer, "optimizer", optimizer)
    if meta.optimizer.class_name != optim_shards.class_name(inner):
        raise CheckpointError(
            f"checkpoint {str(step_dir)!r} holds {meta.optimizer.class_name} state, the optimizer is "
            f"{optim_shards.class_name(inner)} (pass optimizer=None to load parameters only)"
        )
    if load_hyperparameters:
        optim_shards.check_param_groups(model, optimizer, meta.optimizer, source=f"checkpoint {str(step_dir)!r}")
    return list(meta.optimizer.state_keys)
