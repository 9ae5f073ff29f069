"""The one place that touches Orbax: every ``CheckpointManager`` is built here, every save and restore
goes through it, and so do the Orbax files and read specs that the TensorStore reader and the export use.

Nothing imports ``orbax.checkpoint`` (nor, through it, JAX) until a function here needs it — :func:`_ocp`
is the one accessor — so ``import chunkzero`` stays framework-free.

**Managers.** One write manager per checkpoint root and process, cached and rebuilt when its options
change, so saves to a root queue behind one another. An asynchronous save returns once Orbax holds the
arrays; the next save, :func:`wait_until_finished`, a read of the same root (:func:`committed_step_dir`) or
the process's exit waits for its commit. Read-only managers are built per read.

**Saves** (:func:`save_step`, used by the torch ranks' parallel write and by JAX). The metadata is read
back before anything is written; the step must be new and after the latest committed step (nothing is
overwritten); Orbax writes into a temporary directory and renames it once every process has finished
(the atomic commit), so a save killed midway leaves the previous step as the latest; ``max_to_keep``
deletes older steps after a commit, never the newest one saved with a finite loss (:func:`_keep_policy`).
Each process writes the shards its ``jax.Array`` s hold (OCDBT, one data sub-tree per process); a
replicated array is written once.

**Restores** with target shardings (:func:`restore_arrays`) serve JAX; the torch ranks read with
TensorStore through :mod:`chunkzero.checkpoint.reader`, opened with Orbax's own read spec
(:func:`chunkzero.checkpoint.orbax_files.array_read_spec`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, CheckpointSaveError, ConfigError
from .meta import META_FILENAME, META_ITEM, STATE_ITEM, ArrayPath, CheckpointMeta
from .orbax_logs import quiet_expected_warnings, quiet_saves
from .steps import list_steps, resolve_step_dir
from .tree import flat_arrays, state_tree

logger = logging.getLogger("chunkzero.checkpoint")

COMPRESS = os.environ.get("CHUNKZERO_CHECKPOINT_COMPRESS", "0") == "1"
"""Compress the ``state`` arrays with zstd. Off by default: fp32 training state compresses by ~9% at a
large CPU cost, and integrity is checked by checksums."""


def _ocp():
    """``orbax.checkpoint``, imported on first use (it imports JAX)."""
    import orbax.checkpoint as ocp

    return ocp


# ====================================================================== write managers (one per root)


@dataclasses.dataclass
class _Managed:
    manager: Any
    options: Any
    pending_step: int | None = None
    """The step of the asynchronous save handed over last (what a failure of its commit names)."""


_MANAGERS: dict[str, _Managed] = {}
_MANAGERS_LOCK = threading.Lock()
_HANDOVER_LOCK = threading.Lock()
"""Held while a save is handed over to Orbax (:func:`_barrier_timeout` changes a process-wide value)."""
_EXIT_HOOK_REGISTERED = False


DEFAULT_TIMEOUT_S = 300.0
"""Default bound, in seconds, on every wait of a save for the other processes (Orbax's own default
for its barriers)."""


def check_timeout(timeout_s: Any) -> float:
    """``timeout_s`` as a float of seconds.

    Raises:
        ConfigError: it is not a positive finite number.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def whole_seconds(timeout_s: float) -> int:
    """``timeout_s`` rounded up to whole seconds, at least 1 (Orbax's and JAX's timeouts are ints)."""
    return max(1, math.ceil(timeout_s))


