"""What ``chunkzero train --resume`` compares with the checkpointed run.

A checkpoint records the settings that shape the run's data stream and numbers (:func:`run_settings`,
in its ``extra``); a resume with other values (:func:`resume_changes`) is refused in one line naming each
setting and both values, unless ``--allow-change``, which accepts them and names them
(:func:`check_resume_changes`). World size and ``--batch-size`` count together: micro-batch *i* is the
same global batch whenever world size × ``--batch-size`` is (``chunkzero.job.data.BatchSampler``),
so a resume on other workers that keeps that product changes nothing; otherwise each changed factor is
named, with the tokens per step before and after.

Imports the standard library only.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import ConfigError
from .train_config import TrainConfig

log = logging.getLogger("chunkzero.train")

STREAM_KEYS = ("seed", "seq_len", "grad_accum", "mixed_precision", "val_fraction")
"""The settings compared one by one at ``--resume`` (besides the data, and world size × batch size)."""

DATA_IDENTITY_KEYS = ("files", "train_tokens", "val_tokens", "tokenizer", "vocab_size")
"""The fields of a corpus summary (``Corpus.summary()``) that tell one corpus from another."""


def data_identity(summary: dict | None) -> dict | None:
    """The part of a corpus summary that :func:`resume_changes` compares, with its ``source`` (to name it)."""
    if not isinstance(summary, dict):
        return None
    return {k: summary.get(k) for k in ("source", *DATA_IDENTITY_KEYS)}


def run_settings(cfg: TrainConfig, world_size: int, data_summary: dict | None) -> dict[str, Any]:
    """What a checkpoint of this run records in its ``extra`` about the run (JSON): the model, the LR
    schedule's settings (``steps``, ``schedule_steps``, ``warmup``, ``lr``, ``min_lr_ratio``), the data
    stream's (:data:`STREAM_KEYS`, ``batch_size``, ``world_size``), the data's identity
    (:func:`data_identity`) and the validation set's size (``val_sequences``: :func:`validation_sequences`)."""
    keys = ("model", "steps", "schedule_steps", "warmup", "lr", "min_lr_ratio", "batch_size", "val_sequences",
            *STREAM_KEYS)
    return {**{k: getattr(cfg, k) for k in keys}, "world_size": world_size, "data": data_identity(data_summary)}


def validation_sequences(cfg: TrainConfig, previous: dict | None = None) -> int:
    """The run's validation set, in sequences: ``--eval-batches × --batch-size ×`` world size at its first
    session, and kept by every resume (the checkpointed run's ``val_sequences``, or for older checkpoints
    that product of its settings), so the validation loss is of the same sequences at any world size."""
    p = previous or {}
    if isinstance(p.get("val_sequences"), int) and p["val_sequences"] > 0:
        return p["val_sequences"]
    try:
        return int(p["eval_batches"]) * int(p["batch_size"]) * int(p["world_size"])
    except (KeyError, TypeError, ValueError):
        return cfg.eval_batches * cfg.batch_size * cfg.world_size


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _tokens_per_step(s: dict) -> int | None:
    try:
        return int(s["world_size"]) * int(s["grad_accum"]) * int(s["batch_size"]) * int(s["seq_len"])
    except (KeyError, TypeError, ValueError):
        return None


def resume_changes(cfg: TrainConfig, previous: dict, data_summary: dict | None = None) -> list[str]:
    """Each setting of this run (``cfg``, resolved: ``world_size`` and ``mixed_precision`` set) that
    changes the data stream or the numbers against the checkpointed run's ``previous`` settings (a
    checkpoint's ``extra``, or the run's ``config.json``), as ``"--seq-len 16 (was 32)"``; a setting
    ``previous`` does not record is not compared. The last entry names the tokens per step when they
    change. ``[]`` when nothing changes."""
    changes = [f"{_flag(k)} {getattr(cfg, k)} (was {previous[k]})" for k in STREAM_KEYS
               if k in previous and previous[k] is not None and previous[k] != getattr(cfg, k)]
    old_data = data_identity(previous.get("data") if isinstance(previous.get("data"), dict)
                             else previous.get("data_summary"))
    new_data = data_identity(data_summary)
    if old_data and new_data and any(old_data[k] != new_data[k] for k in DATA_IDENTITY_KEYS):
        changes.append(f"--data {new_data['source']}: {new_data['train_tokens']} train tokens in {new_data['files']} "
                       f"file(s) (was {old_data['source']}: {old_data['train_tokens']} in {old_data['files']})")
    world, batch = previous.get("world_size"), previous.get("batch_size")
    if isinstance(world, int) and isinstance(batch, int) and world * batch != cfg.world_size * cfg.batch_size:
        if batch != cfg.batch_size:
            changes.append(f"--batch-size {cfg.batch_size} (was {batch})")
        if world != cfg.world_size:
            changes.append(f"world size {cfg.world_size} (was {world})")
    now = _tokens_per_step({**cfg.to_dict(), "world_size": cfg.world_size})
    was = _tokens_per_step(previous)
    if changes and was is not None and now != was:
        changes.append(f"{now} tokens per step (was {was})")
    return changes


def check_resume_changes(cfg: TrainConfig, previous: dict | None, source: str,
                         data_summary: dict | None = None) -> list[str]:
    """Refuse a ``--resume`` whose settings change the run's data stream or numbers (:func:`resume_changes`)
    unless ``--allow-change``; with it, warn once naming each change. Returns the changes (``[]`` when
    none, or when ``previous`` is unknown).

    Raises:
        ConfigError: one line naming each changed setting with both values, and ``source``.
    """
    changes = resume_changes(cfg, previous, data_summary) if previous else []
    if changes and not cfg.allow_change:
        raise ConfigError(f"--resume: {', '.join(changes)}: differs from the checkpointed run ({source}), which "
                          "changes its data stream or numbers; pass the checkpointed run's values, or --allow-change "
                          "to continue with these")
    if changes:
        log.warning("warning: --resume --allow-change: %s (against %s); the run continues with these",
                    ", ".join(changes), source)
    return changes


def sampler_position(meta, cfg: TrainConfig) -> dict:
    """The data position to resume the batch sampler from: the checkpoint's (``meta.data_position``'s
    ``"sampler"``), in the new ``--seed``'s stream when ``--allow-change`` accepted another seed (the
    sampler refuses a position of another seed)."""
    position = dict((meta.data_position or {}).get("sampler", {}))
    if cfg.allow_change and "seed" in position:
        position["seed"] = cfg.seed
    return position
