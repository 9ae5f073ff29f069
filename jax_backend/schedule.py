"""The sharded training step over gather units: explicit gathers, per-unit gradient reductions.

A :class:`GatherUnit` is what is gathered together and reduced together — a chunk for ZeRO-3
(:class:`jax_backend.zero.ChunkUnit`), a parameter for FSDP, a gradient bucket for DDP
(:mod:`jax_backend.baselines`). :class:`ShardedTrainer` runs one training step over any set of units
as one ``jax.jit`` of one ``jax.shard_map`` over the data axis. Inside, per device
(:func:`run_schedule`):

- **forward**, stage by stage (:mod:`jax_backend.blocks`): before the first stage that reads a
  tensor of unit ``u``, ``u`` is **gathered** (:meth:`GatherUnit.gather`; an unsharded unit is already
  whole); after the last stage that reads it, the gathered value is **released** (nothing refers to
  it any more). Only stage-boundary activations are kept.
- **backward**, stages in reverse: each stage is recomputed and differentiated with ``jax.vjp``
  (rematerialization per stage), gathering ``u`` again before the first stage (in backward order)
  that reads it — so a gathered unit is never kept alive from forward to backward. Gradients of
  ``u``'s tensors accumulate until the last stage that reads ``u``, then are **reduced** to the
  device's local gradient (:meth:`GatherUnit.reduce`). With ``remat=False`` a stage is not recomputed:
  its forward kept the outputs of its matrix products with weights (not attention's batched products)
  and its backward, less its gathered tensors, which backward gathers again (:func:`_stage_vjp`).
- ``optax`` (AdamW) updates the fp32 **master** values locally (elementwise, so sharded = unsharded);
  with ``mixed_precision="bf16"`` the bf16 parameters used for the gathers are refreshed from them.

Each gather is made data-dependent on the activation (forward) or cotangent (backward) it waits for
(:func:`_after`), so XLA neither hoists gathers to the start of the program nor merges a backward
gather with the forward one — the ``prevent_cse`` of ``jax.checkpoint``, done in a way XLA:CPU keeps.
A unit read by non-adjacent stages (the tied token embedding, read by the embedding and by the output
head) stays gathered in between, and its gradients stay allocated between its two uses in backward.

:func:`reference_train` is the unsharded reference the trainers are tested against.

Shapes: batches are ``{"idx": int32[B, T], "targets": int32[B, T]}`` with ``B`` divisible by ``W``
(sharded ``P('shard')`` on ``B``); the step returns the new state and ``f32[W]`` whose sum is the mean
token cross-entropy of the global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkzero.errors import ConfigError, LayoutError

from .blocks import Batch, Program
from .mesh import DEFAULT_AXIS, mesh_world_size

COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
"""``mixed_precision`` -> dtype of parameters, activations and gradients (the master stays fp32)."""


# ================================================================================================ units
class GatherUnit:
    """What is gathered together and reduced together: a chunk (ZeRO-3), a parameter (FSDP), a
    gradient bucket (DDP).

    A unit owns ``tensors`` (torch names). Outside the step it is one global pytree (``abstract``:
    ``ShapeDtypeStruct`` leaves, ``spec``: their ``PartitionSpec`` over the data axis); inside
    ``shard_map`` each device sees its local part, turns it into full tensors with :meth:`gather`
    and turns full-tensor gradients into its local gradient with :meth:`reduce`.

    Attributes:
        key: the unit's key in the state (``"chunk_0003"``, a tensor name, ``"bucket_000"``).
        tensors: names of the tensors it holds.
        trainable: whether it gets gradients and optimizer state.
        sharded: its local part differs per device (else every device holds it whole).
    """

    key: str
    tensors: tuple[str, ...]
    trainable: bool = True
    sharded: bool = True

    def spec(self, axis: str) -> Any:
        """``PartitionSpec`` pytree of the unit's global value over the data axis ``axis``."""
        raise NotImplementedError

    def abstract(self, dtype) -> Any:
        raise NotImplementedError

    def pack(self, full: Mapping[str, Any], dtype) -> Any:
        """The unit's global value (numpy) from full-shaped tensors."""
        raise NotImplementedError

    def unpack(self, value: Any) -> dict[str, np.ndarray]:
        """Full-shaped tensors (numpy) from the unit's global value."""
        raise NotImplementedError

    def gather(self, local: Any, axis: str) -> dict[str, jax.Array]:
        raise NotImplementedError

    def reduce(self, grads: Mapping[str, jax.Array], axis: str) -> Any:
        raise NotImplementedError


