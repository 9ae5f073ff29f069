"""A :class:`~torch_backend.ZeroEMA`'s shards as numpy for the checkpoint format, and back.

The EMA is saved as the ``ema`` subtree of the ``state`` item — one fp32 array per trainable chunk,
sharded as the masters are (each rank writes its own shard, keep-gathered chunks once) — and the
metadata's ``ema`` record (:class:`~chunkzero.checkpoint.EmaMeta`: decay, warm-up, update count). It is
read back by tensor name like the masters, so it resumes at any world size and chunk size.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from chunkzero.checkpoint import CheckpointError, CheckpointMeta, EmaMeta
from chunkzero.checkpoint.reader import ChunkReader, read_ema_shards

from .numpy_bridge import to_numpy, to_torch

logger = logging.getLogger("chunkzero.checkpoint")


def _ema_of(optimizer):
    return None if optimizer is None else getattr(optimizer, "ema", None)


def ema_shards(model, optimizer) -> tuple[EmaMeta | None, dict[int, np.ndarray] | None]:
    """The metadata record and this rank's EMA shards (``chunk index -> fp32 array``, views of the
    live CPU shards) of ``optimizer.ema``; ``(None, None)`` without one."""
    ema = _ema_of(optimizer)
    if ema is None:
        return None, None
    shards = {i: to_numpy(buf.to(torch.float32), copy=False) for i, buf in ema.shards.items()}
    missing = [c.index for c in model.layout.chunks if c.requires_grad and c.index not in shards]
    if missing:  # (a bug: the EMA was built over another model)
        raise CheckpointError(f"the EMA has no shard of trainable chunk {missing[0]} (it was built over another model)")
    return EmaMeta(decay=ema.decay, update_count=int(ema.update_count), warmup=ema.warmup), shards


def read(step_dir: Path, meta: CheckpointMeta, model, optimizer, rank: int,
         reader: ChunkReader) -> dict[int, np.ndarray] | None:
    """This rank's EMA shards from the checkpoint when the optimizer keeps an EMA and the checkpoint
    holds one, else ``None`` (nothing read)."""
    if _ema_of(optimizer) is None or meta.ema is None:
        return None
    return read_ema_shards(step_dir, meta, model.layout, rank, reader=reader)


def load(optimizer, meta: CheckpointMeta, shards: dict[int, np.ndarray] | None, step_dir, *,
         load_hyperparameters: bool) -> None:
    """Hand the read shards and the saved update count (with ``load_hyperparameters`` also the decay
    and warm-up) to ``optimizer.ema``; an EMA the checkpoint lacks restarts at the loaded masters.

    Logged (logger ``chunkzero.checkpoint``, rank 0 only): a checkpoint's EMA that an optimizer without
    a ZeroEMA drops (a warning), and, with ``load_hyperparameters``, a saved decay or warm-up that
    replaces the EMA's own (an info line; ``load_hyperparameters=False`` keeps the EMA's)."""
    ema = _ema_of(optimizer)
    if ema is None:
        if optimizer is not None and meta.ema is not None and _is_rank0(optimizer):
            logger.warning("checkpoint %s holds an EMA of the weights (decay %g, %d updates) and the optimizer keeps "
                           "none: the EMA is dropped (to keep it, build a ZeroEMA before loading; chunkzero train: "
                           "pass --ema-decay)", step_dir, meta.ema.decay, meta.ema.update_count)
        return
    if shards is None:
        if _is_rank0(optimizer):
            logger.warning(
                "checkpoint %s holds no EMA: the optimizer's EMA restarts at the loaded weights (update count 0)",
                step_dir,
            )
        for i in ema.shards:
            ema.load_shard(i, ema.model.master_shard(i))
        ema.update_count = 0
        return
    for i, a in shards.items():
        ema.load_shard(i, to_torch(a))
    saved = meta.ema.to_dict()
    if not load_hyperparameters:
        saved = {"update_count": saved["update_count"]}
    elif (saved["decay"], bool(saved["warmup"])) != (ema.decay, ema.warmup) and _is_rank0(optimizer):
        logger.info("checkpoint %s: its EMA decay %g%s replaces the ZeroEMA's %g%s (pass load_hyperparameters=False "
                    "to keep the ZeroEMA's)", step_dir, saved["decay"], ", with warm-up" if saved["warmup"] else "",
                    ema.decay, ", with warm-up" if ema.warmup else "")
    ema.load_state(saved)


def _is_rank0(optimizer) -> bool:
    """Whether this is rank 0 of the optimizer's model (a single process is)."""
    return int(getattr(getattr(optimizer, "model", None), "rank", 0)) == 0