def _manager_options(max_to_keep: int | None, options: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     directory: Path | None = None) -> Any:
    """The write options of a root: the caller's ``CheckpointManagerOptions`` (default: asynchronous
    saves) with ``max_to_keep`` applied (:func:`_keep_policy`: never the newest finite step of ``directory``)
    and every barrier bounded by ``timeout_s``.

    Orbax waits for the other processes in two kinds of barrier. The commit of an asynchronous save
    (``async_write_complete`` / ``async_commit_complete``) waits at most ``AsyncOptions.timeout_secs``,
    counted from the start of the background write; it is set to ``timeout_s``. The manager's and the
    checkpointer's own barriers (``save_start``, ``old_steps_to_remove`` …) are a JAX collective
    without any timeout unless ``active_processes`` is set, and then a barrier of the
    ``jax.distributed`` coordination service with a deadline (:func:`_barrier_timeout`); with more
    than one process it is set to all of them. Orbax then refuses to create the root itself
    (``create=False``): :func:`save_step` creates it.
    """
    ocp = _ocp()
    import jax

    if options is None:
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    processes = options.multiprocessing_options
    if jax.process_count() > 1 and processes.active_processes is None:
        processes = dataclasses.replace(processes, active_processes=set(range(jax.process_count())))
    waits = dataclasses.replace(options.async_options or ocp.AsyncOptions(), timeout_secs=whole_seconds(timeout_s))
    options = dataclasses.replace(options, read_only=False, create=False, multiprocessing_options=processes,
                                  async_options=waits)
    if max_to_keep is None and options.preservation_policy is None:
        max_to_keep = options.max_to_keep  # (a caller's CheckpointManagerOptions(max_to_keep=N): the same rule)
    if max_to_keep is None:
        return options
    return dataclasses.replace(options, max_to_keep=None, preservation_policy=_keep_policy(max_to_keep, directory))


FINITE_KEY = "finite"
"""``meta.extra[FINITE_KEY]``: whether the step was saved healthy: a finite training loss, and the step applied
(not skipped for non-finite gradients), as the training loops of both engines set it (a step without it
counts as finite). :func:`save_step`'s ``max_to_keep`` never deletes the newest finite step."""

_SAVING_FINITE: dict[tuple[str, int], bool] = {}
"""``(root, step) -> finite`` of the steps this process is saving or has saved: the preservation policy reads
it before a step's metadata is on disk (an asynchronous save), so the step being saved counts at once."""