# ================================================================================================ schedule
def _unit_uses(program: Program, unit_of: Mapping[str, str]) -> list[list[str]]:
    uses = []
    for s in program.stages:
        keys: list[str] = []
        for n in s.tensors:
            k = unit_of[n]
            if k not in keys:
                keys.append(k)
        uses.append(keys)
    return uses


def _after(x: Any, dep: jax.Array) -> Any:
    """``x`` unchanged in value but computed from ``dep``: ``x + 0·dep[0]`` (every leaf).

    The data dependency orders a gather after the activation (forward) or cotangent (backward) it
    waits for, and makes a backward gather a different computation from the forward one, so XLA can
    neither hoist it nor merge it with the forward gather (common-subexpression elimination), which
    would keep the gathered chunk alive from forward to backward. ``jax.lax.optimization_barrier``
    is not enough on every backend: XLA:CPU expands barriers before CSE. XLA does not fold ``0·y`` for
    floating ``y`` (NaN semantics), so the dependency survives; it costs one add per element of
    ``x`` (a shard, or a stage input).
    """
    zero = (jnp.ravel(dep)[0] * 0).astype(jnp.float32)
    return jax.tree.map(lambda a: a + zero.astype(a.dtype), x)


def run_schedule(program: Program, units: Mapping[str, GatherUnit], unit_of: Mapping[str, str],
                 local: Mapping[str, Any], batch: Batch, seed: jax.Array, axis: str, *, remat: bool = True
                 ) -> tuple[jax.Array, dict[str, Any]]:
    """Forward and backward of ``program`` on one device inside ``shard_map`` (see the module docstring).

    Args:
        units: gather units by key; ``unit_of``: tensor name -> unit key.
        local: each unit's local value (parameter dtype = compute dtype).
        batch: the device's micro-batch.
        seed: cotangent of the last stage's output (``1 / global tokens`` for a mean loss).
        remat: recompute each stage in backward from its input (only stage inputs kept). ``False``: keep
            the outputs of each stage's matrix products with weights from forward (:func:`_stage_vjp`), so
            backward recomputes only elementwise work and attention's batched products: most of one
            forward's matrix products less, more activation memory. Gathered units are released after
            forward and gathered again in backward either way.

    Returns:
        ``(loss_sum, grads)``: the local loss sum and each trainable unit's reduced local gradient.
    """
    stages = program.stages
    uses = _unit_uses(program, unit_of)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, keys in enumerate(uses):
        for k in keys:
            first.setdefault(k, i)
            last[k] = i

    def tensors_of(i: int, gathered: Mapping[str, dict]) -> dict[str, jax.Array]:
        return {n: gathered[unit_of[n]][n] for n in stages[i].tensors}

    # ---- forward: gather at first use, release after last use, keep stage inputs only
    gathered: dict[str, dict] = {}
    inputs: list[Any] = []
    saved: dict[int, Callable] = {}  # remat=False: each stage's vjp, its gathered tensors left out
    h = None
    for i, s in enumerate(stages):
        need = [k for k in uses[i] if k not in gathered]
        for k in need:
            gathered[k] = units[k].gather(local[k] if h is None or not units[k].sharded else _after(local[k], h), axis)
        inputs.append(h)
        if remat:
            h = s.fn(tensors_of(i, gathered), h, batch)
        else:
            h, saved[i] = _stage_vjp(s, tensors_of(i, gathered), units, unit_of, h, batch)
        for k in uses[i]:
            if last[k] == i:
                del gathered[k]
    loss_sum = h

    # ---- backward: recompute each stage under jax.vjp, gather at first (backward) use, reduce after last
    g = seed.astype(loss_sum.dtype) + loss_sum * 0  # data-dependent: orders the head's backward gathers after the loss
    acc: dict[str, dict[str, jax.Array]] = {}
    out: dict[str, Any] = {}
    for i in reversed(range(len(stages))):
        s = stages[i]
        need = [k for k in uses[i] if k not in gathered]
        h_in = None if inputs[i] is None or not remat else _after(inputs[i], g)
        for k in need:
            gathered[k] = units[k].gather(_after(local[k], g) if units[k].sharded else local[k], axis)
        t = tensors_of(i, gathered)
        train = {n: v for n, v in t.items() if units[unit_of[n]].trainable}
        frozen = {n: v for n, v in t.items() if n not in train}
        if not remat:
            cotangents = saved.pop(i)(t, g)
            gt, g = cotangents if inputs[i] is not None else (cotangents[0], None)
        elif h_in is None:
            _, vjp = jax.vjp(lambda tt: s.fn({**tt, **frozen}, None, batch), train)  # noqa: B023 - traced at once by jax.vjp
            (gt,) = vjp(g)
            g = None
        else:
            _, vjp = jax.vjp(lambda tt, hh: s.fn({**tt, **frozen}, hh, batch), train, h_in)  # noqa: B023 - traced at once by jax.vjp
            gt, g = vjp(g)
        for n, gn in gt.items():
            d = acc.setdefault(unit_of[n], {})
            d[n] = d[n] + gn if n in d else gn
        for k in uses[i]:
            if first[k] == i:
                del gathered[k]
                if units[k].trainable:
                    out[k] = units[k].reduce(acc.pop(k), axis)
    return loss_sum, out


