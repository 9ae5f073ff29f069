"""A run's output directory (``chunkzero train --out``): what it holds, when it may be used, how
``--overwrite`` clears it.

Rank 0 writes every output here (``chunkzero.job.report`` lists them); checkpoints go to
``<out>/checkpoints/<step>``. A directory that holds another run (any of :data:`RUN_MARKERS`) is
refused unless ``--overwrite``, which removes exactly :data:`RUN_OUTPUTS` and nothing else; ``--resume``
instead requires a committed checkpoint there, at a step below ``--steps`` (:func:`check_resume`). An
empty ``--out``, or one under a file or in a directory that cannot be written, is refused.

Imports the standard library only.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .checkpoint import CheckpointMeta, latest_step, list_steps, read_meta
from .checkpoint.steps import remove_uncommitted
from .errors import CheckpointError, ChunkZeroError, ConfigError
from .train_config import TrainConfig

log = logging.getLogger("chunkzero.train")

CHECKPOINT_DIR = "checkpoints"
"""The checkpoint root of a run, under ``--out``."""

RUN_MARKERS = ("metrics.jsonl", "config.json", "summary.json", CHECKPOINT_DIR)
"""Entries whose presence in ``--out`` means it holds another run (refused unless ``--overwrite``)."""

RUN_OUTPUTS = RUN_MARKERS + ("summary.txt", "loss.png", "sample.txt", "train.log", "pids")
"""Everything a run writes in ``--out``; ``--overwrite`` removes exactly these first."""


def checkpoint_root(path: str | os.PathLike) -> Path:
    """``path`` as a checkpoint root: a ``chunkzero train`` run folder (no step of its own, a
    ``checkpoints/`` inside) gives its ``checkpoints/``; anything else is returned as it is."""
    path = Path(path)
    inner = path / CHECKPOINT_DIR
    return inner if not list_steps(path) and inner.is_dir() else path


def stopped_run_checkpoints(out: str | os.PathLike) -> str:
    """What a run at ``out`` stopped by a signal has saved, for :func:`chunkzero.workers.stopped_message`:
    its latest committed step, where it is and how to continue from it, or that there is none yet."""
    root = Path(out) / CHECKPOINT_DIR
    steps = list_steps(root)
    if not steps:
        return "no checkpoint was saved yet"
    return f"the latest checkpoint, step {steps[-1]}, is in {root}; the same command with --resume continues from it"


def fresh_run_dir(root: Path) -> Path:
    """``root/<YYYYmmdd-HHMMSS>`` (with ``-2``, ``-3`` … appended while that exists); not created."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = root / stamp, 2
    while out.exists():
        out, n = root / f"{stamp}-{n}", n + 1
    return out


def check_out_dir(cfg: TrainConfig) -> None:
    """``--out`` must be a directory (or absent) not holding another run, unless ``--overwrite``; with
    ``--resume`` it must hold a committed checkpoint instead.

    Raises:
        ConfigError: ``out`` is empty, a file, under a file, in a directory this process cannot write or make
            a directory in, is or is inside a ``--model`` or ``--data`` directory, holds another run, or
            (``--resume``) holds no checkpoint.
    """
    if not str(cfg.out).strip():
        raise ConfigError("--out is empty: name a directory, or leave --out out for a fresh runs/<YYYYmmdd-HHMMSS>")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out} cannot be created: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out} cannot be written: no write permission on {existing}")
    if not out.exists():  # what the permission bits do not say (root, /proc, a read-only mount): try it
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".chunkzero-out-check-", dir=existing))
        except OSError as e:
            raise ConfigError(f"--out {out} cannot be created in {existing}: {e.strerror or e}") from None
    check_out_apart_from_model(out, cfg.model)
    check_out_apart_from_data(out, cfg.data)
    if cfg.resume:
        if latest_step(out / CHECKPOINT_DIR) is None:
            raise ConfigError(f"--resume: --out {out} holds no checkpoint ({CHECKPOINT_DIR}/<step>); "
                              "train with --save-interval to write some")
        return
    if out.is_dir() and not cfg.overwrite:
        held = [m for m in RUN_MARKERS if (out / m).exists()]
        if held:
            raise ConfigError(f"--out {out} holds another run ({held[0]}); choose another --out, pass --resume "
                              "to continue it, or --overwrite to replace it")


