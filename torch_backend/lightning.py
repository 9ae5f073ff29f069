"""``ZeroStrategy``: train a LightningModule with chunkzero's ZeroDDP through ``lightning.pytorch``.

``Trainer(strategy=ZeroStrategy(...))`` (also importable as ``chunkzero.lightning.ZeroStrategy``) is a
``DDPStrategy``, as Lightning's DeepSpeed and ColossalAI strategies are: Lightning's launcher starts the
processes (``devices=2, accelerator="cpu"``: gloo; one per GPU: NCCL) and its loops drive the steps,
while the engine is chunkzero's:

- **model**: the LightningModule is wrapped in :class:`~torch_backend.ZeroDDP` (the strategy's arguments
  are ZeroDDP's options); ``training_step`` and ``validation_step`` run inside ZeroDDP's forward, so their
  chunks are gathered on use. The parameters keep the LightningModule's names. ``shard_group_size=S``
  is hybrid sharding (each chunk sharded over ``S`` ranks, replicated ``devices / S`` times).
- **optimizer**: the one optimizer ``configure_optimizers`` returns becomes a
  :class:`~torch_backend.ZeroOptimizer` of the same class, param groups and hyper-parameters (kernel flags
  left at ``None`` take ZeroOptimizer's defaults, fused Adam/AdamW); its LR schedulers are pointed at it.
  Automatic or manual optimization; several optimizers are refused by name (one ZeroOptimizer owns every
  trainable chunk's master shard: give them param groups of one optimizer).
- **precision**: ``Trainer(precision="bf16-mixed" | "16-mixed" | "32-true")`` becomes ZeroDDP's
  ``mixed_precision="bf16" | "fp16" | "fp32"`` (low-precision chunks, fp32 masters; fp16 with
  ZeroOptimizer's dynamic loss scale) instead of autocast.
- **clipping**: ``gradient_clip_val`` is ZeroOptimizer's ``max_norm`` (by norm only).
- **accumulation**: ``accumulate_grad_batches`` runs the micro-batches before the last under
  :meth:`~torch_backend.ZeroDDP.no_sync`.
- **checkpoints**: ``Trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) writes ``path`` as a
  chunkzero checkpoint directory (sharded Orbax, each rank its own shards; step = ``global_step``);
  the rest of Lightning's checkpoint (loops, callbacks, LR schedulers, hyper-parameters) goes into its
  JSON item (:mod:`torch_backend.lightning_state`). ``fit(ckpt_path=path)`` resumes it at any world
  size, shard group size or chunk size (:func:`~torch_backend.load_checkpoint`, ``mode="resume"``).
- **EMA**: :class:`~torch_backend.lightning_ema.ZeroEMACallback` keeps a sharded
  :class:`~torch_backend.ZeroEMA`, saved in the checkpoint's ``ema`` item.

Requires ``lightning`` (``pip install 'chunkzero[lightning]'``).
"""

from __future__ import annotations

import inspect
import shutil
from contextlib import contextmanager
from datetime import timedelta
from functools import wraps
from pathlib import Path
from typing import Any, Callable

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("chunkzero's Lightning strategy needs lightning: pip install 'chunkzero[lightning]'") from e

from chunkzero.checkpoint import is_step_dir, latest_step, orbax_store
from chunkzero.errors import CheckpointError, ConfigError

from .checkpoint.sharded import load_checkpoint, save_checkpoint
from .zero.collectives import all_gather_json
from .lightning_state import from_json, to_json
from .zero import ZeroDDP, ZeroOptimizer

__all__ = ["ZeroStrategy", "mixed_precision_of"]

LIGHTNING_KEY = "lightning"
"""The key of Lightning's state in a checkpoint's ``meta.extra``."""
_SHARDED_KEYS = ("state_dict", "optimizer_states")
"""What Lightning's checkpoint dictionary holds that the sharded arrays replace."""
_PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
_KERNEL_FLAGS = ("fused", "foreach")


def mixed_precision_of(precision: str) -> str:
    """ZeroDDP's ``mixed_precision`` for a Lightning ``precision`` string.

    Raises:
        ConfigError: a precision ZeroDDP cannot train in (``"bf16-true"``, ``"16-true"``, ``"64-true"`` …:
            ZeroDDP keeps fp32 masters; use the ``-mixed`` spelling).
    """
    if precision not in _PRECISIONS:
        raise ConfigError(f"ZeroStrategy trains with precision '32-true', 'bf16-mixed' or '16-mixed' (low-precision "
                          f"chunks with fp32 master shards), not {precision!r}")
    return _PRECISIONS[precision]


