"""The job's guards that do not depend on the engine: the stop after too many non-finite steps
(``--max-skipped-steps``), its one-line message, and what a resume says of a checkpoint's EMA (dropped without
``--ema-decay``; other EMA settings than the checkpoint's).

The torch engine's ZeroOptimizer counts its own skips (at the minimum loss scale, so fp16's loss-scale
back-off is not counted) and raises the same :class:`chunkzero.errors.LossScaleError`; the JAX engine,
which runs at scale 1, counts them here. Both workers end the run with :func:`stop_message`.
"""

from __future__ import annotations

import logging

from chunkzero.errors import LossScaleError
from chunkzero.train_config import TrainConfig

log = logging.getLogger("chunkzero.train")


class NonFiniteStop:
    """Counts optimizer steps skipped in a row for non-finite gradients and stops the run at the
    ``max_skipped``-th (0 or ``None``: never). ``skipped_steps`` counts every skip of this session."""

    def __init__(self, max_skipped: int | None, *, scale: float = 1.0):
        self.max_skipped, self.scale = max_skipped or None, scale
        self.in_row = 0
        self.skipped_steps = 0

    def record(self, step: int, applied: bool) -> None:
        """After optimizer step ``step`` (1-based): whether its update was ``applied``.

        Raises:
            LossScaleError: this skip is the ``max_skipped``-th in a row.
        """
        if applied:
            self.in_row = 0
            return
        self.in_row += 1
        self.skipped_steps += 1
        if self.max_skipped is None or self.in_row < self.max_skipped:
            return
        raise LossScaleError(
            f"step {step}: {self.in_row} steps in a row were skipped for non-finite gradients (inf/nan) at the minimum "
            f"loss scale {self.scale:g}, so training cannot make progress; lower the learning rate or look for inf/nan "
            "in the data and the model", step=step, scale=self.scale, skipped=self.in_row)


def stop_message(error: LossScaleError, cfg: TrainConfig) -> str:
    """The one line a run stopped by :class:`NonFiniteStop` (or ZeroOptimizer's count) ends with."""
    return f"{error}; the run stops here (--max-skipped-steps {cfg.max_skipped_steps}; 0 never stops)"


def warn_dropped_ema(meta, step_dir) -> None:
    """Warn (call on one process) that resuming checkpoint ``step_dir`` (``meta``: its metadata) without
    ``--ema-decay`` drops the EMA the checkpoint holds; nothing when it holds none."""
    ema = getattr(meta, "ema", None)
    if ema is None:
        return
    log.warning("checkpoint %s holds an EMA of the weights (decay %g, %d updates) and this run keeps none: the EMA "
                "is dropped, and later checkpoints of this run hold none (to keep it, pass --ema-decay)", step_dir,
                ema.decay, ema.update_count)


def ema_resume_line(saved, cfg: TrainConfig, step: int) -> str:
    """The line a resume with ``--ema-decay`` logs about the checkpoint's EMA record ``saved``
    (:class:`chunkzero.checkpoint.EmaMeta`; ``step``: the resumed step): that the EMA carries on, or, when
    ``--ema-decay`` / ``--ema-warmup`` differ from the record, that this run's settings are used from the next
    step on, the EMA's weights and update count kept."""
    was = {"--ema-decay": saved.decay, "--ema-warmup": saved.warmup}
    wanted = {"--ema-decay": float(cfg.ema_decay), "--ema-warmup": bool(cfg.ema_warmup)}
    changed = [f"{k} {wanted[k]:g} (the checkpoint's: {was[k]:g})" if k == "--ema-decay"
               else f"{k} {'on' if wanted[k] else 'off'} (the checkpoint's: {'on' if was[k] else 'off'})"
               for k in was if was[k] != wanted[k]]
    if not changed:
        return (f"--resume: the checkpoint's EMA of the weights carries on (decay {saved.decay:g}, "
                f"{saved.update_count} updates)")
    return (f"--resume: {', '.join(changed)}: this run's setting is used from step {step + 1} on (the EMA's weights "
            f"and its {saved.update_count} updates are kept)")
