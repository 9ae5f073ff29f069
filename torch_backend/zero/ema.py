"""``ZeroEMA``: an exponential moving average of a :class:`~torch_backend.ZeroOptimizer`'s fp32 master
shards, sharded and placed as they are (SwissArmyTransformer's ``FusedEmaAdam`` shadow; the update of
torch's ``AveragedModel`` with ``get_ema_multi_avg_fn``).

Each rank keeps, per trainable chunk, one fp32 buffer of ``shard_numel`` elements beside the chunk's
master shard, on the master's device (the host when the optimizer is offloaded): 4 bytes per trainable
parameter / W (/ S under hybrid sharding: a rank holds 1/S of each chunk), none for frozen chunks
(they never change). After every *applied* optimizer step — a step skipped for an fp16 overflow
changes no master and no EMA — each buffer becomes::

    ema = decay * ema + (1 - decay) * master        # torch._foreach_lerp_(ema, master, 1 - decay)

the formula of SAT's shadow and of ``torch.optim.swa_utils.get_ema_multi_avg_fn``, with the same
kernel, so an unsharded torch ``AveragedModel`` on the same masters gives the same bits. The EMA starts
at the masters as they are when the ``ZeroEMA`` is built (SAT's shadow; ``W_0^EMA = W_0`` of
``get_ema_multi_avg_fn``; an ``AveragedModel`` that is updated once before training). ``warmup=True``
uses ``min(decay, (1 + n) / (10 + n))`` for the ``n``-th update (TensorFlow's
``ExponentialMovingAverage(num_updates=)`` and timm's warm-up), so early weights, close to the random
initialization, fade out fast; torch's ``get_ema_multi_avg_fn`` itself has no warm-up.

:meth:`ZeroEMA.ema_weights` swaps the EMA into the live master shards (and the low-precision shards
refreshed from them) for evaluation, sampling, ``state_dict()`` or an export, and swaps the live
weights back on exit, also when the block raises; the swap copies in place, one shard at a time, so it
needs no second copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from chunkzero.checkpoint import check_ema_decay, ema_decay_at
from chunkzero.errors import ConfigError, ShapeMismatchError

from . import collectives
from .optim import ZeroOptimizer
from .pinned import copied

__all__ = ["ZeroEMA"]


class ZeroEMA:
    """An fp32 EMA of ``optimizer``'s master shards, updated after each applied ``optimizer.step()``.

    Args:
        optimizer: the :class:`~torch_backend.ZeroOptimizer` whose masters are averaged. The EMA
            registers itself as ``optimizer.ema`` (one per optimizer), so :func:`save_checkpoint`,
            :func:`load_checkpoint` and ``optimizer.memory_report()`` find it.
        decay: the EMA decay in ``[0, 1)`` (``0.999``: a time constant of about 1000 steps).
        warmup: use ``min(decay, (1 + n) / (10 + n))`` at the ``n``-th update (see the module docstring).

    Attributes:
        decay, warmup: as given.
        update_count: the updates applied so far (checkpointed; the warm-up's ``n``).
        shards: chunk index -> this rank's EMA shard (fp32, 1-D, ``layout.shard_numel(chunk)``
            elements aligned with ``model.master_shard(chunk)``, zero padding), trainable chunks only.

    Raises:
        ConfigError: ``optimizer`` is not a ZeroOptimizer or has an EMA already; a bad ``decay``.
    """

    def __init__(self, optimizer, decay: float = 0.999, *, warmup: bool = False):
        if not isinstance(optimizer, ZeroOptimizer):
            raise ConfigError(f"ZeroEMA needs a ZeroOptimizer, got {type(optimizer).__name__}")
        if optimizer.ema is not None:
            raise ConfigError("this ZeroOptimizer has an EMA already (optimizer.ema); build one ZeroEMA per optimizer")
        self.decay = check_ema_decay(decay)
        self.warmup = bool(warmup)
        self.optimizer = optimizer
        self.model = optimizer.model
        self.update_count = 0
        self.model.synchronize()
        self.shards: dict[int, torch.Tensor] = {}
        for c in self.model.chunks:
            if c.requires_grad:
                self.shards[c.index] = copied(c.master.detach(), c.master.device, c.device)
        self._swapped = False
        self._count_before_step = optimizer.step_count
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step)]
        optimizer.attach_ema(self)

    # ------------------------------------------------------------------ the update
    def current_decay(self) -> float:
        """The decay the next update uses: ``decay``, or with ``warmup`` ``min(decay, (1 + n) / (10 + n))``
        for ``n = update_count``."""
        return ema_decay_at(self.decay, self.update_count, self.warmup)

    def _before_step(self, optimizer, args, kwargs) -> None:  # noqa: ARG002 - torch's hook signature
        if self._swapped:
            raise ConfigError("optimizer.step() inside ZeroEMA.ema_weights(): the live shards hold the EMA weights "
                              "there; step after the with-block")
        self._count_before_step = optimizer.step_count

    def _after_step(self, optimizer, args, kwargs) -> None:  # noqa: ARG002 - torch's hook signature
        if optimizer.step_count > self._count_before_step:  # applied (a skipped step does not count)
            self.update()

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current masters into the EMA (``ema += (1 - d) * (master - ema)``, ``d`` =
        :meth:`current_decay`) and count the update. Called after each applied optimizer step; call it
        yourself only for an update outside one (every rank, the same calls). An EMA shard follows its
        master to the device the placement moved it to."""
        weight = 1.0 - self.current_decay()
        groups: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for ci, buf in self.shards.items():
            c = self.model.chunks[ci]
            master = c.master.detach()
            if buf.device != master.device:
                buf = self.shards[ci] = copied(buf, master.device, c.device)
            emas, masters = groups.setdefault(master.device, ([], []))
            emas.append(buf)
            masters.append(master)
        for emas, masters in groups.values():
            torch._foreach_lerp_(emas, masters, weight)
        self.update_count += 1

    # ------------------------------------------------------------------ the swap
    @contextmanager
    def ema_weights(self) -> Iterator:
        """Within the block the model computes with the EMA weights (the masters, the low-precision
        shards and ``model.state_dict()`` hold them); on exit, also on an exception, the live weights
        are back, bit for bit. Every rank enters together (each swaps its own shards; no collective).
        ``optimizer.step()`` inside the block raises. Yields the model.

        Raises:
            ConfigError: already inside ``ema_weights()``.
        """
        if self._swapped:
            raise ConfigError("ZeroEMA.ema_weights() is already active (the blocks do not nest)")
        self._swap()
        self._swapped = True
        try:
            yield self.model
        finally:
            self._swapped = False
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        """Exchange each EMA shard with its master shard in place and refresh the low-precision shard.

        The host first waits for the compute stream (CUDA): an asynchronous host→device refresh of an
        offloaded chunk may still be reading its pinned master, which the swap overwrites."""
        self.model.synchronize()
        collectives.synchronize_event(collectives.record_event(collectives.compute_stream(self.model.device)))
        for ci, buf in self.shards.items():
            c = self.model.chunks[ci]
            master = c.master.detach()
            if buf.device != master.device:
                buf = self.shards[ci] = copied(buf, master.device, c.device)
            live = master.clone()
            master.copy_(buf)
            buf.copy_(live)
            del live
            c.refresh_from_master()

    # ------------------------------------------------------------------ checkpoints and memory
    def load_shard(self, chunk: int, values: torch.Tensor) -> None:
        """Overwrite this rank's EMA shard of ``chunk`` (1-D, ``shard_numel`` elements, any floating dtype).

        Raises:
            ConfigError: ``chunk`` is frozen (it has no EMA).
            ShapeMismatchError: ``values`` is not of that shape.
        """
        buf = self.shards.get(chunk)
        if buf is None:
            raise ConfigError(f"chunk {chunk} holds frozen parameters and has no EMA")
        if tuple(values.shape) != tuple(buf.shape):
            raise ShapeMismatchError(f"chunk {chunk} EMA shard", tuple(buf.shape), tuple(values.shape))
        with torch.no_grad():
            buf.copy_(values.to(buf.device, torch.float32))

    def state(self) -> dict:
        """``{"decay", "warmup", "update_count"}``: what a checkpoint records beside the shards."""
        return {"decay": self.decay, "warmup": self.warmup, "update_count": int(self.update_count)}

    def load_state(self, state: dict) -> None:
        """The reverse of :meth:`state` (a checkpoint's decay and warm-up replace this EMA's).

        Raises:
            ConfigError: a bad ``decay``.
        """
        self.decay = check_ema_decay(state.get("decay", self.decay))
        self.warmup = bool(state.get("warmup", self.warmup))
        self.update_count = int(state.get("update_count", self.update_count))

    def state_bytes(self) -> list[tuple[torch.device, int]]:
        """``(device, bytes)`` of each EMA shard this rank holds (``memory_report``'s ``ema``)."""
        return [(b.device, b.numel() * b.element_size()) for b in self.shards.values()]

    def remove(self) -> None:
        """Detach the EMA from its optimizer (no more updates; ``optimizer.ema`` becomes ``None``)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.optimizer.detach_ema(self)