def _stage_vjp(stage, tensors: Mapping[str, jax.Array], units: Mapping[str, GatherUnit], unit_of: Mapping[str, str],
               h: Any, batch: Batch) -> tuple[Any, Callable]:
    """Stage ``stage``'s output and its backward, without keeping its gathered tensors: ``(out, backward)``
    with ``backward(tensors, g)`` the cotangents ``(trainable tensors', input's)`` (``(trainable tensors',)``
    for the first stage), ``tensors`` gathered again.

    The stage runs under ``jax.checkpoint`` with
    :func:`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`: its ``jax.vjp`` keeps the outputs of
    the matrix products without batch dimensions (the projections, the MLP; attention's ``q kᵀ`` and its
    product with ``v``, batched over sequences and heads, are cheap to recompute and as large as the
    rest) and, as the checkpoint's inputs, the gathered tensors themselves; those are taken out of the
    vjp's residuals by identity here and put back from the backward's gather, so every value derived from
    a tensor is recomputed from the new gather and no gathered unit stays alive from forward to backward.
    The kept residuals enter the backward through :func:`_after` the cotangent: without it XLA merges the
    backward's recompute (the GELU, the normalizations) with the forward's and keeps its elementwise
    intermediates alive from forward to backward (the default job's step: 130 MiB of temp memory instead
    of 91)."""
    train = {n: v for n, v in tensors.items() if units[unit_of[n]].trainable}
    frozen = {n: v for n, v in tensors.items() if n not in train}
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if h is None:
        out, vjp = jax.vjp(jax.checkpoint(lambda tt, ff: stage.fn({**tt, **ff}, None, batch), policy=policy),
                           train, frozen)
    else:
        out, vjp = jax.vjp(jax.checkpoint(lambda tt, ff, hh: stage.fn({**tt, **ff}, hh, batch), policy=policy),
                           train, frozen, h)
    leaves, treedef = jax.tree_util.tree_flatten(vjp)
    by_id = {id(v): n for n, v in tensors.items()}
    holes = {j: by_id[id(leaf)] for j, leaf in enumerate(leaves) if id(leaf) in by_id}
    kept = [None if j in holes else leaf for j, leaf in enumerate(leaves)]
    del leaves, vjp

    def backward(gathered: Mapping[str, jax.Array], g):
        fn = jax.tree_util.tree_unflatten(treedef, [gathered[holes[j]] if j in holes else _after_float(leaf, g)
                                                    for j, leaf in enumerate(kept)])
        cot = fn(g)
        return (cot[0],) if h is None else (cot[0], cot[2])

    return out, backward


