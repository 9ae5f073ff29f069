"""What :func:`~torch_backend.load_checkpoint` restores: everything (``mode="resume"``), or the weights
only, to fine-tune (``"finetune"``) or to evaluate (``"inference"``).

The three modes of SwissArmyTransformer's ``load_checkpoint`` (``model_io.py``), under the names a
torch user reads at the call site:

============  ===================  ==========================================================================
SAT           chunkzero ``mode``   restores
============  ===================  ==========================================================================
``pretrain``  ``"resume"``         parameters, optimizer state and hyper-parameters, loss scaler, RNG states;
                                   the run continues at the saved step (``"pretrain"`` is accepted too)
``finetune``  ``"finetune"``       parameters only; the run starts at step 0 with a fresh optimizer. Tensors
                                   the checkpoint lacks keep the module's own init (SAT's mixins); both
                                   missing and unexpected tensors are reported
``inference`` ``"inference"``      parameters only, then ``model.eval()``; a tensor the checkpoint lacks is a
                                   :class:`~chunkzero.errors.CheckpointError` unless ``force=True``
                                   (SAT's ``force_inference``)
============  ===================  ==========================================================================
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from chunkzero.checkpoint import CheckpointMeta
from chunkzero.errors import CheckpointError, ConfigError

from .numpy_bridge import to_numpy, torch_dtype

logger = logging.getLogger("chunkzero.checkpoint")

MODES = ("resume", "finetune", "inference")
"""chunkzero's load modes; SAT's ``"pretrain"`` is :data:`MODES` ``[0]``."""
SAT_MODES = {"pretrain": "resume", "finetune": "finetune", "inference": "inference"}
"""SwissArmyTransformer's mode name → chunkzero's."""

__all__ = ["MODES", "SAT_MODES", "WeightsLoad", "check_missing", "finish", "keep_own_init", "report", "resolve_mode"]


@dataclass
class WeightsLoad:
    """What a weights-only load (``mode="finetune"`` or ``"inference"``) did.

    Attributes:
        meta: the checkpoint's metadata (``meta.step`` is the step it was saved at, ``meta.model_config`` …).
        mode: ``"finetune"`` or ``"inference"``.
        missing_keys: tensors of the model (primary names, layout order) the checkpoint lacks: they kept
            the values the model had before the load (its own init).
        unexpected_keys: tensors of the checkpoint the model lacks (not read).
        step: the step training starts at: always 0 (a fine-tune restarts the count).
    """

    meta: CheckpointMeta
    mode: str
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    step: int = 0


def resolve_mode(mode: str, optimizer) -> str:
    """``mode`` as one of :data:`MODES` (SAT's ``"pretrain"`` → ``"resume"``).

    Raises:
        ConfigError: an unknown mode, or an optimizer passed to a weights-only mode (which would leave it
            as it is: build the fresh optimizer after the load instead).
    """
    if not isinstance(mode, str) or mode not in (*MODES, *SAT_MODES):
        raise ConfigError(f"load mode must be one of {', '.join(map(repr, MODES))} (or SAT's 'pretrain'), got {mode!r}")
    mode = SAT_MODES.get(mode, mode)
    if mode != "resume" and optimizer is not None:
        raise ConfigError(f"mode={mode!r} loads the weights only and starts a fresh optimizer: pass optimizer=None "
                          "and build the optimizer after the load (mode='resume' restores its state)")
    return mode


def check_missing(mode: str, missing: list[str], force: bool, source: str) -> None:
    """Refuse an inference load of a checkpoint that lacks some of the model's tensors.

    Raises:
        CheckpointError: ``mode == "inference"``, ``missing`` is not empty and not ``force`` (lists them all).
    """
    if mode == "inference" and missing and not force:
        raise CheckpointError(
            f"checkpoint {source!r} lacks {len(missing)} tensor(s) of the model: {', '.join(map(repr, missing))}; "
            "for inference every tensor must be loaded (force=True keeps their current values, mode='finetune' "
            "keeps their init for training)")


def keep_own_init(model, params: dict[int, np.ndarray], missing: list[str]) -> None:
    """Copy the live values of the ``missing`` tensors into this rank's loaded shards ``params``
    (chunk index → numpy shard, as :func:`~chunkzero.checkpoint.reader.read_shards` returns them), so the
    load leaves those tensors as the module initialized them."""
    if not missing:
        return
    gone = set(missing)
    layout, rank = model.layout, int(getattr(model, "shard_rank", model.rank))  # the layout's rank
    for c in layout.chunks:
        pieces = [(a, b, off) for t, a, b, off in layout.shard_pieces(c.index, rank) if t.name in gone]
        if not pieces:
            continue
        live = model.master_shard(c.index).detach()
        live = to_numpy(live if c.requires_grad else live.to(torch_dtype(c.dtype)))
        shard = params[c.index]
        if not shard.flags.writeable:
            shard = params[c.index] = shard.copy()
        for a, b, off in pieces:
            shard[off : off + b - a] = live[off : off + b - a]


def report(result: WeightsLoad, rank: int, source: str) -> None:
    """Log the missing and unexpected tensors of a weights-only load (rank 0)."""
    if rank != 0:
        return
    if result.missing_keys:
        logger.warning("%s load of %s: %d tensor(s) of the model are not in the checkpoint and keep their current "
                       "values: %s", result.mode, source, len(result.missing_keys), ", ".join(result.missing_keys))
    if result.unexpected_keys:
        logger.warning("%s load of %s: %d tensor(s) of the checkpoint are not in the model and were not read: %s",
                       result.mode, source, len(result.unexpected_keys), ", ".join(result.unexpected_keys))


def finish(model, mode: str) -> None:
    """What a mode does to the model after its weights are in: ``eval()`` for inference."""
    if mode == "inference":
        model.eval()
