"""Orbax reading and writing of chunkzero checkpoints, shared by both backends.

The format is defined in :mod:`chunkzero.checkpoint` (DESIGN.md §5): ``<root>/<step>/`` is an
``orbax.checkpoint.CheckpointManager`` step directory with two items,

* ``state`` (:data:`~chunkzero.checkpoint.STATE_ITEM`), written with ``ocp.args.StandardSave(tree)``,
  ``tree = {"params": {chunk_key: Array[size]}, "optim": {state_key: {chunk_key: f32[size]}}}``;
* ``meta`` (:data:`~chunkzero.checkpoint.META_ITEM`), written with ``ocp.args.JsonSave(meta.to_dict())``.

These helpers do only Orbax plumbing and know nothing of devices or models, so the torch backend
can write through :func:`write_checkpoint` and both backends can read metadata without loading
arrays. Restoring reads ``state`` through a ``PyTreeCheckpointHandler`` (the same on-disk format
``StandardSave`` writes) so that a subset of the tree (parameters without optimizer state) can be
restored, each array with its own target sharding and shape.

Every failure is a :class:`chunkzero.errors.CheckpointError` naming the path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from chunkzero.checkpoint import (  # noqa: F401 (step and meta readers re-exported for JAX users)
    META_ITEM,
    STATE_ITEM,
    CheckpointMeta,
    is_step_dir,
    latest_step,
    list_steps,
    read_meta,
    resolve_step_dir,
)
from chunkzero.errors import CheckpointError, CheckpointFormatError, ConfigError

PathLike = str | os.PathLike

def _handlers(for_restore: bool) -> dict[str, ocp.CheckpointHandler]:
    state = ocp.PyTreeCheckpointHandler() if for_restore else ocp.StandardCheckpointHandler()
    return {STATE_ITEM: state, META_ITEM: ocp.JsonCheckpointHandler()}


def checkpoint_manager(root: PathLike, *, read_only: bool = True,
                       options: ocp.CheckpointManagerOptions | None = None) -> ocp.CheckpointManager:
    """An ``ocp.CheckpointManager`` on ``root`` with the items ``state`` and ``meta``.

    Args:
        root: the directory holding one sub-directory per step.
        read_only: ``True`` for reading (``state`` through ``PyTreeCheckpointHandler``, so partial
            restores work; ``root`` must exist); ``False`` for writing (``StandardCheckpointHandler``;
            ``root`` is created).
        options: extra ``CheckpointManagerOptions`` for writing (``max_to_keep``,
            ``multiprocessing_options``, ``enable_async_checkpointing`` …); ``read_only`` and
            ``create`` are set from ``read_only``.

    Raises:
        CheckpointError: reading and ``root`` does not exist.
    """
    root = Path(root)
    if read_only and not root.is_dir():
        raise CheckpointError(f"checkpoint directory does not exist: {root}")
    opts = options or ocp.CheckpointManagerOptions()
    # read-only managers never save: set save_interval_steps=0 as Orbax would, without its warning per manager
    opts = dataclasses.replace(opts, read_only=read_only, create=not read_only,
                               save_interval_steps=0 if read_only else opts.save_interval_steps)
    return ocp.CheckpointManager(root.absolute(), item_handlers=_handlers(read_only), options=opts)


def resolve_checkpoint(path: PathLike, step: int | None = None) -> tuple[Path, int]:
    """``(root, step)`` for a step directory or a root (then ``step``, default the latest).

    Raises:
        CheckpointError, ConfigError: as :func:`chunkzero.checkpoint.resolve_step_dir`.
    """
    d = resolve_step_dir(path, step)
    return d.parent, int(d.name)


def step_dir(root: PathLike, step: int) -> Path:
    """``<root>/<step>`` (the default Orbax step naming, no prefix or padding)."""
    return Path(root) / str(int(step))


def read_array_metadata(path: PathLike, step: int | None = None) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """Global shape and dtype of every array in the ``state`` item, without reading any array.

    Returns:
        ``{("params", "chunk_0000"): ((size,), "float32"), ("optim", "exp_avg", "chunk_0000"): ...}``,
        the same form as :meth:`CheckpointMeta.expected_arrays`.

    Raises:
        CheckpointError: missing path or step, or unreadable ``state`` metadata (names the path).
    """
    root, s = resolve_checkpoint(path, step)
    where = step_dir(root, s) / STATE_ITEM
    try:
        with checkpoint_manager(root) as mngr:
            tree = mngr.item_metadata(s)[STATE_ITEM]
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint array metadata {where}: {type(e).__name__}: {e}") from e
    if tree is None:
        raise CheckpointError(f"checkpoint has no {STATE_ITEM!r} item: {where}")
    tree = getattr(tree, "tree", tree)
    out: dict[tuple[str, ...], tuple[tuple[int, ...], str]] = {}

    def walk(prefix: tuple[str, ...], node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk((*prefix, str(k)), v)
        else:
            out[prefix] = (tuple(int(d) for d in node.shape), str(node.dtype))

    walk((), tree)
    return out


def check_arrays(meta: CheckpointMeta, arrays: Mapping[tuple[str, ...], tuple[tuple[int, ...], str]], *,
                 source: str, with_optimizer: bool = True) -> None:
    """Check that the ``state`` item holds every array ``meta`` promises, with its shape and dtype.

    Args:
        arrays: from :func:`read_array_metadata`.
        source: the step directory, for messages.
        with_optimizer: also require the optimizer-state arrays.

    Raises:
        CheckpointFormatError: the first missing or mis-shaped array (names ``source``, the array
            path, and both shapes or dtypes).
    """
    for path, (shape, dtype) in meta.expected_arrays().items():
        if path[0] != "params" and not with_optimizer:
            continue
        name = "/".join(path)
        if path not in arrays:
            raise CheckpointFormatError(f"{source}: array {name!r} listed by the metadata is missing from {STATE_ITEM!r}")
        got_shape, got_dtype = arrays[path]
        if got_shape != shape or got_dtype != dtype:
            raise CheckpointFormatError(
                f"{source}: array {name!r} is {got_dtype}{list(got_shape)}, the metadata's layout says {dtype}{list(shape)}"
            )


def write_checkpoint(root: PathLike, step: int, state: Mapping[str, Any], meta: CheckpointMeta | Mapping[str, Any], *,
                     options: ocp.CheckpointManagerOptions | None = None) -> Path:
    """Write one step: ``state`` with ``StandardSave`` and ``meta`` with ``JsonSave``; wait until it is final.

    Orbax writes into a temporary directory and renames it when complete, so a save that dies
    midway leaves the previous step as the latest. Each process writes only the array shards it
    owns (``jax.Array`` s with shardings; numpy arrays are written by the primary process).

    Args:
        root: checkpoint root (created if missing).
        step: the step number, ``>= 0``; must not exist yet and not be before the latest step.
        state: ``{"params": {...}, "optim": {...}}`` of arrays (see the module docstring).
        meta: a :class:`CheckpointMeta` (its ``to_dict()`` is saved) or an already-built document.
        options: passed to :func:`checkpoint_manager` (e.g. ``multiprocessing_options``).

    Returns:
        The step directory ``<root>/<step>``.

    Raises:
        CheckpointError: ``step`` already exists under ``root`` (nothing is overwritten) or is before
            the latest step, ``meta`` does not validate or is not JSON, or Orbax fails (names the path).
        ConfigError: ``step`` is not a non-negative int.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    doc = meta.to_dict() if isinstance(meta, CheckpointMeta) else dict(meta)
    target = step_dir(root, step)
    try:  # never write what cannot be read back
        parsed = CheckpointMeta.from_json(json.dumps(doc), source=f"metadata to save at {target}")
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointFormatError):
            raise
        raise CheckpointError(f"metadata to save at {target} is not JSON-serializable: {e}") from None
    if parsed.step != step:
        raise CheckpointError(f"metadata step {parsed.step} differs from the step {step} being saved")
    try:
        with checkpoint_manager(root, read_only=False, options=options) as mngr:
            existing = sorted(mngr.all_steps())
            if step in existing:
                raise CheckpointError(f"checkpoint step {step} already exists at {target}; not overwriting it")
            if existing and step < existing[-1]:
                raise CheckpointError(f"step {step} is before the latest step {existing[-1]} under {root}; "
                                      "steps only grow (write elsewhere to branch)")
            mngr.save(
                step,
                args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(doc)}),
                force=True,
            )
            mngr.wait_until_finished()
    except CheckpointError:
        raise
    except Exception as e:
        if type(e).__name__ == "StepAlreadyExistsError":
            raise CheckpointError(f"checkpoint step {step} already exists at {target}; not overwriting it") from e
        raise CheckpointError(f"cannot write checkpoint {target}: {type(e).__name__}: {e}") from e
    return target