class _ZeroPrecision(Precision):
    """The precision plugin under ZeroStrategy: no autocast or grad scaler (ZeroDDP's chunks are already in
    the compute dtype, ZeroOptimizer scales fp16 losses); the closure runs before ``ZeroOptimizer.step``,
    which takes none; clipping is ZeroOptimizer's ``max_norm``."""

    def __init__(self, precision: str, strategy: ZeroStrategy):
        self.precision = precision  # what Trainer(precision=...) asked for, for logs and trainer.precision
        self._strategy = strategy

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise ConfigError("ZeroStrategy's backward takes no extra arguments (retain_graph, inputs …)")
        zero = self._strategy.zero_optimizer
        if zero is None:
            tensor.backward()
        else:
            zero.backward(tensor)  # scaled in fp16

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if kwargs:
            raise ConfigError(f"ZeroOptimizer.step takes no arguments, got {sorted(kwargs)}")
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and isinstance(model, pl.LightningModule) and model.automatic_optimization:
            return None  # training_step returned None: Lightning skips the step
        optimizer.step()
        return closure_result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        if not clip_val or clip_val <= 0:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise ConfigError("ZeroStrategy clips gradients by their global norm only (gradient_clip_algorithm='norm')")
        zero = getattr(optimizer, "_optimizer", optimizer)
        zero.max_norm = float(clip_val)  # applied inside the step that follows


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's LR schedulers mark the optimizer they are built on, so that a
    scheduler moved onto it does not warn that the step was overridden."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @wraps(step)
    def tracked(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    optimizer.step = tracked


def zero_optimizer_from(model: ZeroDDP, optimizer: torch.optim.Optimizer, *, max_norm: float | None) -> ZeroOptimizer:
    """A :class:`ZeroOptimizer` over ``model`` of ``optimizer``'s class, param groups and hyper-parameters.

    Kernel flags (``fused``, ``foreach``) left at ``None`` are dropped, so ZeroOptimizer's defaults apply;
    every other group key is kept as it is (an LR scheduler's ``lr`` and ``initial_lr`` included).

    Raises:
        ConfigError: the groups do not list every trainable parameter once, or hold a frozen or foreign one
            (ZeroOptimizer's checks).
    """
    def drop_unset(d):
        return {k: v for k, v in d.items() if not (k in _KERNEL_FLAGS and v is None)}

    accepted = inspect.signature(type(optimizer).__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):  # AdamW.defaults holds more
        defaults = {k: v for k, v in drop_unset(optimizer.defaults).items() if k in accepted}
    else:
        defaults = drop_unset(optimizer.defaults)
    groups = [{"params": list(g["params"]), **drop_unset({k: v for k, v in g.items() if k not in ("params", "initial_lr")})}
              for g in optimizer.param_groups]
    zero = ZeroOptimizer(model, type(optimizer), params=groups, max_norm=max_norm, **defaults)
    if len(zero.param_groups) != len(optimizer.param_groups):
        raise ConfigError(f"{type(optimizer).__name__} has {len(optimizer.param_groups)} param groups, of which "
                          f"{len(zero.param_groups)} hold trainable parameters; give frozen parameters no group")
    for new, old in zip(zero.param_groups, optimizer.param_groups):
        if "initial_lr" in old:
            new["initial_lr"] = old["initial_lr"]
    return zero


def _checked_shard_group_size(shard_group_size) -> int | None:
    if shard_group_size is not None and (isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int)
                                         or shard_group_size < 1):
        raise ConfigError(f"ZeroStrategy(shard_group_size=...) must be a positive int (ranks) or None, "
                          f"got {shard_group_size!r}")
    return shard_group_size


def _check_divides(shard_group_size: int | None, world_size: int) -> None:
    if shard_group_size is not None and world_size % shard_group_size:
        raise ConfigError(f"ZeroStrategy(shard_group_size={shard_group_size}) does not divide the {world_size} devices "
                          f"(ranks = shard_group_size x replicas: pick one of "
                          f"{[s for s in range(1, world_size + 1) if world_size % s == 0]})")


