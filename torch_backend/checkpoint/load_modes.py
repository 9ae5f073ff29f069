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
from dataclasses import dataclass

import numpy as np

from chunkzero.checkpoint import CheckpointMeta
from chunkzero.errors import CheckpointError, ConfigError

from .numpy_bridge import to_numpy, torch_dtype

logger = logging.getLogger("chunkzero.checkpoint")

MODES = ("resume", "finetune", "inference")
"""chunkzero's load modes; SAT's ``"pretrain"`` is :data:`MODES` ``[0]``."""
SAT_MODES = {"pretrain": "resume", "finetune": "finetune", "inference": "inference"}
"""SwissArmyTransformer's mode name → chunkzero's."""

__all__ = [
    "MODES",
    "SAT_MODES",
    "WeightsLoad",
    "check_complete",
    "check_matched",
    "check_missing",
    "finish",
    "keep_own_init",
    "renamed",
    "report",
    "require_zero_ddp",
    "resolve_mode",
]


@dataclass(repr=False)
class WeightsLoad:
    """What a weights-only load (``mode="finetune"`` or ``"inference"``) did. It unpacks like the
    result of torch's ``load_state_dict``: ``missing, unexpected = load_checkpoint(..., mode="finetune")``.

    Attributes:
        missing_keys: tensors of the model (primary names, layout order) the checkpoint lacks: they kept
            the values the model had before the load (its own init).
        unexpected_keys: tensors of the checkpoint the model lacks (not read; names as saved).
        mode: ``"finetune"`` or ``"inference"``.
        step: the step training starts at: always 0 (a fine-tune restarts the count).
        meta: the checkpoint's metadata (``meta.step`` is the step it was saved at, ``meta.model_config`` …).
    """

    missing_keys: list[str]
    unexpected_keys: list[str]
    mode: str
    meta: CheckpointMeta
    step: int = 0

    def __iter__(self):
        """``missing_keys`` then ``unexpected_keys`` (torch's ``_IncompatibleKeys`` order)."""
        return iter((self.missing_keys, self.unexpected_keys))

    def __repr__(self) -> str:
        return (f"WeightsLoad(missing_keys={self.missing_keys!r}, unexpected_keys={self.unexpected_keys!r}, "
                f"mode={self.mode!r}, step={self.step}, meta=<CheckpointMeta of step {self.meta.step}>)")


def require_zero_ddp(model, what: str) -> None:
    """Refuse a model that is not a ``ZeroDDP`` (checked by the shard-level API a checkpoint uses).

    Raises:
        ConfigError: ``model`` lacks that API (names its type and what to do instead).
    """
    if all(hasattr(model, a) for a in ("layout", "synchronize", "master_shard", "load_master_shard")):
        return
    raise ConfigError(
        f"{what} takes the ZeroDDP-wrapped model, got a plain {type(model).__name__}: wrap it first "
        f"(model = ZeroDDP(module), at any world size), then call {what}(..., model); to read a checkpoint into a "
        "plain module, export it (chunkzero export <ckpt> --format safetensors <dir>) and load_state_dict the file")


def resolve_mode(mode: str, optimizer, force: bool = False) -> str:
    """``mode`` as one of :data:`MODES` (SAT's ``"pretrain"`` → ``"resume"``).

    Raises:
        ConfigError: an unknown mode, an optimizer passed to a weights-only mode (which would leave it
            as it is: build the fresh optimizer after the load instead), or ``force`` with a mode other
            than ``"inference"`` (which would be ignored).
    """
    if not isinstance(mode, str) or mode not in (*MODES, *SAT_MODES):
        raise ConfigError(f"load mode must be one of {', '.join(map(repr, MODES))} (or SAT's 'pretrain'), got {mode!r}")
    mode = SAT_MODES.get(mode, mode)
    if mode != "resume" and optimizer is not None:
        raise ConfigError(f"mode={mode!r} loads the weights only and starts a fresh optimizer: pass optimizer=None "
                          "and build the optimizer after the load (mode='resume' restores its state)")
    if force and mode != "inference":
        raise ConfigError(f"force=True applies to mode='inference' only (load although the checkpoint lacks some of "
                          f"the model's tensors); mode={mode!r} does not take it: "
                          + ("a fine-tune already keeps the init of the tensors the checkpoint lacks"
                             if mode == "finetune" else "use mode='finetune' to load a checkpoint that lacks tensors"))
    return mode