def restore_state(path: PathLike, step: int | None, item: Mapping[str, Any], restore_args: Mapping[str, Any]) -> dict:
    """Restore a subset of the ``state`` item.

    Args:
        path, step: as :func:`resolve_checkpoint`.
        item: the subtree to restore (e.g. ``{"params": {chunk_key: jax.ShapeDtypeStruct}}``); arrays
            not in it are not read.
        restore_args: the same structure of ``ocp.ArrayRestoreArgs`` (target ``sharding``,
            ``global_shape`` — a different size pads with zeros or truncates when ``strict=False`` —
            and ``dtype``) or ``ocp.RestoreArgs(restore_type=np.ndarray)`` for numpy.

    Returns:
        The restored tree, shaped like ``item``.

    Raises:
        CheckpointError: missing path or step, or Orbax cannot read an array (names the path).
    """
    root, s = resolve_checkpoint(path, step)
    where = step_dir(root, s) / STATE_ITEM
    try:
        with checkpoint_manager(root) as mngr:
            restored = mngr.restore(
                s,
                args=ocp.args.Composite(
                    **{STATE_ITEM: ocp.args.PyTreeRestore(item=dict(item), restore_args=dict(restore_args), partial_restore=True)}
                ),
            )
    except Exception as e:
        raise CheckpointError(f"cannot restore checkpoint arrays from {where}: {type(e).__name__}: {e}") from e
    return restored[STATE_ITEM]