def check_out_apart_from_model(out: Path, model: str | None) -> None:
    """``--out`` must not be a ``--model`` directory, nor inside one, nor hold one: a run writes its
    ``config.json`` and checkpoints there, and ``--overwrite`` removes :data:`RUN_OUTPUTS`, which would
    replace or delete the model's own files.

    Raises:
        ConfigError: naming both paths.
    """
    if not model or not Path(model).is_dir():
        return
    where = _placed(out, model)
    if where is not None:
        raise ConfigError(f"--out {out} {where} the --model directory {model}: the run would write its config.json "
                          "and outputs among the model's files; choose an --out apart from the model")


def check_out_apart_from_data(out: Path, data: list[str] | None) -> None:
    """``--out`` must not be a ``--data`` directory nor inside one: the run's logs, config and checkpoint
    metadata would be read as training text by the next start (a resume would find the corpus changed).

    Raises:
        ConfigError: naming both paths.
    """
    for d in data or ():
        where = _placed(out, d) if Path(d).is_dir() else None
        if where in ("is", "is inside"):
            raise ConfigError(f"--out {out} {where} the --data directory {d}: the run's outputs would become "
                              "training text; choose an --out apart from the data")


def _placed(out: Path, directory: str) -> str | None:
    """Where ``out`` is against ``directory``, both resolved: ``"is"``, ``"is inside"``, ``"contains"`` or ``None``."""
    o, d = out.resolve(), Path(directory).resolve()
    return "is" if o == d else "is inside" if d in o.parents else "contains" if o in d.parents else None


def set_aside_later_steps(root: Path, step: int) -> Path | None:
    """Move the checkpoint steps after ``step`` under ``root`` into ``root/after-<step>/`` (``-2``, ``-3`` …
    appended while that exists), where no reader looks for a step: ``--resume-step`` continues the run from
    ``step``, so the later steps belong to the run it abandons; a later ``--resume`` must not take them for
    the latest, and this run's saves must not collide with them. Kept, not deleted. Returns the folder, or
    ``None`` when there was no later step."""
    later = [s for s in list_steps(root) if s > step]
    if not later:
        return None
    aside, n = root / f"after-{step}", 2
    while aside.exists():
        aside, n = root / f"after-{step}-{n}", n + 1
    aside.mkdir()
    for s in later:
        os.replace(root / str(s), aside / str(s))
    return aside


