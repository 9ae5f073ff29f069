"""``ZeroOptimizer``: a torch optimizer on fp32 master shards, with dynamic loss scaling and
global-norm clipping (ColossalAI Gemini's ``ZeroOptimizer``; mixed-precision training after
Micikevicius et al. 2018, "Mixed Precision Training"; the hysteresis scaler is Megatron-LM's).

The inner optimizer (any elementwise torch optimizer: AdamW, Adam, SGD with momentum …) sees one
fp32 ``nn.Parameter`` per trainable chunk — this rank's master shard (a keep-gathered chunk's
whole master) — whose ``.grad`` the model's backward fills with the averaged gradient shard.
``step()``:

1. sums the squared gradient norms of all chunks over valid elements (keep-gathered chunks counted
   once, on rank 0) and all-reduces them: one collective gives the global norm and the overflow flag
   (an inf/nan anywhere makes the sum non-finite on every rank);
2. on overflow skips the update (parameters and optimizer state untouched), drops the gradients
   and backs the loss scale off per hysteresis;
3. else unscales by the scale *the backward used* (recorded by :meth:`ZeroOptimizer.backward`) and
   clips like ``torch.nn.utils.clip_grad_norm_`` on the unsharded model, runs the inner optimizer,
   refreshes the low-precision shards from the masters, and only then updates the scale.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from chunkzero.errors import CheckpointError, ConfigError, ShapeMismatchError

from . import collectives
from .ddp import ZeroDDP

__all__ = ["DynamicLossScaler", "ZeroOptimizer"]


class DynamicLossScaler:
    """Dynamic loss scale with growth interval and hysteresis (Megatron-LM's ``DynamicGradScaler``).

    On an overflow the growth counter resets and the hysteresis counter drops by one; when it reaches
    zero the scale is multiplied by ``backoff_factor`` (not below ``min_scale``) — so ``hysteresis=1``
    halves at the first overflow. After ``growth_interval`` overflow-free steps in a row the scale is
    multiplied by ``growth_factor`` (not above ``max_scale``) and the hysteresis counter is refilled.
    """

    def __init__(self, initial_scale: float = 2.0**16, *, growth_interval: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, max_scale: float = 2.0**32, growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if not initial_scale > 0:
            raise ConfigError(f"initial_scale must be > 0, got {initial_scale!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ConfigError(f"growth_interval must be a positive int (steps), got {growth_interval!r}")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ConfigError(f"hysteresis must be a positive int (overflows), got {hysteresis!r}")
        if not 0 < min_scale <= initial_scale:
            raise ConfigError(f"min_scale must be in (0, initial_scale], got {min_scale!r}")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ConfigError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor!r}, {backoff_factor!r}")
        self.scale = float(initial_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "scale", "growth_tracker", "hysteresis_tracker", "growth_interval", "hysteresis",
            "min_scale", "max_scale", "growth_factor", "backoff_factor")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if not hasattr(self, k):
                raise CheckpointError(f"unknown loss-scaler field {k!r}")
            setattr(self, k, type(getattr(self, k))(v))


class ZeroOptimizer:
    """Mixed-precision optimizer over a :class:`ZeroDDP` model's fp32 master shards.

    Args:
        model: the wrapped model.
        optimizer_class: an elementwise ``torch.optim.Optimizer`` class (AdamW, Adam, SGD …); built
            with one param group holding one master shard per trainable chunk.
        max_norm: clip gradients to this global L2 norm (unscaled), like ``clip_grad_norm_``.
        initial_scale, growth_interval, hysteresis, min_scale: dynamic loss scaling, used in fp16
            only (bf16/fp32 use scale 1 and still skip non-finite steps).
        **hyperparameters: passed to ``optimizer_class`` (``lr``, ``betas``, ``weight_decay`` …).

    Per-parameter param groups are not supported (a chunk mixes parameters): every parameter gets
    the same hyper-parameters, as in Gemini.

    Shard-level API (for checkpoints): :meth:`shard_state`, :meth:`load_shard_state`,
    :meth:`loss_scaler_state`, :meth:`load_loss_scaler_state`, :attr:`step_count`.

    Raises:
        ConfigError: ``model`` is not a ZeroDDP, ``max_norm`` is not positive, bad scaler settings.
    """

    def __init__(self, model: ZeroDDP, optimizer_class=torch.optim.AdamW, *, max_norm: float | None = None,
                 initial_scale: float = 2.0**16, growth_interval: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, **hyperparameters):
        if not isinstance(model, ZeroDDP):
            raise ConfigError(f"ZeroOptimizer needs a ZeroDDP model, got {type(model).__name__}")
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ConfigError(f"max_norm must be a positive number or None, got {max_norm!r}")
        self.model = model
        self.max_norm = None if max_norm is None else float(max_norm)
        self._chunks = [c for c in model.chunks if c.requires_grad]
        if not self._chunks:
            raise ConfigError("the model has no trainable parameters")
        self.optimizer: torch.optim.Optimizer = optimizer_class([c.master for c in self._chunks], **hyperparameters)
        """The inner torch optimizer (its params are the master shards; use it for LR schedulers)."""
        self.fp16 = model.mixed_precision == "fp16"
        self.scaler = DynamicLossScaler(initial_scale if self.fp16 else 1.0, growth_interval=growth_interval,
                                        hysteresis=hysteresis, min_scale=min(min_scale, initial_scale) if self.fp16 else 1.0)
        self.step_count = 0
        """Applied (non-skipped) steps."""
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        """Global unscaled gradient L2 norm before clipping, from the last ``step()`` (``inf``/``nan`` on overflow)."""
        self._names = [t.name for c in self._chunks for t in c.placements]
        self._grad_scale = 1.0
        """The loss scale the gradients now accumulated were computed with (set by :meth:`backward`)."""

    # ------------------------------------------------------------------ training
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        return self.scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * loss_scale).backward()``; records the scale so ``step`` unscales by it."""
        scale = self.scaler.scale if self.fp16 else 1.0
        self._grad_scale = scale
        self.model.backward(loss * scale if scale != 1.0 else loss)
        self.model.raise_pending_error()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002
        """Drop all gradients (the model's buffers and the fp32 gradient shards)."""
        self.model.zero_grad()
        self._grad_scale = 1.0

    def _global_sq_norm(self) -> float:
        device = self.model.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for c in self._chunks:
            if c.grad_sq_norm is None:
                continue
            if c.keep_gathered and self.model.rank != 0:
                continue  # every rank holds the same full gradient: count it once
            total = total + c.grad_sq_norm.to(device)
        collectives.all_reduce_sum(total, self.model.process_group)
        return float(total.item())

    @torch.no_grad()
    def step(self) -> bool:
        """Clip, unscale, update the master shards, refresh the low-precision shards.

        Returns:
            ``True`` if the update was applied, ``False`` if it was skipped (overflow).
        """
        self.model.raise_pending_error()
        self.model.finish_gradients()
        sq = self._global_sq_norm()
        scale = float(self._grad_scale)
        if not math.isfinite(sq):
            self.last_grad_norm = sq
            self.skipped_steps += 1
            self.zero_grad()
            self.scaler.update(True)
            return False
        norm = math.sqrt(sq) / scale
        self.last_grad_norm = norm
        factor = 1.0 / scale
        if self.max_norm is not None:
            clip = self.max_norm / (norm + 1e-6)
            if clip < 1.0:
                factor *= clip
        grads = [c.master.grad for c in self._chunks if c.master.grad is not None]
        if factor != 1.0 and grads:
            torch._foreach_mul_(grads, factor)
        self.optimizer.step()
        for c in self.model.chunks:
            if c.requires_grad:
                c.refresh_from_master()
        self.step_count += 1
        if self.fp16:
            self.scaler.update(False)
        return True

    # ------------------------------------------------------------------ shard-level state
    def _chunk(self, chunk: int):
        c = self.model.chunks[chunk]
        if not c.requires_grad:
            raise ConfigError(f"chunk {chunk} holds frozen parameters and has no optimizer state")
        return c

    def shard_state(self, chunk: int) -> dict[str, torch.Tensor]:
        """This rank's optimizer state of ``chunk``: the live tensors of the inner optimizer.

        Per-element states (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer`` …) are 1-D fp32 tensors of
        ``layout.shard_numel(chunk)`` elements aligned with :meth:`ZeroDDP.master_shard`; scalars
        (``step``) are 0-d tensors. Empty before the first step.

        Raises:
            ConfigError: ``chunk`` is frozen.
        """
        return dict(self.optimizer.state.get(self._chunk(chunk).master, {}))

    def load_shard_state(self, chunk: int, state: dict[str, torch.Tensor | float]) -> None:
        """Set this rank's optimizer state of ``chunk`` (the reverse of :meth:`shard_state`).

        1-D states are copied to the master's device as fp32; ``step`` stays a float32 tensor.

        Raises:
            ShapeMismatchError: a 1-D state is not ``shard_numel`` long.
        """
        c = self._chunk(chunk)
        new: dict[str, Any] = {}
        for key, value in state.items():
            value = torch.as_tensor(value)
            if value.dim() >= 1:
                if tuple(value.shape) != (c.shard_numel,):
                    raise ShapeMismatchError(f"chunk {chunk} optimizer state {key!r}", (c.shard_numel,), tuple(value.shape))
                new[key] = value.to(c.master.device, torch.float32, copy=True)
            else:
                new[key] = value.to(torch.float32, copy=True) if value.is_floating_point() else value.clone()
        self.optimizer.state[c.master] = new

    def loss_scaler_state(self) -> dict[str, Any]:
        """The loss scaler's state (plain Python numbers) plus ``step_count``/``skipped_steps``."""
        return {**self.scaler.state_dict(), "step_count": self.step_count, "skipped_steps": self.skipped_steps}

    def load_loss_scaler_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.step_count = int(state.pop("step_count", self.step_count))
        self.skipped_steps = int(state.pop("skipped_steps", self.skipped_steps))
        self.scaler.load_state_dict(state)

    def hyperparameters(self) -> dict[str, Any]:
        """The inner param group's hyper-parameters (``lr``, ``betas`` …), without ``params``."""
        return {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}

    def state_bytes(self) -> list[tuple[torch.device, int]]:
        """``(device, bytes)`` of each optimizer state tensor this rank holds (exp_avg, exp_avg_sq …)."""
        out = []
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    out.append((v.device, v.numel() * v.element_size()))
        return out

    def memory_report(self):
        """The model's :meth:`ZeroDDP.memory_report` with this optimizer's state shards counted."""
        return self.model.memory_report(self)

    # ------------------------------------------------------------------ full state dict
    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer format keyed by parameter name, with full shapes (collective).

        ``{"state": {name: {"step": 0-d, "exp_avg": full-shaped fp32 CPU tensor, ...}},
        "param_groups": [{hyper-parameters..., "params": [names in parameter order]}]}`` — the names
        are the primary names of the trainable parameters in ``module.parameters()`` order, so
        ``torch.optim.AdamW([p for p in module.parameters() if p.requires_grad]).load_state_dict``
        accepts it. Chunks are gathered one at a time.
        """
        state: dict[str, dict[str, Any]] = {}
        for c in self._chunks:
            st = self.optimizer.state.get(c.master, {})
            per = {t.name: {} for t in c.placements}
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == c.shard_numel:
                    full = c.gather_shard_tensor(value)
                    for t in c.placements:
                        per[t.name][key] = full[t.offset : t.end].view(t.shape).to("cpu", copy=True)
                    del full
                else:
                    for t in c.placements:
                        per[t.name][key] = value.clone() if isinstance(value, torch.Tensor) else value
            for name, s in per.items():
                if s:
                    state[name] = s
        return {"state": state, "param_groups": [{**self.hyperparameters(), "params": list(self._names)}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's optimizer format: keyed by parameter name (as :meth:`state_dict` writes) or by
        integer index (a plain torch optimizer over the trainable parameters in ``module.parameters()``
        order). Every rank passes the same full state dict.

        Raises:
            CheckpointError: malformed dict, unknown/missing parameters, or groups with differing
                hyper-parameters (per-parameter groups cannot be represented).
            ShapeMismatchError: a state tensor's shape differs from its parameter's.
        """
        try:
            groups = state_dict["param_groups"]
            saved_state = state_dict["state"]
        except (KeyError, TypeError):
            raise CheckpointError("optimizer state dict needs 'state' and 'param_groups'") from None
        ids = [pid for g in groups for pid in g["params"]]
        if all(isinstance(i, str) for i in ids):
            key_to_name = {i: i for i in ids}
            unknown = [i for i in ids if i not in self.model.layout]
            if unknown:
                raise CheckpointError(f"optimizer state names parameters this model does not have: {unknown}")
            key_to_name = {i: self.model.layout.tensor(i).name for i in ids}
        else:
            if len(ids) != len(self._names):
                raise CheckpointError(
                    f"optimizer state has {len(ids)} parameters, the model has {len(self._names)} trainable ones")
            key_to_name = dict(zip(ids, self._names))
        missing = [n for n in self._names if n not in set(key_to_name.values())]
        if missing:
            raise CheckpointError(f"optimizer state lacks parameters: {missing}")
        hypers = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        if any(h != hypers[0] for h in hypers[1:]):
            raise CheckpointError("optimizer state has param groups with different hyper-parameters; "
                                  "ZeroOptimizer keeps one group")
        by_name = {key_to_name[k]: v for k, v in saved_state.items() if k in key_to_name}
        for c in self._chunks:
            shard: dict[str, Any] = {}
            keys: list[str] = []
            for t in c.placements:
                for k in by_name.get(t.name, {}):
                    if k not in keys:
                        keys.append(k)
            for key in keys:
                fulls, scalar = {}, None
                for t in c.placements:
                    v = by_name.get(t.name, {}).get(key)
                    if v is None:
                        continue
                    if key != "step" and isinstance(v, torch.Tensor) and (v.dim() > 0 or t.numel == 1):
                        if tuple(v.shape) != t.shape:
                            raise ShapeMismatchError(f"optimizer state {t.name}.{key}", t.shape, tuple(v.shape))
                        fulls[t.name] = v
                    elif scalar is None:
                        scalar = v
                if fulls:
                    shard[key] = c.shard_from_full(fulls)
                elif scalar is not None:
                    shard[key] = scalar
            if shard:
                self.load_shard_state(c.index, shard)
        for k, v in hypers[0].items():
            self.optimizer.param_groups[0][k] = v