def _after_float(x: Any, dep: jax.Array) -> Any:
    """:func:`_after` for a floating-point array, anything else unchanged."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
        return _after(x, dep)
    return x


# ================================================================================================ trainer
class TrainState(NamedTuple):
    """The sharded training state.

    Attributes:
        master: ``{unit_key: value}`` fp32 master values of every unit (frozen units in float32 too).
        params: ``{unit_key: value}`` in the compute dtype for ``mixed_precision="bf16"``; ``None`` in
            fp32 (the master is the parameter).
        opt_state: the optax state over the trainable units' master values.
    """

    master: dict[str, Any]
    params: dict[str, Any] | None
    opt_state: Any


def _check_names(program: Program, unit_of: Mapping[str, str], what: str) -> None:
    used = set()
    for s in program.stages:
        for n in s.tensors:
            if n not in unit_of:
                raise LayoutError(f"stage {s.name!r} reads {n!r}, which the {what} does not hold")
            used.add(n)
    unused = [n for n in unit_of if n not in used]
    if unused:
        raise LayoutError(f"tensor {unused[0]!r} of the {what} is read by no stage of {program.name!r}")


class ShardedTrainer:
    """A jitted ``shard_map`` training step over ``units`` (the base of ZeRO-3, FSDP and DDP).

    Args:
        program: the model as stages.
        units: gather units (every tensor of the program in exactly one).
        mesh: a mesh with the data axis ``axis``.
        tx: an optax transformation applied locally to the master values (elementwise ones — AdamW,
            Adam, SGD — give the unsharded update).
        mixed_precision: ``"fp32"`` or ``"bf16"`` (bf16 parameters, activations, gradients and
            collectives; fp32 masters and optimizer state).
        max_norm: clip the global gradient L2 norm to it (one scalar all-reduce), as
            :class:`torch_backend.ZeroOptimizer`'s ``max_norm``; ``None`` (default) does not clip.
        grad_norm: also return the global gradient L2 norm before clipping (torch's
            ``ZeroOptimizer.last_grad_norm``) from :attr:`step_fn`, as its third output (one scalar
            all-reduce, shared with clipping's). Default ``False``: ``step_fn`` returns two outputs.
        donate: donate the state to the step (its buffers are reused for the new state).
        skip_nonfinite: skip the update of a step whose global gradient norm is not finite (inf/nan): the
            state stays as it was (Adam's step count included), as :class:`torch_backend.ZeroOptimizer`
            skips it, except a learning-rate schedule's count, which advances as a torch LR scheduler
            steps on a skipped step (:func:`skip_unless_finite`). Default ``False``: the update is applied
            whatever the gradients.
        remat: recompute each stage in backward (default; only stage inputs kept, the least activation
            memory), or, ``False``, keep the outputs of the stages' matrix products with weights from
            forward and skip most of that recompute (:func:`run_schedule`), as torch's ZeroDDP without
            activation checkpointing.
        replica_axis: a second mesh axis the state is replicated over (hybrid sharding,
            :class:`jax_backend.hybrid.HybridZeroTrainer`): the batch is split over
            ``(replica_axis, axis)``, replica-major, and the units' ``reduce`` must also reduce across
            it. ``None`` (default): one data axis.

    Raises:
        ConfigError: an unknown precision or a mesh without ``axis`` (or ``replica_axis``).
        LayoutError: a tensor read by a stage is in no unit, or a unit's tensor is read by none.
    """

    name = "sharded"

    def __init__(self, program: Program, units: Sequence[GatherUnit], mesh: Mesh, tx: optax.GradientTransformation,
                 *, mixed_precision: str = "fp32", max_norm: float | None = None, axis: str = DEFAULT_AXIS,
                 donate: bool = True, replica_axis: str | None = None, grad_norm: bool = False,
                 skip_nonfinite: bool = False, remat: bool = True):
        if mixed_precision not in COMPUTE_DTYPES:
            raise ConfigError(f"mixed_precision must be one of {sorted(COMPUTE_DTYPES)}, got {mixed_precision!r}")
        if max_norm is not None and not max_norm > 0:
            raise ConfigError(f"max_norm must be positive or None, got {max_norm!r}")
        self.program, self.mesh, self.tx, self.axis = program, mesh, tx, axis
        self.replica_axis = replica_axis
        self.replicas = 1 if replica_axis is None else mesh_world_size(mesh, replica_axis)
        self.world_size = mesh_world_size(mesh, axis) * self.replicas
        """Data-parallel devices: the batch is split over all of them."""
        self.batch_axis = axis if replica_axis is None else (replica_axis, axis)
        self.mixed_precision = mixed_precision
        self.compute_dtype = COMPUTE_DTYPES[mixed_precision]
        self.max_norm = max_norm
        self.grad_norm = bool(grad_norm)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.remat = bool(remat)
        self.units: dict[str, GatherUnit] = {u.key: u for u in units}
        self.unit_of: dict[str, str] = {n: u.key for u in units for n in u.tensors}
        _check_names(program, self.unit_of, f"{self.name} units")
        self.trainable = [k for k, u in self.units.items() if u.trainable]
        self._step = jax.jit(self._build(), donate_argnums=(0,) if donate else ())

    # ------------------------------------------------------------------ specs and abstract values
    @property
    def low_precision(self) -> bool:
        return self.compute_dtype != jnp.float32

    def _unit_specs(self) -> dict[str, Any]:
        return {k: u.spec(self.axis) for k, u in self.units.items()}

    def _abstract_master(self) -> dict[str, Any]:
        return {k: u.abstract(jnp.float32) for k, u in self.units.items()}

    def state_specs(self) -> TrainState:
        """``PartitionSpec`` pytree of the :class:`TrainState`."""
        specs = self._unit_specs()
        master_tr = {k: self._abstract_master()[k] for k in self.trainable}
        abstract_opt = jax.eval_shape(self.tx.init, master_tr)
        opt_specs = optax.tree_utils.tree_map_params(
            self.tx, lambda _, spec: spec, abstract_opt, {k: specs[k] for k in self.trainable},
            transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P),
        )
        return TrainState(specs, specs if self.low_precision else None, opt_specs)

    def state_shardings(self) -> TrainState:
        """``NamedSharding`` pytree of the :class:`TrainState`."""
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.state_specs(), is_leaf=lambda x: isinstance(x, P)
        )

    def abstract_state(self) -> TrainState:
        """``ShapeDtypeStruct`` (global shapes, with shardings) of the state: lower and compile the step
        without any array (:meth:`lower`)."""
        master = self._abstract_master()
        params = {k: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, self.compute_dtype), v)
                  for k, v in master.items()} if self.low_precision else None
        opt = jax.eval_shape(self.tx.init, {k: master[k] for k in self.trainable})
        shapes = TrainState(master, params, opt)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.state_shardings()
        )

    def abstract_batch(self, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        """``ShapeDtypeStruct`` of a global batch ``int32[batch_size, seq_len]``, sharded on the batch.

        Raises:
            ConfigError: ``batch_size`` not divisible by the world size.
        """
        self._check_batch_size(batch_size)
        s = NamedSharding(self.mesh, P(self.batch_axis))
        return {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=s) for k in ("idx", "targets")}

    def _check_batch_size(self, batch_size: int) -> None:
        if batch_size % self.world_size:
            raise ConfigError(f"batch size {batch_size} is not divisible by the world size {self.world_size}")

    # ------------------------------------------------------------------ state
    def init(self, params: Mapping[str, Any], opt_state: Any = None) -> TrainState:
        """The sharded state from full-shaped, torch-named parameters (numpy or jax arrays).

        Args:
            params: ``{name: array}`` for every tensor of the units (a tied tensor under its primary name).
            opt_state: optax state to start from (default ``tx.init``).

        Raises:
            LayoutError: a tensor is missing.
        """
        for n in self.unit_of:
            if n not in params:
                raise LayoutError(f"params: no tensor {n!r}")
        full = {n: np.asarray(jax.device_get(v)) for n, v in params.items()}
        master = {k: u.pack(full, jnp.float32) for k, u in self.units.items()}
        return self.state_from_master(master, opt_state)

    def state_from_master(self, master: Mapping[str, Any], opt_state: Any = None) -> TrainState:
        """The state from the units' global fp32 values (e.g. restored chunk arrays), placed on the mesh."""
        sh = self.state_shardings()
        master = {k: jax.tree.map(lambda v, s: jax.device_put(jnp.asarray(v, jnp.float32), s), master[k], sh.master[k])
                  for k in self.units}
        params = None
        if self.low_precision:
            params = jax.jit(lambda m: jax.tree.map(lambda x: x.astype(self.compute_dtype), m),
                             out_shardings=sh.params)(master)
        tr = {k: master[k] for k in self.trainable}
        if opt_state is None:
            opt_state = jax.jit(self.tx.init, out_shardings=sh.opt_state)(tr)
        else:
            opt_state = jax.device_put(opt_state, sh.opt_state)
        return TrainState(master, params, opt_state)

    def full_params(self, state: TrainState) -> dict[str, np.ndarray]:
        """Full-shaped fp32 master tensors (numpy), by torch name, in unit order."""
        out: dict[str, np.ndarray] = {}
        for k, u in self.units.items():
            out.update(u.unpack(state.master[k]))
        return out

    def shard_batch(self, batch: Batch) -> dict[str, jax.Array]:
        """Place a global batch on the mesh, ``P(axis)`` on the batch dimension (int32).

        Raises:
            ConfigError: a bad batch, or its size not divisible by the world size.
        """
        self.program.check_batch(batch)
        self._check_batch_size(np.shape(batch["idx"])[0])
        s = NamedSharding(self.mesh, P(self.batch_axis))
        return {k: jax.device_put(jnp.asarray(batch[k], jnp.int32), s) for k in ("idx", "targets")}

    # ------------------------------------------------------------------ step
    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
        """One training step on a global batch: ``(new_state, loss)`` with ``loss`` the mean token
        cross-entropy before the update (a scalar array). The state is donated (do not reuse it).

        Raises:
            ConfigError: a bad batch.
        """
        new_state, losses, *_ = self._step(state, self.shard_batch(batch))
        return new_state, jnp.sum(losses)

    @property
    def step_fn(self) -> Callable:
        """The jitted ``(state, sharded_batch) -> (state, f32[W] loss parts)``; with ``grad_norm=True``
        ``(state, f32[W] loss parts, f32[] gradient norm before clipping)`` (replicated)."""
        return self._step

    def lower(self, batch_size: int, seq_len: int) -> jax.stages.Lowered:
        """The step lowered for abstract inputs (no arrays): ``.compile()`` gives
        ``memory_analysis()`` and ``as_text()`` without running it."""
        return self._step.lower(self.abstract_state(), self.abstract_batch(batch_size, seq_len))

    def _build(self) -> Callable:
        program, units, unit_of, axis, batch_axis = self.program, self.units, self.unit_of, self.axis, self.batch_axis
        world, tx, max_norm, with_norm, skip = (
            self.world_size,
            self.tx,
            self.max_norm,
            self.grad_norm,
            self.skip_nonfinite,
        )
        low, dtype, trainable, remat = self.low_precision, self.compute_dtype, self.trainable, self.remat

        def local_step(state: TrainState, batch):
            n_tokens = batch["targets"].size * world
            compute = state.params if low else state.master
            loss_sum, grads = run_schedule(program, units, unit_of, compute, batch,
                                           jnp.asarray(1.0 / n_tokens, jnp.float32), axis, remat=remat)
            grads = {k: jax.tree.map(lambda g: g.astype(jnp.float32), grads[k]) for k in trainable}
            norm = None
            if max_norm is not None or with_norm or skip:
                sq_sharded = sum((jnp.sum(jnp.square(x)) for k in trainable if units[k].sharded
                                  for x in jax.tree.leaves(grads[k])), jnp.zeros((), jnp.float32))
                sq_whole = sum((jnp.sum(jnp.square(x)) for k in trainable if not units[k].sharded
                                for x in jax.tree.leaves(grads[k])), jnp.zeros((), jnp.float32))
                norm = jnp.sqrt(jax.lax.psum(sq_sharded, axis) + sq_whole)
            if max_norm is not None:
                factor = jnp.minimum(1.0, max_norm / (norm + 1e-6))
                grads = jax.tree.map(lambda g: g * factor, grads)
            master_tr = {k: state.master[k] for k in trainable}
            updates, opt_state = tx.update(grads, state.opt_state, master_tr)
            master = {**state.master, **optax.apply_updates(master_tr, updates)}
            params = jax.tree.map(lambda m: m.astype(dtype), master) if low else None
            new = TrainState(master, params, opt_state)
            if skip:  # the norm is the same on every device (all-reduced), so all skip alike
                new = skip_unless_finite(jnp.isfinite(norm), new, state)
            loss = (loss_sum / n_tokens).reshape(1)
            return (new, loss) + ((norm,) if with_norm else ())

        specs = self.state_specs()
        batch_specs = {"idx": P(batch_axis), "targets": P(batch_axis)}
        out_specs = (specs, P(batch_axis)) + ((P(),) if with_norm else ())
        return jax.shard_map(local_step, mesh=self.mesh, in_specs=(specs, batch_specs), out_specs=out_specs,
                             check_vma=False)


def skip_unless_finite(finite: jax.Array, new: TrainState, old: TrainState) -> TrainState:
    """``new`` where ``finite`` (a bool scalar), else ``old`` — except the count of each learning-rate schedule
    in the optimizer state (optax's ``ScaleByScheduleState``), which is ``new``'s either way: a skipped step
    keeps the weights and Adam's moments and step count, and the schedule moves on to the next step's
    learning rate, as ``torch.optim.lr_scheduler`` does when its optimizer skipped a step."""
    keep = lambda n, o: jnp.where(finite, n, o)  # noqa: E731
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    opt_state = jax.tree.map(lambda n, o: n if is_schedule(n) else jax.tree.map(keep, n, o), new.opt_state,
                             old.opt_state, is_leaf=is_schedule)
    return TrainState(jax.tree.map(keep, new.master, old.master), jax.tree.map(keep, new.params, old.params),
                      opt_state)


def reference_train(program: Program, params: Mapping[str, Any], batches: Sequence[Batch],
                    tx: optax.GradientTransformation, *, loss_fn: Callable | None = None,
                    max_norm: float | None = None, opt_state: Any = None) -> tuple[dict[str, np.ndarray], list[float]]:
    """Unsharded reference: ``len(batches)`` steps of ``jax.grad`` + ``tx`` on one device with full
    parameters. ``loss_fn(params, batch)`` defaults to ``program.loss``. Clipping as
    :class:`ShardedTrainer`. Returns ``(params, losses)`` (numpy)."""
    loss_fn = loss_fn or program.loss
    dev = jax.devices()[0]
    params = {n: jax.device_put(jnp.asarray(v, jnp.float32), dev) for n, v in params.items()}
    if opt_state is None:
        opt_state = tx.init(params)

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        if max_norm is not None:
            norm = optax.tree.norm(g)
            g = jax.tree.map(lambda x: x * jnp.minimum(1.0, max_norm / (norm + 1e-6)), g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    losses = []
    for b in batches:
        b = {k: jax.device_put(jnp.asarray(v, jnp.int32), dev) for k, v in b.items()}
        params, opt_state, loss = step(params, opt_state, b)
        losses.append(float(loss))
    return {n: np.asarray(v) for n, v in params.items()}, losses


__all__ = ["COMPUTE_DTYPES", "GatherUnit", "ShardedTrainer", "TrainState", "reference_train", "run_schedule",
           "skip_unless_finite"]