def prepare_out_dir(cfg: TrainConfig) -> Path:
    """Create ``--out``; with ``--overwrite`` remove the earlier run's outputs (only :data:`RUN_OUTPUTS`);
    with ``--resume-step`` set the later checkpoint steps aside (:func:`set_aside_later_steps`), with a copy of
    ``metrics.jsonl`` as it was (the resumed run keeps only its records up to the step); remove the
    temporaries of checkpoint saves that died before their commit (:func:`remove_uncommitted`: no save of
    this run has started yet)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.resume and cfg.resume_step is not None:
        aside = set_aside_later_steps(out / CHECKPOINT_DIR, cfg.resume_step)
        if aside is not None:
            # this run rewrites metrics.jsonl up to its step: the abandoned steps' records are kept with them
            if (out / "metrics.jsonl").is_file():
                shutil.copy2(out / "metrics.jsonl", aside / "metrics.jsonl")
            log.info(
                "--resume-step %d: the later checkpoint steps (%s) are kept in %s with the run's metrics.jsonl as "
                "it was, where --resume does not look", cfg.resume_step,
                ", ".join(sorted((p.name for p in aside.iterdir() if p.name.isdigit()), key=int)), aside)
    if cfg.overwrite:
        for name in RUN_OUTPUTS:
            p = out / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
    removed = remove_uncommitted(out / CHECKPOINT_DIR)
    if removed:
        log.info("removed %d checkpoint save(s) that never committed: %s", len(removed), ", ".join(removed))
    return out


def write_run_config(cfg: TrainConfig, corpus, world_size: int) -> None:
    """Prepare ``--out`` (:func:`prepare_out_dir`) and write ``--out/config.json``: ``cfg`` with
    ``world_size`` and ``data_summary`` (``corpus.summary()``). Rank / process 0 of either backend runs it,
    the first write of a run into ``--out``: only once every check passed on every rank, the checkpoint
    of a ``--resume`` included (loaded and agreed), so a refused run leaves ``--out`` as it was."""
    out = prepare_out_dir(cfg)
    (out / "config.json").write_text(json.dumps(
        {**cfg.to_dict(), "world_size": world_size, "data_summary": corpus.summary()}, indent=2) + "\n")


def check_resume(cfg: TrainConfig) -> CheckpointMeta:
    """``--resume``'s checks that need only the latest checkpoint's metadata (no array is read): it is
    readable and its step is below ``--steps``, the run's total. Run before any worker starts, with
    :func:`check_out_dir`; the model's shapes are compared by the backend (``torch_backend.train.resolve``).

    Returns:
        The checkpoint's metadata.

    Raises:
        ConfigError: the checkpoint's step is ``--steps`` or beyond (nothing to train), or its metadata
            cannot be read (the message names the checkpoint and the older step to resume from instead).
    """
    root = Path(cfg.out) / CHECKPOINT_DIR
    if cfg.resume_step is not None and cfg.resume_step not in list_steps(root):
        raise ConfigError(f"--resume-step {cfg.resume_step}: {root} holds no checkpoint of that step (steps present: "
                          f"{', '.join(map(str, list_steps(root)))})")
    try:
        meta = read_meta(root, cfg.resume_step)
    except ChunkZeroError as e:  # named with the older step to resume from instead, as a step whose arrays fail
        step = cfg.resume_step if cfg.resume_step is not None else latest_step(root)
        raise ConfigError(str(resume_failed(root, step, e))) from None
    if meta.step >= cfg.steps:
        raise ConfigError(f"--resume: the checkpoint in {root} is at step {meta.step}, and --steps {cfg.steps} is the "
                          f"run's total, so there is nothing to train; pass --steps above {meta.step} to train on")
    return meta


def previous_settings(cfg: TrainConfig, meta: CheckpointMeta) -> tuple[dict | None, str]:
    """The checkpointed run's settings and where they were read: the checkpoint's ``extra`` when it records
    the schedule (over ``--out/config.json``'s, for what older checkpoints' ``extra`` lacks), else
    ``--out/config.json``; with the precision and world size of the checkpoint's metadata. ``(None, ...)``
    when neither has them."""
    extra = dict(meta.extra or {})
    source = Path(cfg.out) / "config.json"
    try:
        doc = json.loads(source.read_text())
    except (OSError, ValueError):
        doc = None
    doc = doc if isinstance(doc, dict) else {}
    if "steps" not in extra and not doc:
        return None, str(source)
    facts = {"mixed_precision": meta.mixed_precision, "world_size": meta.world_size * meta.replicas}
    if "steps" in extra:
        return {**doc, **facts, **extra}, f"checkpoint {meta.step}"
    return {**doc, **facts}, str(source)


def resume_failed(root: Path, step: int, error: Exception) -> CheckpointError:
    """The error of a resume whose checkpoint ``root/step`` cannot be loaded (``error``: e.g. a checksum that
    names the corrupted array), with how to resume from the newest older step instead."""
    older = [s for s in list_steps(root) if s < step]
    how = (f"to resume from step {older[-1]} instead, pass --resume-step {older[-1]} or move {Path(root) / str(step)} "
           "aside" if older else "no older checkpoint is saved to resume from")
    return CheckpointError(f"--resume: step {step} cannot be loaded: {error}; {how}")
