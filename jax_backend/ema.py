"""``ChunkEMA``: an fp32 exponential moving average of a :class:`jax_backend.ZeroTrainer`'s master chunks,
sharded as they are — the JAX side of :class:`torch_backend.ZeroEMA`, with its update, its warm-up and its
checkpoint record, so either engine resumes the other's EMA.

The EMA holds one fp32 array per trainable chunk, of the chunk's size and with the master's sharding
(``P('shard')``; keep-gathered chunks replicated): 4 bytes per trainable parameter / W per device, none
for frozen chunks. After every *applied* step (a step skipped for a non-finite gradient changes no master
and no EMA) each array becomes::

    ema = decay * ema + (1 - decay) * master        # torch.lerp(ema, master, 1 - decay)

with torch's two-sided ``lerp`` (``ema + w·(master − ema)`` for ``w < 0.5``, else
``master − (master − ema)·(1 − w)``), the formula of ``torch.optim.swa_utils.get_ema_multi_avg_fn``.
It starts at the masters it is built on (``W_0^EMA = W_0``); ``warmup=True`` uses
``min(decay, (1 + n) / (10 + n))`` at the ``n``-th update (TensorFlow's ``ExponentialMovingAverage(num_updates=)``),
as ``ZeroEMA`` does. A checkpoint holds the arrays as its ``ema`` subtree and :meth:`meta` as its ``ema``
record (:class:`chunkzero.checkpoint.EmaMeta`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from chunkzero.checkpoint import EmaMeta, check_ema_decay, ema_decay_at

from .layout import check_chunks
from .schedule import TrainState

__all__ = ["ChunkEMA"]


def _lerp(ema: dict[str, jax.Array], master: dict[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
    def one(e, m):
        d = m - e
        return jnp.where(jnp.abs(weight) < 0.5, e + weight * d, m - d * (1.0 - weight))

    return {k: one(ema[k], master[k]) for k in ema}


class ChunkEMA:
    """An fp32 EMA of the trainable master chunks of ``trainer``'s state (see the module docstring).

    Args:
        trainer: the :class:`jax_backend.ZeroTrainer` whose masters are averaged (its ``layout``).
        state: the state whose masters the EMA starts at (copied; the step may donate ``state``).
        decay: the EMA decay in ``[0, 1)``.
        warmup: use ``min(decay, (1 + n) / (10 + n))`` at the ``n``-th update.

    Attributes:
        decay, warmup: as given (a resume may replace them).
        update_count: the updates applied so far (checkpointed; the warm-up's ``n``).
        chunks: ``{chunk_key: f32[size]}`` over the trainable chunks, sharded as the masters.

    Raises:
        ConfigError: a bad ``decay``.
    """

    def __init__(self, trainer, state: TrainState, decay: float, *, warmup: bool = False):
        self.decay = check_ema_decay(decay)
        self.warmup = bool(warmup)
        self.update_count = 0
        self.layout = trainer.layout
        self.trainable = list(trainer.trainable)
        self._lerp = jax.jit(_lerp, donate_argnums=(0,))
        self.chunks = {k: jnp.copy(state.master[k]) for k in self.trainable}

    def current_decay(self) -> float:
        """The decay the next update uses: ``decay``, or with ``warmup`` ``min(decay, (1 + n) / (10 + n))``
        for ``n = update_count``."""
        return ema_decay_at(self.decay, self.update_count, self.warmup)

    def update(self, state: TrainState) -> None:
        """Fold ``state``'s masters into the EMA and count the update; call it after each applied step."""
        weight = jnp.asarray(1.0 - self.current_decay(), jnp.float32)
        self.chunks = self._lerp(self.chunks, {k: state.master[k] for k in self.trainable}, weight)
        self.update_count += 1

    def weights(self, state: TrainState) -> dict[str, jax.Array]:
        """Every chunk of the layout, fp32: the EMA for trainable chunks, ``state``'s masters for frozen ones
        (they never change) — the weights to evaluate or sample with."""
        return {k: self.chunks.get(k, v) for k, v in state.master.items()}

    def meta(self) -> EmaMeta:
        """The checkpoint's ``ema`` record: decay, warm-up, update count."""
        return EmaMeta(decay=self.decay, update_count=int(self.update_count), warmup=self.warmup)

    def load(self, chunks: Mapping[str, Any], update_count: int) -> None:
        """Replace the EMA by restored arrays (``{chunk_key: f32[size]}``: the trainable chunks, any other key
        ignored; the restore of :func:`jax_backend.restore_checkpoint` with ``item="ema"``) and its count.

        Raises:
            LayoutError / ShapeMismatchError: an array is missing or not of its chunk's size.
        """
        picked = {k: chunks[k] for k in self.trainable if k in chunks}
        check_chunks(picked, self.layout, trainable_only=True, what="EMA chunks")
        self.chunks = {k: jax.device_put(jnp.asarray(v, jnp.float32), self.chunks[k].sharding)
                       for k, v in picked.items()}
        self.update_count = int(update_count)