def _listed(names: list[str], cap: int = 10) -> str:
    shown = ", ".join(map(repr, names[:cap]))
    return shown + (f", … ({len(names) - cap} more)" if len(names) > cap else "")


def check_complete(missing: list[str], unexpected: list[str], source: str) -> None:
    """Refuse a resume of a checkpoint whose tensors are not exactly the model's (all listed, capped).

    Raises:
        CheckpointError: ``missing`` or ``unexpected`` is not empty.
    """
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"lacks {len(missing)} tensor(s) of the model: {_listed(missing)}")
    if unexpected:
        parts.append(f"holds {len(unexpected)} tensor(s) the model lacks: {_listed(unexpected)}")
    raise CheckpointError(
        f"checkpoint {source!r} {' and '.join(parts)}; mode='resume' restores every tensor and its optimizer state: "
        "to load the matching weights only (the others keep their init), pass mode='finetune'")


def _prefix_hint(model_names: list[str], saved_names: list[str]) -> str:
    """A ``prefix=`` or ``model_prefix=`` that would make the names match, when one is evident."""
    for m in model_names:
        for c in saved_names:
            if m.endswith("." + c):
                return (
                    f" (the model's names carry {m[: len(m) - len(c)]!r} before the checkpoint's: pass model_prefix=)"
                )
            if c.endswith("." + m):
                return f" (the checkpoint's names carry {c[: len(c) - len(m)]!r} before the model's: pass prefix=)"
    return " (if the names differ by a prefix, pass prefix= or model_prefix=)"


def check_matched(model_layout, saved_layout, missing: list[str], source: str) -> None:
    """Refuse a weights-only load that would read no tensor at all.

    Raises:
        CheckpointError: every tensor of the model is ``missing`` (shows a few names of each side and
            the prefix that would match them, when one is evident).
    """
    if len(missing) < len(model_layout.tensors):
        return
    model_names = [t.name for t in model_layout.tensors]
    saved_names = [t.name for t in saved_layout.tensors]
    raise CheckpointError(
        f"no tensor of the model matched one of checkpoint {source!r}{_prefix_hint(model_names, saved_names)}: "
        f"the checkpoint has {_listed(saved_names, 3)}; the model has {_listed(model_names, 3)}")


def renamed(layout, prefix: str = "", model_prefix: str = ""):
    """The saved ``layout`` under the model's names: ``prefix`` removed from the names that start with it
    (the others match no model name: not read), then ``model_prefix`` put before each
    (``load_pretrained(prefix=)``'s rule, and its converse for a model that wraps the saved one).

    Returns:
        ``(layout, saved_names)``: the renamed layout (``layout`` itself without prefixes) and each
        new name's name as saved.
    """
    if not prefix and not model_prefix:
        return layout, {}
    from dataclasses import replace

    from chunkzero import ChunkLayout

    def name(n: str) -> str:
        if prefix:
            n = n[len(prefix):] if n.startswith(prefix) else "\0" + n  # outside the prefix: matches no model name
        return model_prefix + n

    tensors = [replace(t, name=name(t.name), aliases=tuple(name(a) for a in t.aliases)) for t in layout.tensors]
    chunks = [replace(c, tensor_names=tuple(name(n) for n in c.tensor_names)) for c in layout.chunks]
    saved_names = {name(n): n for t in layout.tensors for n in t.names}
    return ChunkLayout(tensors, chunks, chunk_size=layout.chunk_size, world_size=layout.world_size), saved_names


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