def saved_finite(step_dir: str | os.PathLike) -> bool:
    """Whether committed step ``step_dir`` was saved with a finite loss (``meta.extra``'s :data:`FINITE_KEY`;
    absent counts as finite); ``False`` when its metadata cannot be read."""
    try:
        doc = json.loads((Path(step_dir) / META_ITEM / META_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    extra = doc.get("extra") if isinstance(doc, dict) else None
    return not isinstance(extra, dict) or extra.get(FINITE_KEY, True) is not False


def _keep_policy(max_to_keep: int, directory: Path | None) -> Any:
    """Orbax's preservation of a root: its newest ``max_to_keep`` steps, and the newest finite one
    (:func:`saved_finite`) however old, so a run gone non-finite never rotates out its last good step."""
    ocp = _ocp()
    managers = ocp.checkpoint_managers
    policies = [managers.LatestN(n=max_to_keep)]
    if directory is not None:
        policies.append(_newest_finite_policy()(str(directory)))
    return managers.AnyPreservationPolicy(policies)


@functools.cache
def _newest_finite_policy() -> type:
    """The Orbax ``PreservationPolicy`` that keeps the newest finite step of a root (built on first use:
    Orbax is imported lazily)."""
    managers = _ocp().checkpoint_managers

    @dataclasses.dataclass(frozen=True)
    class NewestFinite(managers.PreservationPolicy):
        root: str

        def should_preserve(self, checkpoints, *, context):  # noqa: ARG002 - Orbax's PreservationPolicy signature
            finite = [c.step for c in checkpoints if self.finite(c.step)]
            newest = max(finite, default=None)
            return [c.step == newest for c in checkpoints]

        def finite(self, step: int) -> bool:
            known = _SAVING_FINITE.get((self.root, step))
            return saved_finite(Path(self.root) / str(step)) if known is None else known

    return NewestFinite


@contextmanager
def _barrier_timeout(timeout_s: float) -> Iterator[None]:
    """Bound Orbax's main-thread barriers by ``timeout_s`` while a save is handed over.

    Orbax gives those barriers no per-call timeout: they wait ``multihost.coordination_timeout()``
    seconds, a module constant (300). It is set for the duration of the hand-over, under the
    lock of save hand-overs (``_HANDOVER_LOCK``), and restored after.
    """
    from orbax.checkpoint._src.multihost import multihost

    previous = getattr(multihost, "_DEFAULT_BARRIER_TIMEOUT", None)
    if previous is None:  # another Orbax: its own timeouts apply
        yield
        return
    multihost._DEFAULT_BARRIER_TIMEOUT = whole_seconds(timeout_s)
    try:
        yield
    finally:
        multihost._DEFAULT_BARRIER_TIMEOUT = previous


def _manager(directory: Path, options: Any):
    """The cached write manager of ``directory`` (an absolute path), rebuilt if ``options`` changed."""
    ocp = _ocp()
    key = str(directory)
    with _MANAGERS_LOCK:
        m = _MANAGERS.get(key)
        if m is not None and m.options == options:
            return m.manager
        if m is not None:
            m.manager.wait_until_finished()
            m.manager.close()
        _register_exit_hook()
        quiet_saves()
        # ``state`` through the PyTree handler: the on-disk format of ``StandardSave``, and subsets restore
        handlers = {
            STATE_ITEM: ocp.PyTreeCheckpointHandler(use_compression=COMPRESS),
            META_ITEM: ocp.JsonCheckpointHandler(),
        }
        manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
        _MANAGERS[key] = _Managed(manager, options)
        return manager


def wait_until_finished(directory: str | os.PathLike | None = None) -> None:
    """Block until this process's pending asynchronous saves (to the root ``directory``, or all) are committed.

    Called automatically before the next save, before a read of the same root and at exit. Each
    wait for the other processes is bounded by the save's ``timeout_s``.

    Raises:
        CheckpointSaveError: a pending save failed or timed out (names the root); its writer is dropped,
            so the next save to that root starts afresh.
    """
    with _MANAGERS_LOCK:
        items = list(_MANAGERS.items())
    want = None if directory is None else str(Path(directory).resolve())
    for key, m in items:
        if want is None or key == want:
            try:
                m.manager.wait_until_finished()
            except Exception as e:
                with _MANAGERS_LOCK:
                    if _MANAGERS.get(key) is m:
                        del _MANAGERS[key]
                timeout_s = m.options.async_options.timeout_secs if m.options.async_options else DEFAULT_TIMEOUT_S
                what = f"step {m.pending_step}" if m.pending_step is not None else "a pending save"
                raise CheckpointSaveError(_not_saved(what, Path(key), e, timeout_s, m.pending_step)) from e


def committed_step_dir(path: str | os.PathLike, step: int | None = None) -> Path:
    """:func:`~chunkzero.checkpoint.steps.resolve_step_dir` once this process's pending saves under
    ``path`` (a root or one step's directory) have committed, so a read sees every step it saved.

    Raises:
        CheckpointError, ConfigError: as ``resolve_step_dir``; a pending save failed (:func:`wait_until_finished`).
    """
    resolved = Path(path).resolve()
    wait_until_finished(resolved)
    wait_until_finished(resolved.parent)
    return resolve_step_dir(path, step)


def _register_exit_hook() -> None:
    """Wait for pending saves at exit, before Python stops its thread pools.

    Orbax commits an asynchronous save on worker threads; at interpreter exit ``concurrent.futures``
    refuses new work as soon as ``threading._shutdown`` runs its exit hooks — before ``atexit`` handlers.
    So the hook goes into the same list (``threading._register_atexit``, run last-registered first, i.e.
    before the thread pools' own hook registered at import); where that is unavailable, a plain
    ``atexit`` handler registered after JAX's and Orbax's.
    """
    global _EXIT_HOOK_REGISTERED
    if _EXIT_HOOK_REGISTERED:
        return
    _EXIT_HOOK_REGISTERED = True
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_finish_at_exit)
            return
        except RuntimeError:  # interpreter already shutting down
            pass
    atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    with _MANAGERS_LOCK:
        items = list(_MANAGERS.values())
        _MANAGERS.clear()
    for m in items:
        try:
            m.manager.wait_until_finished()
            m.manager.close()
        except Exception as e:  # pragma: no cover - exit path  # noqa: BLE001 - atexit: logs, must not raise
            logger.error("pending checkpoint save failed at exit: %s", e)


# ====================================================================== save


def _document(meta: CheckpointMeta) -> dict[str, Any]:
    """``meta`` as the JSON document to save, validated by reading it back (never write what cannot be read)."""
    try:
        doc = json.loads(json.dumps(meta.to_dict(), allow_nan=True))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint metadata must be JSON-serializable: {e}") from None
    CheckpointMeta.from_dict(doc, source="metadata to save")
    return doc


def save_step(
    directory: str | os.PathLike,
    meta: CheckpointMeta,
    state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    *,
    async_save: bool = False,
    max_to_keep: int | None = None,
    options: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Path:
    """Write step ``meta.step`` under ``directory`` (collective over the processes that hold ``state``'s shards).

    Args:
        directory: checkpoint root (created if missing).
        meta: the metadata document.
        state: the ``state`` tree (:func:`~chunkzero.checkpoint.tree.state_tree`) of ``jax.Array`` s
            (each process writes the shards it holds) or numpy arrays (written by the primary process),
            or a function returning it, called once the arguments are checked.
        async_save: return once Orbax holds the arrays; the commit completes in the background.
        max_to_keep: keep only the newest ``max_to_keep`` steps, and the newest step saved with a finite loss
            (``meta.extra["finite"]`` not ``False``) however old (``None``: keep all, or as ``options`` says).
        options: ``orbax.checkpoint.CheckpointManagerOptions`` to start from (``multiprocessing_options`` …).
        timeout_s: the longest, in seconds, that any wait for the other processes may take — each of
            Orbax's barriers, and the background write plus its commit (:func:`_manager_options`); a
            process that died or never arrives then ends the save with an error instead of a hang.

    Returns:
        ``directory/<step>`` (committed unless ``async_save``).

    Raises:
        ConfigError: bad ``step``, ``max_to_keep`` or ``timeout_s``, or metadata that is not JSON-serializable.
        CheckpointFormatError: the metadata does not validate.
        CheckpointError: the step exists already or is before the latest step (nothing is
            overwritten); :class:`~chunkzero.errors.CheckpointSaveError` when Orbax failed, the disk is full
            or a wait timed out (names the step and directory), or an earlier asynchronous save to
            ``directory`` failed.
    """
    step = meta.step
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    if max_to_keep is not None and (
        isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
    ):
        raise ConfigError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
    timeout_s = check_timeout(timeout_s)
    directory = Path(directory).resolve()  # Orbax wants absolute paths
    doc = _document(meta)
    tree = state() if callable(state) else state

    ocp = _ocp()
    with _HANDOVER_LOCK, _barrier_timeout(timeout_s):
        try:
            directory.mkdir(parents=True, exist_ok=True)  # by every process: Orbax does not with active_processes
            wait_until_finished(directory)  # an earlier save's failure surfaces here, before this one starts
            manager = _manager(directory, _manager_options(max_to_keep, options, timeout_s=timeout_s,
                                                                 directory=directory))
        except CheckpointError:
            raise  # an earlier save's: it names its step
        except Exception as e:  # the manager's barriers, or the root cannot be created
            raise CheckpointSaveError(_not_saved(f"step {step}", directory, e, timeout_s, step)) from e
        existing = list_steps(directory)
        if sorted(manager.all_steps()) != existing:  # the root changed outside this manager
            manager.reload()
        if step in existing:
            raise CheckpointError(f"step {step} already exists under {str(directory)!r}; refusing to overwrite it")
        if existing and step < existing[-1]:
            raise CheckpointError(f"step {step} is before the latest step {existing[-1]} under {str(directory)!r}; "
                                  "steps only grow (write elsewhere to branch)")
        try:
            items = {
                STATE_ITEM: ocp.args.PyTreeSave(tree, save_args=_save_args(meta, tree)),
                META_ITEM: ocp.args.JsonSave(doc),
            }
            extra = doc.get("extra")
            _SAVING_FINITE[(str(directory), step)] = not isinstance(extra, dict) or extra.get(FINITE_KEY) is not False
            saved = manager.save(step, args=ocp.args.Composite(**items), force=True)
            with _MANAGERS_LOCK:
                if (m := _MANAGERS.get(str(directory))) is not None:
                    m.pending_step = step
            if saved and not async_save:
                manager.wait_until_finished()
        except Exception as e:
            raise CheckpointSaveError(_not_saved(f"step {step}", directory, e, timeout_s, step)) from e
    if not saved:
        raise CheckpointError(f"Orbax declined to save step {step} under {str(directory)!r}")
    return directory / str(step)


def _save_args(meta: CheckpointMeta, tree: Mapping[str, Any]) -> dict[str, Any]:
    """Orbax ``SaveArgs`` per array: storage chunks of the array's storage block
    (:meth:`CheckpointMeta.storage_block_numel`, which divides what each process writes, so Orbax's
    chunk choice — the largest divisor of the write within ``chunk_byte_size`` — is that block)."""
    ocp = _ocp()
    return state_tree({p: ocp.SaveArgs(chunk_byte_size=meta.storage_block_numel(p) * np.dtype(a.dtype).itemsize)
                       for p, a in flat_arrays(tree).items()})


def _disk_full(e: BaseException, directory: Path) -> str | None:
    """``"the disk holding DIR is full (…)"`` when the failure ``e`` (or what caused it) says so (ENOSPC), or
    the disk holding ``directory`` has less room than its latest step takes (another process's write may
    have hit it, and this one only timed out waiting); else ``None``."""
    texts, seen = [], e
    while seen is not None and len(texts) < 8:
        texts.append(f"{seen} {getattr(seen, 'errno', '')}")
        seen = seen.__cause__ or seen.__context__
    said = any("No space left on device" in t or "os_error_code='28'" in t or "Errno 28" in t for t in texts)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    steps = list_steps(directory)
    need = sum(f.stat().st_size for f in (directory / str(steps[-1])).rglob("*") if f.is_file()) if steps else 0
    if not said and (free is None or free >= need):
        return None
    room = f"{free / 2**20:.1f} MiB free" if free is not None else "no room"
    size = f"; a step takes {need / 2**20:.1f} MiB" if need else ""
    return f"the disk holding {directory} is full ({room}{size})"


def _not_saved(what: str, directory: Path, e: BaseException, timeout_s: float, step: int | None) -> str:
    """The one line of a save that failed: the step, why (a full disk said so, not its traceback), and the
    newest committed step before it, which is intact."""
    why = _disk_full(e, directory) or _orbax_failure(e, timeout_s)
    before = [s for s in list_steps(directory) if step is None or s < step]
    kept = (f"step {before[-1]}, the previous checkpoint, is intact" if before
            else "no earlier checkpoint is saved under it")
    return f"{what} was not saved under {str(directory)!r}: {why}; {kept}"


def _orbax_failure(e: BaseException, timeout_s: float) -> str:
    """What went wrong in Orbax, in words: a timed-out wait for the other processes is said so."""
    full = f"{type(e).__name__}: {e}"
    text = full.strip().splitlines()[0]  # one line: XLA's errors carry their stack traces
    if isinstance(e, TimeoutError) or "DEADLINE_EXCEEDED" in full or "timed out" in full.lower():
        return (f"another process did not arrive within timeout_s={timeout_s:g} s (it died, hangs, or saves "
                f"elsewhere): {text}")
    return text


# ====================================================================== restore (JAX: target shardings)


@contextmanager
def _read_manager(root: Path) -> Iterator[Any]:
    """A read-only manager on ``root`` (``state`` through the PyTree handler, so subsets restore).

    A read waits for no other process: under ``jax.distributed`` (the torch ranks after their first
    save) the manager's barriers would otherwise make every read a collective of all processes. Its
    only process is this one, so Orbax skips them.
    """
    import jax

    ocp = _ocp()
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    # read-only managers never save: save_interval_steps=0 as Orbax would set it, without its warning
    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, multiprocessing_options=alone
    )
    handlers = {STATE_ITEM: ocp.PyTreeCheckpointHandler(), META_ITEM: ocp.JsonCheckpointHandler()}
    quiet_expected_warnings()
    with ocp.CheckpointManager(root.absolute(), item_handlers=handlers, options=options) as manager:
        yield manager


def read_array_metadata(
    path: str | os.PathLike, step: int | None = None
) -> dict[ArrayPath, tuple[tuple[int, ...], str]]:
    """Global shape and dtype of every array of a step's ``state`` item, without reading any array.

    Args:
        path, step: as :func:`~chunkzero.checkpoint.steps.resolve_step_dir`.

    Returns:
        ``{("params", "chunk_0000"): ((size,), "float32"), ("optim", "exp_avg", "chunk_0000"): ...}``,
        the form of :meth:`CheckpointMeta.expected_arrays`.

    Raises:
        CheckpointError: missing path or step, or unreadable ``state`` metadata (names the path).
    """
    step_dir = committed_step_dir(path, step)
    where = step_dir / STATE_ITEM
    try:
        with _read_manager(step_dir.parent) as manager:
            tree = manager.item_metadata(int(step_dir.name))[STATE_ITEM]
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint array metadata {where}: {type(e).__name__}: {e}") from e
    if tree is None:
        raise CheckpointError(f"checkpoint has no {STATE_ITEM!r} item: {where}")
    return {
        p: (tuple(int(d) for d in m.shape), str(m.dtype)) for p, m in flat_arrays(getattr(tree, "tree", tree)).items()
    }


def array_restore_args(item: Mapping[str, Any]) -> Any:
    """Restore arguments for a tree of ``jax.ShapeDtypeStruct`` s with shardings: each array is read at
    its target sharding (each device reads only its slice) with ``global_shape`` its shape and
    ``strict=False``, so an array saved at another world size is zero-padded or truncated to it."""
    import jax

    ocp = _ocp()
    return jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype, strict=False),
        dict(item),
    )


