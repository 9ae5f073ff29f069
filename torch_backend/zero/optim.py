"""``ZeroOptimizer``: a ``torch.optim.Optimizer`` on fp32 master shards, with param groups, dynamic loss
scaling and global-norm clipping (ColossalAI Gemini's ``ZeroOptimizer``; mixed-precision training after
Micikevicius et al. 2018, "Mixed Precision Training"; the hysteresis scaler is Megatron-LM's).

The inner optimizer (any elementwise torch optimizer: AdamW, Adam, SGD with momentum …) steps one
fp32 parameter per tensor piece this rank owns (:mod:`.optim_pieces`: views into the chunk's master
shard), placed in its tensor's param group (:mod:`.optim_groups`). The ZeroOptimizer *is* a torch
optimizer: its ``param_groups`` and ``state`` are the inner optimizer's own objects, so LR schedulers,
step hooks and ``state_dict`` work as with any torch optimizer. ``step()``:

1. sums the squared gradient norms of all chunks over valid elements (keep-gathered chunks counted
   once, on rank 0) and all-reduces them: one collective gives the global norm and the overflow flag
   (an inf/nan anywhere makes the sum non-finite on every rank);
2. on overflow skips the update (parameters and optimizer state untouched), drops the gradients
   and backs the loss scale off per hysteresis; the ``max_skipped_at_min_scale``-th skip in a row at
   the minimum scale raises :class:`~chunkzero.errors.LossScaleError` (no progress is possible);
3. else unscales by the scale *the backward used* (recorded by :meth:`ZeroOptimizer.backward`) and
   clips like ``torch.nn.utils.clip_grad_norm_`` on the unsharded model, gives each piece of a tensor
   that received a gradient its gradient (the others keep ``grad=None`` and are skipped, as torch
   skips them: no weight decay, no moment update), runs the inner optimizer, refreshes the
   low-precision shards from the masters, and only then updates the scale.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from chunkzero.errors import CheckpointError, ConfigError, LossScaleError

from . import collectives, optim_state_dict
from .ddp import ZeroDDP
from .loss_scale import DynamicLossScaler
from .optim_groups import group_specs, resolve_params, torch_params_specs
from .optim_pieces import PieceStates, build_pieces

__all__ = ["DynamicLossScaler", "ZeroOptimizer"]

NOT_ELEMENTWISE = ("Adafactor", "LBFGS", "Muon", "SparseAdam")
"""torch optimizers whose update depends on a whole tensor's shape (or needs closures / sparse
gradients): wrong on flat shards, so refused."""


def _refuse(what: str):
    def method(*args, **kwargs):
        raise ConfigError(f"ZeroOptimizer.optimizer.{what}() would act on this rank's flat shard pieces; "
                          f"call ZeroOptimizer.{what}() instead")
    return method


class ZeroOptimizer(torch.optim.Optimizer):
    """Mixed-precision optimizer over a :class:`ZeroDDP` model's fp32 master shards (a torch optimizer).

    Args:
        model: the wrapped model.
        optimizer_class: an elementwise ``torch.optim.Optimizer`` class (AdamW, Adam, SGD …), or a
            factory called as ``optimizer_class(groups, **defaults)`` that must use the groups it is given.
        param_groups: ``[{"params": [...], "lr": ..., "weight_decay": ...}, ...]``; ``params`` holds
            parameters of ``model.module`` (objects or ``named_parameters()`` pairs) or their names (any
            alias). Trainable parameters not listed form a default group, last. Each group's
            hyper-parameters are honoured exactly; keys the optimizer does not know are refused.
        params: torch's ``Optimizer(params)`` argument instead of ``param_groups``: an iterable of
            parameters (``model.parameters()``, ``model.module.parameters()``, names) or of group dicts;
            it must list every trainable parameter (frozen ones in it are skipped, as torch never steps
            them); one list of parameters is one group. :func:`~torch_backend.zero.optim_groups.torch_params_specs`.
        max_norm: clip gradients to this global L2 norm (unscaled), like ``clip_grad_norm_``.
        initial_scale, growth_interval, hysteresis, min_scale: dynamic loss scaling, used in fp16
            only (bf16/fp32 use scale 1 and still skip non-finite steps).
        max_skipped_at_min_scale: after this many steps in a row skipped for non-finite gradients
            at the minimum loss scale, ``step()`` raises :class:`~chunkzero.errors.LossScaleError`
            (the scale cannot fall further, so training cannot make progress; DeepSpeed's
            ``raise_error_at_min_scale`` with a patience). bf16/fp32 run at scale 1, their minimum, so
            there it counts every skipped step. ``None`` never raises. The count restarts at an
            applied step and is not checkpointed.
        **defaults: the optimizer's defaults (``lr``, ``betas``, ``weight_decay`` …), for every group.
            Adam and AdamW use torch's fused kernel unless ``fused`` or ``foreach`` is given (on the CPU,
            where offloaded chunks step, it is about 6× torch's default one: benchmarks/bench_cpu_adam.py).

    ``param_groups`` (the live list of group dicts LR schedulers change), ``state``, ``defaults``,
    ``zero_grad(set_to_none)``, ``state_dict()`` / ``load_state_dict()`` (torch's format, full-shaped,
    keyed by parameter name), ``add_param_group``, step and state-dict hooks behave as torch's.
    ``step()`` returns whether the update was applied (``False``: skipped on overflow); closures are
    refused.

    Shard-level API (for checkpoints): :meth:`shard_state`, :meth:`load_shard_state`,
    :meth:`tensor_steps`, :meth:`load_tensor_steps`, :meth:`loss_scaler_state`,
    :meth:`load_loss_scaler_state`, :meth:`hyperparameters`, :attr:`group_names`, :attr:`step_count`.

    Raises:
        ConfigError: ``model`` is not a ZeroDDP; ``max_norm`` is not positive; bad scaler settings;
            a bad param group (unknown, frozen, foreign or twice-listed parameter, unknown key); a
            non-elementwise optimizer; a factory that builds groups of its own; ``params`` and
            ``param_groups`` both given, or ``params`` that leaves out a trainable parameter.
    """

    def __init__(self, model: ZeroDDP, optimizer_class=torch.optim.AdamW, params=None, *, param_groups=None,
                 max_norm: float | None = None, initial_scale: float = 2.0**16, growth_interval: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0, max_skipped_at_min_scale: int | None = 10, **defaults):
        if not isinstance(model, ZeroDDP):
            raise ConfigError(f"ZeroOptimizer needs a ZeroDDP model, got {type(model).__name__}")
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ConfigError(f"max_norm must be a positive number or None, got {max_norm!r}")
        if max_skipped_at_min_scale is not None and (isinstance(max_skipped_at_min_scale, bool) or not isinstance(
                max_skipped_at_min_scale, int) or max_skipped_at_min_scale < 1):
            raise ConfigError(
                f"max_skipped_at_min_scale must be a positive int (steps) or None, got {max_skipped_at_min_scale!r}"
            )
        if getattr(optimizer_class, "__name__", "") in NOT_ELEMENTWISE:
            raise ConfigError(
                f"{optimizer_class.__name__} is not elementwise (its update depends on whole tensors); "
                "ZeroOptimizer steps flat shards of tensors: use an elementwise optimizer (AdamW, Adam, SGD …)"
            )
        self.model = model
        self.max_norm = None if max_norm is None else float(max_norm)
        self._chunks = [c for c in model.chunks if c.requires_grad]
        self._world_size = model.world_size
        self._counts_norm = model.sharding_groups.replica_index == 0
        if not self._chunks:
            raise ConfigError("the model has no trainable parameters")
        if params is not None and param_groups is not None:
            raise ConfigError("give params= (torch's meaning: every trainable parameter) or param_groups= "
                              "(unlisted parameters form a default group), not both")
        specs = group_specs(model, param_groups) if params is None else torch_params_specs(model, params)
        self._pieces = build_pieces(model)
        self._piece_of = {p.name: p for pieces in self._pieces.values() for p in pieces}
        self.group_names: list[list[str]] = [list(s.names) for s in specs]
        """Per param group: the primary names of its tensors (the same on every rank)."""
        self._default_group = next((i for i, s in enumerate(specs) if s.is_default), None)
        groups = [{"params": self._params_of(s.names), **s.options} for s in specs]
        inner = self._build_inner(optimizer_class, groups, defaults)
        self.optimizer: torch.optim.Optimizer = inner
        """The inner torch optimizer over this rank's pieces (shares ``param_groups`` and ``state``)."""
        # torch's Optimizer set-up (hooks, step patching) on a placeholder, then the inner's groups and state
        self._constructing = True
        try:
            torch.optim.Optimizer.__init__(self, [torch.zeros(0)], dict(inner.defaults))
        finally:
            self._constructing = False
        self._states = PieceStates(model, inner.state, inner.param_groups, self._pieces)
        inner.state = self._states.state  # (Note [adopt what was written] in optim_pieces.py)
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults
        self._tensor_index = {t.name: i for i, t in enumerate(model.layout.tensors)}
        self._trainable = torch.zeros(len(model.layout.tensors), dtype=torch.bool)
        self._trainable[[self._tensor_index[n] for g in self.group_names for n in g]] = True
        self._master_ptrs = {
            ci: (model.chunks[ci].master.data_ptr(), model.chunks[ci].master.device) for ci in self._pieces
        }
        if model.auto_placement is not None:
            model.auto_placement.attach_optimizer(self)
        self.fp16 = model.mixed_precision == "fp16"
        self.scaler = DynamicLossScaler(
            initial_scale if self.fp16 else 1.0,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min(min_scale, initial_scale) if self.fp16 else 1.0,
        )
        self.step_count = 0
        """Applied (non-skipped) steps."""
        self.skipped_steps = 0
        self.max_skipped_at_min_scale = max_skipped_at_min_scale
        self.skipped_in_row_at_min_scale = 0
        """Steps skipped in a row at the minimum loss scale, up to now (see ``max_skipped_at_min_scale``)."""
        self.last_grad_norm: float | None = None
        """Global unscaled gradient L2 norm before clipping, from the last ``step()`` (``inf``/``nan`` on overflow)."""
        self._grad_scale = 1.0
        """The loss scale the gradients now accumulated were computed with (set by :meth:`backward`)."""
        self._kept_grads = torch.zeros(len(model.layout.tensors), dtype=torch.bool)
        """Tensors whose gradient ``zero_grad(set_to_none=False)`` zeroed instead of dropping (stepped with zeros)."""
        self._passes_seen = model.backward_passes
        self._passes_scaled = 0
        self.ema = None
        """The :class:`~torch_backend.zero.ema.ZeroEMA` of this optimizer's masters, once one is built
        (checkpoints and :meth:`memory_report` include it)."""

    def attach_ema(self, ema) -> None:
        """Make ``ema`` (a :class:`~torch_backend.zero.ema.ZeroEMA` building itself) this optimizer's
        :attr:`ema`.

        Raises:
            ConfigError: the optimizer has an EMA already.
        """
        if self.ema is not None:
            raise ConfigError("this ZeroOptimizer has an EMA already (optimizer.ema); build one ZeroEMA per optimizer")
        self.ema = ema

    def detach_ema(self, ema) -> None:
        """Forget ``ema`` if it is this optimizer's :attr:`ema` (``ZeroEMA.close``)."""
        if self.ema is ema:
            self.ema = None

    def _params_of(self, names: list[str]) -> list[torch.nn.Parameter]:
        return [self._piece_of[n].param for n in names if n in self._piece_of]

    def _build_inner(self, optimizer_class, groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
        if optimizer_class in (torch.optim.Adam, torch.optim.AdamW) and not {"fused", "foreach"} & set(defaults):
            defaults = {**defaults, "fused": True}
        try:
            inner = optimizer_class(groups, **defaults)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"{getattr(optimizer_class, '__name__', optimizer_class)}(param groups, **{defaults}) failed: {e}"
            ) from None
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigError(f"optimizer_class must build a torch.optim.Optimizer, got {type(inner).__name__}")
        if len(inner.param_groups) != len(groups) or any(
            g is not mine
            or len(g["params"]) != len(mine_params)
            or any(a is not b for a, b in zip(g["params"], mine_params))
            for g, mine, mine_params in zip(inner.param_groups, groups, [list(g["params"]) for g in groups])
        ):
            raise ConfigError(
                f"{getattr(optimizer_class, '__name__', optimizer_class)} built param groups of its own instead of "
                "the ones "
                "it was given: ZeroOptimizer must place every parameter (its shard pieces) itself; pass the groups as "
                "ZeroOptimizer(model, torch.optim.AdamW, param_groups=[...], lr=...)"
            )
        self._check_group_keys(inner.param_groups, inner.defaults)
        for what in ("add_param_group", "state_dict", "load_state_dict"):
            setattr(inner, what, _refuse(what))
        return inner

    @staticmethod
    def _check_group_keys(groups: list[dict], defaults: dict, first: int = 0) -> None:
        known = set(defaults) | {"params", "param_names"}
        for i, g in enumerate(groups[first:], first):
            unknown = sorted(set(g) - known)
            if unknown:
                raise ConfigError(f"param group {i}: {', '.join(map(repr, unknown))} is not a hyper-parameter of the "
                                  f"optimizer (it knows {', '.join(sorted(defaults))})")

    # ------------------------------------------------------------------ torch.optim.Optimizer
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Move parameters of the default group (the ones ``param_groups=`` did not list) into a new
        group with its own hyper-parameters (every rank, the same call).

        Raises:
            ConfigError: a parameter is not in the default group (it already has a group of its own),
                or as the constructor's ``param_groups``.
        """
        if getattr(self, "_constructing", False):
            return torch.optim.Optimizer.add_param_group(self, param_group)
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise ConfigError("add_param_group needs a dict with a 'params' entry")
        names = resolve_params(self.model, param_group["params"], f"param group {len(self.param_groups)}")
        default = set() if self._default_group is None else set(self.group_names[self._default_group])
        for n in names:
            if n not in default:
                owner = next(i for i, g in enumerate(self.group_names) if n in g)
                raise ConfigError(f"parameter {n!r} already belongs to param group {owner}; add_param_group only takes "
                                  "parameters of the default group (those param_groups= did not list)")
        if len(set(names)) != len(names):
            raise ConfigError("add_param_group lists a parameter twice")
        group = {**{k: v for k, v in param_group.items() if k != "params"}, "params": self._params_of(names)}
        self._check_group_keys([group], self.defaults)
        if names:  # (names are all in the default group, checked above)
            moved, listed = {id(p) for p in group["params"]}, set(names)
            dg = self.param_groups[self._default_group]
            dg["params"] = [p for p in dg["params"] if id(p) not in moved]
            self.group_names[self._default_group] = [
                n for n in self.group_names[self._default_group] if n not in listed
            ]
        type(self.optimizer).add_param_group(self.optimizer, group)
        self.group_names.append(names)
        for ci in self._pieces:
            self._states.attach(ci)  # a fused/capturable group keeps its steps elsewhere

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        return self.scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * loss_scale).backward()``; records the scale so ``step`` unscales by it."""
        scale = self.scaler.scale if self.fp16 else 1.0
        self._grad_scale = scale
        before = self.model.backward_passes
        try:
            self.model.backward(loss * scale if scale != 1.0 else loss)
        finally:
            self._passes_scaled += self.model.backward_passes - before
        self.model.raise_pending_error()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (the model's buffers and the fp32 gradient shards).

        ``set_to_none=False`` keeps torch's meaning: a parameter that had a gradient keeps a zero one, so
        the next step updates it even if it then receives none (weight decay, moments).
        """
        if set_to_none:
            self._kept_grads.zero_()
        else:
            self._kept_grads |= self.model.grad_received
        self._drop_gradients()

    def _drop_gradients(self) -> None:
        self.model.zero_grad()
        self._grad_scale = 1.0
        self._passes_seen = self.model.backward_passes
        self._passes_scaled = 0

    def _check_scaled_backwards(self) -> None:
        unscaled = self.model.backward_passes - self._passes_seen - self._passes_scaled
        if self.fp16 and unscaled > 0:
            self._drop_gradients()
            raise ConfigError(
                f"{unscaled} backward pass(es) through the model ran without ZeroOptimizer.backward: in fp16 the loss "
                "must be scaled, so call optim.backward(loss) instead of loss.backward() (the gradients were dropped)")

    def _global_sq_norm(self) -> float:
        device = self.model.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        if self._counts_norm:  # hybrid sharding: only replica 0 counts (the replicas hold the same shards)
            first_rank = self.model.rank == 0
            for c in self._chunks:
                sq = c.gradient.sq_norm
                if sq is not None and (first_rank or not c.keep_gathered):  # a full gradient: counted once
                    total = total + sq.to(device)
        if self._world_size > 1:
            collectives.all_reduce_sum(total, self.model.process_group)
        return float(total.item())

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Clip, unscale, update the master shards, refresh the low-precision shards (collective).

        Returns:
            ``True`` if the update was applied, ``False`` if it was skipped (overflow).

        Raises:
            ConfigError: a closure was passed; in fp16, a backward ran without :meth:`backward`.
            UnusedParameterError: the last backward left a parameter without a gradient.
            LossScaleError: this skip is the ``max_skipped_at_min_scale``-th in a row at the minimum
                loss scale (the step is skipped, the gradients dropped, as for any skip).
        """
        if closure is not None:
            raise ConfigError("ZeroOptimizer.step does not take a closure: run optim.backward(loss), then optim.step()")
        self._check_scaled_backwards()
        self.model.raise_pending_error()
        self.model.finish_gradients()
        sq = self._global_sq_norm()
        scale = float(self._grad_scale)
        if not math.isfinite(sq):
            self.last_grad_norm = sq
            self.skipped_steps += 1
            self._drop_gradients()
            self.scaler.update(True)
            self._count_skip_at_min_scale(scale)
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
        active = (self.model.grad_received | self._kept_grads) & self._trainable
        flags = active.tolist()
        for ci, ps in self._pieces.items():
            master = self.model.chunks[ci].master
            if self._master_ptrs[ci] != (master.data_ptr(), master.device):  # the master was replaced (or moved)
                self._master_ptrs[ci] = (master.data_ptr(), master.device)
                for p in ps:
                    p.follow_master()
                self._states.follow_master(ci)
            g = master.grad
            for p in ps:  # each piece's view of the reduced shard (zeros where the chunk received none)
                if not flags[p.tensor_index]:
                    p.param.grad = None
                elif g is None:
                    p.param.grad = torch.zeros_like(p.param)
                else:
                    p.param.grad = g[p.offset : p.end]
        try:
            self.optimizer.step()
        finally:
            for ps in self._pieces.values():
                for p in ps:
                    p.param.grad = None
        self._states.steps[active] += 1
        if self._states.stale.value:
            self._states.adopt()
        for c in self._chunks:
            c.refresh_from_master()
        self.step_count += 1
        self.skipped_in_row_at_min_scale = 0
        if self.fp16:
            self.scaler.update(False)
        return True

    def _count_skip_at_min_scale(self, scale: float) -> None:
        """Count a skipped step whose backward ran at ``scale``; raise when the skips in a row at the
        minimum scale reach ``max_skipped_at_min_scale``."""
        self.skipped_in_row_at_min_scale = self.skipped_in_row_at_min_scale + 1 if scale <= self.scaler.min_scale else 0
        n, limit = self.skipped_in_row_at_min_scale, self.max_skipped_at_min_scale
        if limit is None or n < limit:
            return
        step = self.step_count + self.skipped_steps
        raise LossScaleError(
            f"step {step}: {n} steps in a row were skipped for non-finite gradients (inf/nan) at the minimum loss "
            f"scale "
            f"{scale:g}, so training cannot make progress; lower the learning rate or look for inf/nan in the data "
            f"and the model",
            step=step,
            scale=scale,
            skipped=n,
        )

    # ------------------------------------------------------------------ shard-level state
    def _chunk(self, chunk: int):
        c = self.model.chunks[chunk]
        if not c.requires_grad:
            raise ConfigError(f"chunk {chunk} holds frozen parameters and has no optimizer state")
        return c

    def shard_state(self, chunk: int) -> dict[str, torch.Tensor]:
        """This rank's optimizer state of ``chunk``: the live flat buffers behind its pieces' state.

        Per-element states (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer`` …) are 1-D tensors of
        ``layout.shard_numel(chunk)`` elements aligned with :meth:`ZeroDDP.master_shard` (zeros where
        a tensor has no state, and in the padding); ``step`` is a 0-d float32 tensor, the largest of
        the chunk's tensors' (see :meth:`tensor_steps`). Empty before the first step.

        Raises:
            ConfigError: ``chunk`` is frozen.
        """
        self._chunk(chunk)
        return self._states.shard_state(chunk)

    def load_shard_state(self, chunk: int, state: dict[str, torch.Tensor | float]) -> None:
        """Set this rank's optimizer state of ``chunk`` (the reverse of :meth:`shard_state`): 1-D states
        into its flat buffers (fp32, master device), ``step`` for every tensor of the chunk (without
        one: :attr:`step_count`, at least 1). Follow with :meth:`load_tensor_steps` for tensors whose
        step differs.

        Raises:
            ConfigError: ``chunk`` is frozen.
            ShapeMismatchError: a 1-D state is not ``shard_numel`` long.
        """
        self._chunk(chunk)
        self._states.load_shard_state(chunk, state, max(self.step_count, 1))

    def tensor_steps(self) -> dict[str, int]:
        """Per trainable tensor (primary name): the updates applied to it — torch's per-parameter
        ``step``; 0 for a tensor that never had a gradient (no state). The same on every rank."""
        steps = self._states.steps
        return {n: int(steps[self._tensor_index[n]]) for g in self.group_names for n in g}

    def load_tensor_steps(self, steps: dict[str, int]) -> None:
        """Set the step of the tensors named in ``steps`` (any alias); 0 drops a tensor's state.

        Raises:
            CheckpointError: a name is not a trainable tensor of the model.
        """
        layout = self.model.layout
        for name, value in steps.items():
            if name not in layout or not layout.tensor(name).requires_grad:
                raise CheckpointError(
                    f"optimizer step recorded for {name!r}, which is not a trainable tensor of the model"
                )
            self._states.steps[self._tensor_index[layout.tensor(name).name]] = int(value)
        for ci in self._pieces:
            self._states.attach(ci)

    def loss_scaler_state(self) -> dict[str, Any]:
        """The loss scaler's state (plain Python numbers) plus ``step_count``/``skipped_steps``."""
        return {**self.scaler.state_dict(), "step_count": self.step_count, "skipped_steps": self.skipped_steps}

    def load_loss_scaler_state(self, state: dict[str, Any]) -> None:
        """The reverse of :meth:`loss_scaler_state` (fields not given keep their values).

        Raises:
            CheckpointError: a field the scaler does not have.
        """
        state = dict(state)
        self.step_count = int(state.pop("step_count", self.step_count))
        self.skipped_steps = int(state.pop("skipped_steps", self.skipped_steps))
        self.scaler.load_state_dict(state)

    def hyperparameters(self) -> dict[str, Any]:
        """The first param group's hyper-parameters (``lr``, ``betas`` …, without ``params``) and
        ``max_norm`` (``None``: no clipping); every group's are in ``param_groups``."""
        return {**{k: v for k, v in self.param_groups[0].items() if k not in ("params", "param_names")},
                "max_norm": self.max_norm}

    @property
    def piece_states(self) -> PieceStates:
        """The flat per-chunk state buffers behind the inner optimizer's state, one entry per trainable
        chunk (:class:`~torch_backend.zero.optim_pieces.PieceStates`: ``flat``, ``steps``, ``pieces``,
        ``chunks``); the torch-format state dict reads and writes through it."""
        return self._states

    def state_bytes_per_element(self) -> int | None:
        """Bytes of optimizer state kept per master element (8 for Adam's two fp32 moments), ``None``
        before the first step has created any (``placement="auto"`` sizes its plan with it)."""
        return self._states.bytes_per_element()

    def state_bytes(self) -> list[tuple[torch.device, int]]:
        """``(device, bytes)`` of each optimizer state tensor this rank holds (exp_avg, exp_avg_sq …)."""
        return self._states.state_bytes()

    def memory_report(self):
        """The model's :meth:`ZeroDDP.memory_report` with this optimizer's state shards counted (and its
        EMA's shards, as ``ema``, when it has one)."""
        return self.model.memory_report(self)

    # ------------------------------------------------------------------ full state dict
    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer format keyed by parameter name, with full shapes (collective).

        ``{"state": {name: {"step": 0-d, "exp_avg": full-shaped fp32 CPU tensor, ...}},
        "param_groups": [{hyper-parameters..., "params": [names]}, ...]}`` — one entry per group with
        its hyper-parameters; the names are the primary names of the group's tensors in the group's
        order (the order ``param_groups=`` gave, the default group's in ``module.parameters()``
        order), so a torch optimizer over the same groups of the unwrapped module loads it. A tensor
        without state (no gradient yet) has no entry. Chunks are gathered one at a time. State-dict
        pre/post hooks run as in torch.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        out = optim_state_dict.full_state_dict(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's optimizer format: keyed by parameter name (any alias; as :meth:`state_dict`
        writes) or by integer id (a torch optimizer over the same groups of the unwrapped module).
        Restores every group's hyper-parameters (not kernel flags such as ``foreach``), in place, and
        each tensor's state and step. Every rank passes the same full state dict. Load hooks run as
        in torch.

        Raises:
            CheckpointError: malformed dict, another number of groups, a group of other parameters,
                or names this model does not have.
            ShapeMismatchError: a state tensor's shape differs from its parameter's.
        """
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        optim_state_dict.load_full_state_dict(self, state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
