"""``ZeroEMACallback``: a sharded EMA of the weights under Lightning's Trainer with :class:`ZeroStrategy`.

Lightning's own ``WeightAveraging`` keeps a full copy of the model on every rank; this callback keeps a
:class:`~torch_backend.ZeroEMA` instead: one fp32 shard per trainable chunk beside each master shard
(4 bytes per parameter / shard group size), updated after every applied optimizer step by ZeroEMA's own
step hook, with ``torch.optim.swa_utils.get_ema_multi_avg_fn``'s formula. Also importable as
``chunkzero.lightning.ZeroEMACallback``.

- **built** at ``on_fit_start``, over the strategy's ZeroOptimizer, at the weights as they are then
  (before ``fit(ckpt_path=)`` restores a checkpoint: Lightning restores after that hook, so the restore
  overwrites it with the saved EMA);
- **checkpointed** by ZeroStrategy's save as the sharded checkpoint's ``ema`` item (decay, warm-up and
  update count in its metadata), and resumed at any world size, shard group size or chunk size; a
  checkpoint without an EMA restarts it at the loaded weights (a warning);
- **validation** on the EMA weights with ``validate_on_ema=True``: ``ZeroEMA.ema_weights()`` is entered
  at ``on_validation_start`` and left at ``on_validation_end`` (or on an exception), so the validation
  loop (the sanity check, the validations inside ``fit``, ``trainer.validate`` after it) sees the EMA
  and training continues on the live weights, bit for bit (Lightning runs ``ModelCheckpoint``'s hooks
  after every other callback's, so a checkpoint saved at a validation's end holds the live weights).
"""

from __future__ import annotations

from contextlib import ExitStack

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from chunkzero.checkpoint import check_ema_decay
from chunkzero.errors import ConfigError

from .lightning import ZeroStrategy
from .zero import ZeroEMA

__all__ = ["ZeroEMACallback"]


class ZeroEMACallback(Callback):
    """An EMA of the weights, sharded as the master shards are (see the module docstring).

    Args:
        decay: the EMA decay in ``[0, 1)``: ``ema = decay * ema + (1 - decay) * weights`` after each
            optimizer step.
        warmup: use ``min(decay, (1 + n) / (10 + n))`` at the ``n``-th update (ZeroEMA's warm-up).
        validate_on_ema: run every validation loop on the EMA weights.

    Attributes:
        ema: the :class:`~torch_backend.ZeroEMA`, once ``fit`` has started (``None`` before).

    Raises:
        ConfigError: a bad ``decay`` (at construction); at set-up, a strategy that is not
            :class:`ZeroStrategy`; with ``validate_on_ema``, a validation before any ``fit`` (no EMA yet).
    """

    def __init__(self, decay: float, warmup: bool = False, validate_on_ema: bool = False):
        self.decay = check_ema_decay(decay, "ZeroEMACallback(decay=...)")
        self.warmup = bool(warmup)
        self.validate_on_ema = bool(validate_on_ema)
        self.ema: ZeroEMA | None = None
        self._swap = ExitStack()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: ARG002 - Lightning Callback signature
        if not isinstance(trainer.strategy, ZeroStrategy):
            raise ConfigError(f"ZeroEMACallback needs Trainer(strategy=ZeroStrategy(...)), got "
                              f"{type(trainer.strategy).__name__} (its EMA lives beside ZeroOptimizer's master shards)")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: ARG002 - Lightning Callback signature
        if self.ema is not None:
            self.ema.remove()  # a later fit: its ZeroOptimizer is new, and so is the EMA (at the weights now)
        self.ema = ZeroEMA(trainer.strategy.zero_optimizer, self.decay, warmup=self.warmup)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: ARG002 - Lightning Callback signature
        if not self.validate_on_ema:
            return
        if self.ema is None:
            raise ConfigError("ZeroEMACallback(validate_on_ema=True): there is no EMA before trainer.fit has started")
        self._swap.enter_context(self.ema.ema_weights())

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: ARG002 - Lightning Callback signature
        self._swap.close()  # the live weights back

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:  # noqa: ARG002 - Lightning Callback signature
        self._swap.close()