def _is_chunkzero_checkpoint(path: Path) -> bool:
    return path.is_dir() and (is_step_dir(path) or latest_step(path) is not None)


class ZeroStrategy(DDPStrategy):
    """A ``lightning.pytorch`` strategy that trains with :class:`~torch_backend.ZeroDDP` and
    :class:`~torch_backend.ZeroOptimizer` (see the module docstring for what maps to what).

    Args:
        chunk_size, prefetch, placement, offload_optim_frac, offload_param_frac, keep_gathered,
        find_unused_parameters, shard_group_size: ZeroDDP's options of the same names (chunk size in
            elements, default searched; ``shard_group_size`` in ranks, ``None`` = all of them, flat
            ZeRO-3). The mixed precision comes from ``Trainer(precision=...)``.
        checkpoint_timeout_s: the longest wait, in seconds, of a checkpoint save for the other ranks.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, process_group_backend, timeout,
        start_method: as ``DDPStrategy``'s (Lightning sets most of them from the Trainer).

    Raises:
        ConfigError: ``shard_group_size`` not a positive int; at set-up: a ``shard_group_size`` that does
            not divide the number of devices (ranks); at ``fit``: more than one optimizer, a precision
            ZeroDDP cannot train in (:func:`mixed_precision_of`), ``gradient_clip_algorithm="value"``,
            ``storage_options`` given to a save; any ZeroDDP / ZeroOptimizer option error.
        CheckpointError: ``ckpt_path`` or a save path that is not a chunkzero checkpoint directory.
    """

    strategy_name = "chunkzero"

    def __init__(
        self,
        *,
        chunk_size: int | None = None,
        prefetch: int = 1,
        placement: str = "static",
        offload_optim_frac: float | None = None,
        offload_param_frac: float | None = None,
        keep_gathered=None,
        find_unused_parameters: bool = False,
        shard_group_size: int | None = None,
        checkpoint_timeout_s: float = orbax_store.DEFAULT_TIMEOUT_S,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self.zero_options = dict(chunk_size=chunk_size, prefetch=prefetch, placement=placement,
                                 offload_optim_frac=offload_optim_frac, offload_param_frac=offload_param_frac,
                                 keep_gathered=keep_gathered, find_unused_parameters=find_unused_parameters,
                                 shard_group_size=_checked_shard_group_size(shard_group_size))
        """ZeroDDP's keyword arguments (besides ``mixed_precision``)."""
        self.checkpoint_timeout_s = orbax_store.check_timeout(checkpoint_timeout_s)
        self.zero_model: ZeroDDP | None = None
        """The ZeroDDP around the LightningModule, once set up (kept across ``fit``, ``validate`` …)."""
        self.zero_optimizer: ZeroOptimizer | None = None
        """The ZeroOptimizer built from ``configure_optimizers``, once fitting."""

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        mixed_precision = mixed_precision_of(precision)
        self.precision_plugin = _ZeroPrecision(precision, self)
        module = self.lightning_module
        if self.zero_model is None or self.zero_model.module is not module:
            _check_divides(self.zero_options["shard_group_size"], self.world_size)
            module.to(self.root_device)
            self.zero_model = ZeroDDP(module, mixed_precision=mixed_precision, **self.zero_options)
        elif self.zero_model.mixed_precision != mixed_precision:
            raise ConfigError(f"this ZeroStrategy's model was set up in {self.zero_model.mixed_precision}, "
                              f"the Trainer now asks for {precision!r}")
        self.model = self.zero_model
        if trainer.state.fn == TrainerFn.FITTING:
            if trainer.gradient_clip_algorithm not in (None, GradClipAlgorithmType.NORM):
                raise ConfigError("ZeroStrategy clips gradients by their global norm only (gradient_clip_algorithm='norm')")
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)  # configure_optimizers: torch optimizers and scheduler configs
        if len(self.optimizers) != 1:
            raise ConfigError(f"ZeroStrategy trains with one optimizer (one ZeroOptimizer owns every trainable chunk's "
                              f"master shard); configure_optimizers returned {len(self.optimizers)}: put the parameters "
                              "in param groups of one optimizer")
        original = self.optimizers[0]
        clip = trainer.gradient_clip_val
        zero = zero_optimizer_from(self.zero_model, original, max_norm=float(clip) if clip else None)
        for config in self.lr_scheduler_configs:
            if config.scheduler.optimizer is original:
                config.scheduler.optimizer = zero
        _track_step_called(zero)
        self.zero_optimizer = zero
        self.optimizers = [zero]

    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)  # before wrapping only: the chunks then own the parameters

    @contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: the micro-batches before the last accumulate locally (``no_sync``)."""
        if self.zero_model is None:
            yield None
            return
        with self.zero_model.no_sync():
            yield None

    def teardown(self) -> None:
        # Unlike DDP's, the model stays wrapped: its parameters live in the chunks (read them with
        # strategy.model.state_dict()), and neither it nor the optimizer state is moved.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards exist only once the model is wrapped

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer's shards

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights are the checkpoint's sharded arrays: nothing gathered

    def optimizer_state(self, optimizer) -> dict[str, torch.Tensor]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Write ``filepath`` as a chunkzero checkpoint directory (collective: every rank calls it, as
        ``Trainer.save_checkpoint`` does). A chunkzero checkpoint already at ``filepath`` with a step at or
        after this one is replaced (a file path is Lightning's to overwrite): those steps are removed first,
        older ones only once the new step is written. Rank 0's view of ``filepath`` decides for all ranks.

        Raises:
            ConfigError: ``storage_options`` given, or Lightning state that is not JSON data or tensors.
            CheckpointError: ``filepath`` exists and is not a chunkzero checkpoint; the save failed.
        """
        if storage_options is not None:
            raise ConfigError("ZeroStrategy writes chunkzero checkpoints; storage_options is not supported")
        path = Path(filepath)
        state = to_json({k: v for k, v in checkpoint.items() if k not in _SHARDED_KEYS}, "Lightning checkpoint")
        step = int(checkpoint.get("global_step", self.lightning_module.trainer.global_step))
        # rank 0's view of ``filepath`` decides for every rank (one JSON gather: no rank waits in a barrier
        # another skipped, and no peer data is unpickled)
        if not path.exists():
            view = "new"
        elif not _is_chunkzero_checkpoint(path):
            view = "foreign"
        else:
            last = latest_step(path)
            view = "replace" if last is not None and last >= step else "keep"
        view = all_gather_json(view, self.zero_model.process_group)[0]
        if view == "foreign":
            raise CheckpointError(f"{str(path)!r} exists and is not a chunkzero checkpoint directory; not overwritten")
        if view == "replace":  # only the steps at or after this one: the older ones stay until the save is done
            if self.is_global_zero:
                for d in path.iterdir():
                    if d.is_dir() and d.name.isdigit() and int(d.name) >= step:
                        shutil.rmtree(d)
            all_gather_json("replaced", self.zero_model.process_group)
        optimizer = self.zero_optimizer if self.optimizers else None
        save_checkpoint(path, self.zero_model, optimizer, step=step, extra={LIGHTNING_KEY: state}, max_to_keep=1,
                        timeout_s=self.checkpoint_timeout_s)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model (and, when fitting, the optimizer, loss scaler and RNG states) from a
        chunkzero checkpoint directory of any world size; return Lightning's part of it.

        Raises:
            CheckpointError: ``checkpoint_path`` does not exist, or is not a chunkzero checkpoint (a Lightning ``.ckpt``
                file of another strategy is not read: it is a pickle), or holds no Lightning state.
        """
        path = Path(checkpoint_path)
        if not path.exists():
            raise CheckpointError(f"ckpt_path {str(path)!r} does not exist")
        if not _is_chunkzero_checkpoint(path):
            raise CheckpointError(f"{str(path)!r} is not a chunkzero checkpoint directory (ZeroStrategy saves and "
                                  "resumes those; a .ckpt file of another strategy is a pickle and is not read)")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self.zero_optimizer if fitting else None
        meta = load_checkpoint(path, self.zero_model, optimizer, load_rng=fitting)
        extra = meta.extra or {}
        if LIGHTNING_KEY not in extra:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no Lightning state (it was not saved by ZeroStrategy); "
                                  "load it with torch_backend.load_checkpoint")
        return from_json(extra[LIGHTNING_KEY], "Lightning checkpoint")

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint restored the shards

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # load_checkpoint restored the optimizer's shards
