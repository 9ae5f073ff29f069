"""A run's output directory (``chunkzero train --out``): what it holds, when it may be used, how
``--overwrite`` clears it.

Rank 0 writes every output here (``torch_backend.train.report`` lists them); checkpoints go to
``<out>/checkpoints/<step>``. A directory that holds another run (any of :data:`RUN_MARKERS`) is
refused unless ``--overwrite``, which removes exactly :data:`RUN_OUTPUTS` and nothing else; ``--resume``
instead requires a committed checkpoint there.

Imports the standard library only.
"""

from __future__ import annotations

import datetime as _dt
import shutil
from pathlib import Path

from .checkpoint import latest_step
from .errors import ConfigError
from .train_config import TrainConfig

CHECKPOINT_DIR = "checkpoints"
"""The checkpoint root of a run, under ``--out``."""

CHECKPOINTS_KEPT = 3
"""How many of a run's newest checkpoints are kept (``--save-interval``)."""

RUN_MARKERS = ("metrics.jsonl", "config.json", "summary.json", CHECKPOINT_DIR)
"""Entries whose presence in ``--out`` means it holds another run (refused unless ``--overwrite``)."""

RUN_OUTPUTS = RUN_MARKERS + ("summary.txt", "loss.png", "sample.txt", "train.log", "pids")
"""Everything a run writes in ``--out``; ``--overwrite`` removes exactly these first."""


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
        ConfigError: ``out`` is a file, holds another run, or (``--resume``) holds no checkpoint.
    """
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
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


def prepare_out_dir(cfg: TrainConfig) -> Path:
    """Create ``--out``; with ``--overwrite`` remove the earlier run's outputs (only :data:`RUN_OUTPUTS`)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.overwrite:
        for name in RUN_OUTPUTS:
            p = out / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
    return out