def restore_arrays(step_dir: str | os.PathLike, item: Mapping[str, Any], restore_args: Mapping[str, Any]) -> dict:
    """Restore a subset of a committed step's ``state`` item.

    Args:
        step_dir: the step's directory (:func:`committed_step_dir`).
        item: the subtree to restore (``{"params": {chunk_key: jax.ShapeDtypeStruct}}``); arrays not in
            it are not read.
        restore_args: the same structure of ``ArrayRestoreArgs`` (:func:`array_restore_args`), or
            ``RestoreArgs(restore_type=np.ndarray)`` for numpy.

    Returns:
        The restored tree, shaped like ``item``.

    Raises:
        CheckpointError: Orbax cannot read an array (names the path).
    """
    ocp = _ocp()
    step_dir = Path(step_dir)
    args = ocp.args.PyTreeRestore(item=dict(item), restore_args=dict(restore_args), partial_restore=True)
    try:
        with _read_manager(step_dir.parent) as manager:
            restored = manager.restore(int(step_dir.name), args=ocp.args.Composite(**{STATE_ITEM: args}))
    except Exception as e:
        raise CheckpointError(
            f"cannot restore checkpoint arrays from {step_dir / STATE_ITEM}: {type(e).__name__}: {e}"
        ) from e
    return restored[STATE_ITEM]
