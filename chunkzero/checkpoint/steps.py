"""Committed steps on disk and their metadata (DESIGN.md §5), read with plain file-system calls.

No Orbax and no cross-process sync, so any single process may call these. Orbax writes a step under
a temporary name and renames it to ``<step>`` when the save commits, so only all-digit directory names
holding both items are committed steps.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import CheckpointError, CheckpointFormatError, ConfigError
from .meta import META_FILENAME, META_ITEM, STATE_ITEM, CheckpointMeta



def is_step_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one committed step directory (``<root>/<int>/`` with both items)."""
    p = Path(path)
    return p.name.isdigit() and (p / META_ITEM).is_dir() and (p / STATE_ITEM).is_dir()


def list_steps(root: str | os.PathLike) -> list[int]:
    """Committed steps under ``root``, ascending (``[]`` if ``root`` does not exist); a save that died
    midway is not listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if is_step_dir(p))


_UNCOMMITTED = re.compile(r"\d+\.orbax-checkpoint-tmp.*")
"""The name Orbax writes a step under until its commit renames it (``<step>.orbax-checkpoint-tmp[-<n>]``)."""


def remove_uncommitted(root: str | os.PathLike) -> list[str]:
    """Remove the temporaries of saves that died before their commit (``kill -9`` mid-save) directly under
    checkpoint root ``root``; returns their names. Only Orbax's step temporaries, never a committed step.
    Call it only where no save to ``root`` can be running: a run's process 0 at its start."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.iterdir() if _UNCOMMITTED.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]


def latest_step(root: str | os.PathLike) -> int | None:
    """The highest committed step under ``root``, or ``None`` if there is none."""
    steps = list_steps(root)
    return steps[-1] if steps else None


def resolve_step_dir(path: str | os.PathLike, step: int | None = None) -> Path:
    """The directory of one committed step.

    Args:
        path: a checkpoint root (``runs/ckpt``) or one step's directory (``runs/ckpt/100``).
        step: the step under a root; ``None`` means the latest (or ``path`` itself if it is a step).

    Raises:
        CheckpointError: the path does not exist, holds no committed step, or not ``step`` (the
            message lists the steps it does hold).
        ConfigError: ``step`` is not an int, or contradicts the step directory given.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ConfigError(f"step must be an int, got {step!r}")
    if is_step_dir(path):
        if step is not None and step != int(path.name):
            raise ConfigError(f"step={step} but {str(path)!r} is the directory of step {path.name}")
        return path
    steps = list_steps(path)
    if not steps:
        raise CheckpointError(
            f"no committed checkpoint step under {str(path)!r} (expected <root>/<step>/ with {STATE_ITEM!r} and {META_ITEM!r})"
        )
    if step is None:
        step = steps[-1]
    if step not in steps:
        held = ", ".join(map(str, steps))
        raise CheckpointError(f"no committed step {step} under {str(path)!r} (steps held: {held})")
    return path / str(step)


def read_meta(path: str | os.PathLike, step: int | None = None) -> CheckpointMeta:
    """Read and validate a step's ``meta`` item without touching its arrays (never unpickles).

    Args:
        path, step: as :func:`resolve_step_dir`.

    Raises:
        CheckpointError: no such step, or the meta file is missing.
        CheckpointFormatError: the file is not valid JSON or does not match the schema, or its step
            differs from the directory's (names the file and the field).
    """
    step_dir = resolve_step_dir(path, step)
    meta_file = step_dir / META_ITEM / META_FILENAME
    try:
        text = meta_file.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint metadata {str(meta_file)!r} is missing") from None
    meta = CheckpointMeta.from_json(text, source=str(meta_file))
    if int(step_dir.name) != meta.step:
        raise CheckpointFormatError(f"{meta_file}: field 'step': {meta.step} differs from the directory's step {step_dir.name}")
    return meta
