"""A run's checks that need no framework: ``--out`` and, with ``--resume``, the checkpoint's step,
data-stream settings and tensors against ``--model`` (from the checkpoint's metadata and the model's tensor specs: no
array is read). Both engines' launchers call :func:`check_run_out`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from chunkzero.checkpoint import CheckpointMeta
from chunkzero.checkpoint.plan import check_compatible
from chunkzero.errors import CheckpointError, ConfigError, ShapeMismatchError
from chunkzero.layout import ChunkLayout, TensorSpec
from chunkzero.resume_check import check_resume_changes, validation_sequences
from chunkzero.run_dir import CHECKPOINT_DIR, check_out_dir, check_resume, fresh_run_dir, previous_settings
from chunkzero.train_config import TrainConfig, resumed_schedule_steps, warn_schedule_change

from .models import model_tensor_specs

TensorSpecs = Callable[[TrainConfig], list[TensorSpec]]
"""The model's tensors from its config (:func:`chunkzero.job.models.model_tensor_specs`, or an engine's own)."""


def check_resume_model(cfg: TrainConfig, meta: CheckpointMeta, tensor_specs: TensorSpecs = model_tensor_specs) -> None:
    """Refuse a ``--resume`` whose ``--model`` does not hold exactly the checkpoint's tensors (by name or
    alias) with the same shapes, before any worker starts.

    Raises:
        ConfigError: naming the checkpoint, its model (when it recorded one) and the tensor at fault.
    """
    specs = tensor_specs(cfg)
    target = ChunkLayout.build(specs, max(s.numel for s in specs), 1)
    root = Path(cfg.out) / CHECKPOINT_DIR
    try:
        check_compatible(meta.layout, target, source=f"checkpoint {meta.step}")
    except (ShapeMismatchError, CheckpointError) as e:
        saved = (meta.extra or {}).get("model")
        trained = f", trained with --model {saved}" if isinstance(saved, str) and saved != cfg.model else ""
        raise ConfigError(f"--resume: --model {cfg.model} does not fit the checkpoint in {root} (step {meta.step}"
                          f"{trained}): {e}") from None


def warn_oversized_validation(cfg: TrainConfig, data_summary: dict | None) -> None:
    """Warn (logger ``chunkzero.train``) when a new run's validation set (``cfg.val_sequences`` windows of
    ``--seq-len`` tokens, drawn at random from the held-out split) asks for more windows than the split has
    distinct ones: every evaluation then reads the same text over and over, and a large ``--eval-batches``
    makes it look as if the run hung. Nothing without ``data_summary`` (its ``val_tokens``)."""
    val_tokens = (data_summary or {}).get("val_tokens")
    if not isinstance(val_tokens, int) or not cfg.val_sequences:
        return
    windows = max(1, val_tokens - cfg.seq_len)
    if cfg.val_sequences <= windows:
        return
    per_batch = cfg.batch_size * cfg.world_size
    logging.getLogger("chunkzero.train").warning(
        "warning: --eval-batches %d asks for %s validation sequences of %d tokens at each evaluation (%d × "
        "--batch-size %d × %d workers), %.0f× the %s distinct ones of the held-out split (%s tokens): every "
        "evaluation reads the same text over and over; --eval-batches %d reads each about once",
        cfg.eval_batches, f"{cfg.val_sequences:,}", cfg.seq_len, cfg.eval_batches, cfg.batch_size, cfg.world_size,
        cfg.val_sequences / windows, f"{windows:,}", f"{val_tokens:,}", max(1, windows // per_batch))


def check_run_out(cfg: TrainConfig, tensor_specs: TensorSpecs = model_tensor_specs, *,
                  data_summary: dict | None = None) -> CheckpointMeta | None:
    """Resolve and check ``--out`` in place, for either backend's launcher: ``runs/<timestamp>`` when
    unset, usable (:func:`chunkzero.run_dir.check_out_dir`), and ``cfg.schedule_steps`` set to
    ``--steps`` or, with ``--resume``, to the kept schedule of a checkpoint whose step is below
    ``--steps`` and whose tensors are the model's (:func:`check_resume_model`, with ``tensor_specs``),
    whose data stream this run's settings and corpus (``data_summary``) keep, or ``--allow-change``
    (``cfg.resume_changes``: :func:`chunkzero.resume_check.check_resume_changes`); what the resume does to
    the LR schedule is said here, once (:func:`chunkzero.train_config.warn_schedule_change`).

    Returns:
        The checkpoint's metadata with ``--resume``, else ``None``.

    Raises:
        ConfigError: naming ``--out``, the checkpoint or the tensor at fault.
    """
    if cfg.out is None:
        cfg.out = str(fresh_run_dir(Path("runs")))
    check_out_dir(cfg)
    cfg.schedule_steps = cfg.steps
    cfg.val_sequences = validation_sequences(cfg)
    if not cfg.resume:
        warn_oversized_validation(cfg, data_summary)
        return None
    meta = check_resume(cfg)
    check_resume_model(cfg, meta, tensor_specs)
    previous, source = previous_settings(cfg, meta)
    cfg.schedule_steps = resumed_schedule_steps(cfg, previous)
    cfg.val_sequences = validation_sequences(cfg, previous)
    cfg.resume_changes = check_resume_changes(cfg, previous, source, data_summary) or None
    warn_schedule_change(previous, source, cfg, meta.step)
    return meta
