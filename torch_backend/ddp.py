"""``ZeroDDP``: chunk-based ZeRO-3 data parallelism for any ``nn.Module``.

The method is ColossalAI Gemini's ``ZeroDDP`` (itself PatrickStar's chunk manager, Fang et al. 2021,
on top of ZeRO stage 3, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models"): parameters are packed into flat chunks in parameter order (the core
:class:`chunkzero.ChunkLayout`), each chunk is sharded over the ranks, gathered before the
computation that needs it and released afterwards; gradients land in per-chunk buffers and each
chunk is reduce-scattered as soon as all its gradients are final.

Storage: each parameter's ``.data`` is, for the model's lifetime, a view into its chunk's buffer
(compute dtype, full shape). Releasing a chunk resizes the buffer's storage to zero bytes and
gathering resizes it back and all-gathers into it (FSDP2's trick), so shapes never change and views
taken in forward (``weight.t()`` saved by ``F.linear``) see the re-gathered data in backward.

How parameters are found when they are used (the part that makes *any* module work):

- **Forward**: while the wrapped module runs, a ``TorchFunctionMode`` sees every torch call. When an
  argument is a managed parameter its chunk is gathered (if needed), the tensor moves to COMPUTE for
  the call and back to HOLD after it. So a parameter used by another module (``F.linear(x,
  other.weight)``), through an operator (``x @ w``), inside ``torch.stack([...])`` or several times
  is always gathered; so is a chunk whose released buffer an argument views. A chunk is released
  (with ``reshard_after_forward``) once every tensor of it has been used in this forward; whatever
  is still gathered is released when the forward returns.
- **Backward**: ``saved_tensors_hooks`` replace a saved parameter (or a saved view of a chunk
  buffer) by a reference; unpacking it in backward gathers the chunk again. A post-accumulate-grad
  hook moves each parameter's final gradient into the chunk's gradient buffer (it fires once per
  backward, after every use of the parameter has contributed). When all tensors of a chunk are
  READY_FOR_REDUCE the chunk is reduced and released. A callback queued on the autograd engine
  finishes the backward: unused parameters (error, or zero gradients with
  ``find_unused_parameters``), releases and state reset.

The tensor-state bookkeeping uses the core :class:`chunkzero.ChunkStates` (FREE, COMPUTE, HOLD,
HOLD_AFTER_BWD, READY_FOR_REDUCE).

Limitations: the module's parameters hold data only inside ``forward`` and backward (outside, reading
them raises "data is not allocated" — use :meth:`ZeroDDP.state_dict`); the set of parameters used in a step must be
the same on every rank (collectives are issued in use order); activation checkpointing that
recomputes the forward outside ``ZeroDDP.forward`` is not supported; buffers are replicated as-is.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from chunkzero import ChunkLayout, TensorSpec, TensorState
from chunkzero.errors import CheckpointError, ConfigError, ShapeMismatchError, UnusedParameterError

from . import collectives
from .chunks import TORCH_DTYPES, Chunk

S = TensorState

__all__ = ["MemoryReport", "ZeroDDP", "default_chunk_size"]

_MIXED_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Tensor attributes and methods that read only metadata (right on a released parameter): no gather.
_METADATA_ONLY = frozenset({
    "dtype", "device", "requires_grad", "is_cuda", "is_leaf", "grad_fn", "layout", "is_sparse", "shape", "size",
    "dim", "ndim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "is_contiguous", "names", "is_meta", "is_quantized", "itemsize", "nbytes",
})


def _func_name(func) -> str | None:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return name


def _storage_key(t) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None

MEMORY_KINDS = ("parameters", "gathered_buffers", "gradients", "fp32_master", "optimizer_states")


def default_chunk_size(specs: list[TensorSpec], world_size: int) -> tuple[int, int]:
    """``(chunk size, keep_gathered_below_numel)`` in elements used when ``ZeroDDP(chunk_size=None)``.

    Uses the core search (``chunkzero.search.search_chunk_size``) when it is available, else
    ``(max(largest tensor numel, 2**20), 0)``.
    """
    try:
        from chunkzero.search import search_chunk_size
    except ImportError:
        return max(max((s.numel for s in specs), default=1), 1 << 20), 0
    result = search_chunk_size(specs, world_size)
    return int(result.chunk_size), int(getattr(result, "keep_gathered_below_numel", 0) or 0)


def _offload_count(frac: float, n: int) -> int:
    """Number of chunks (first in chunk order) a fraction ``frac`` of ``n`` chunks offloads: ``ceil``."""
    return min(n, math.ceil(frac * n - 1e-9)) if frac > 0 else 0


class _Entry:
    """A managed parameter: its object, primary name, chunk and placement."""

    __slots__ = ("param", "name", "chunk", "placement")

    def __init__(self, param, name, chunk, placement):
        self.param, self.name, self.chunk, self.placement = param, name, chunk, placement


class _SavedParam:
    """What autograd stores instead of a managed parameter saved for backward."""

    __slots__ = ("entry",)

    def __init__(self, entry):
        self.entry = entry


class _SavedView:
    """A saved tensor that is a view of a sharded chunk's buffer (e.g. ``weight.t()`` inside
    ``F.linear``): unpacking it gathers the chunk first."""

    __slots__ = ("chunk", "tensor")

    def __init__(self, chunk, tensor):
        self.chunk, self.tensor = chunk, tensor


class _ParamAccessMode(TorchFunctionMode):
    """Gathers a parameter's chunk around every torch call that takes the parameter."""

    def __init__(self, ddp: ZeroDDP):
        super().__init__()
        self.ddp = ddp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        ddp = self.ddp
        lookup = ddp._entries_by_id
        by_storage = ddp._chunk_by_storage
        found = None
        views = None
        for a in (*args, *kwargs.values()):
            for b in a if type(a) in (list, tuple) else (a,):
                e = lookup.get(id(b))
                if e is not None and e.param is b:
                    found = [e] if found is None else found + [e]
                elif by_storage and isinstance(b, torch.Tensor):
                    c = by_storage.get(_storage_key(b))
                    if c is not None and not c.is_gathered:
                        views = [c] if views is None else views + [c]
        if found is None and views is None:
            return func(*args, **kwargs)
        if _func_name(func) in _METADATA_ONLY:
            return func(*args, **kwargs)
        for c in views or ():
            c.gather()  # a view of a released chunk (e.g. ``w.t()`` taken earlier in this forward)
        if found is None:
            return func(*args, **kwargs)
        return ddp._run_op(found, func, args, kwargs)


@dataclass
class MemoryReport:
    """Bytes this rank holds, per device and kind, plus the offload decisions.

    Attributes:
        bytes: ``{device: {kind: bytes}}`` with kinds ``parameters`` (persistent compute-dtype parameter
            shards — the fp32 master itself in fp32 — keep-gathered chunks whole), ``gathered_buffers``
            (gathered sharded chunks now),
            ``gradients`` (chunk gradient buffers and fp32 gradient shards), ``fp32_master``
            (master shards held apart from the parameter shard: 0 in fp32, where they coincide),
            ``optimizer_states`` (the ZeroOptimizer's state shards).
        offload_optim_chunks: chunk indices whose master, gradient and optimizer state are on CPU.
        offload_param_chunks: chunk indices whose parameter shard is on CPU.
    """

    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    offload_optim_chunks: tuple[int, ...] = ()
    offload_param_chunks: tuple[int, ...] = ()

    def total(self, kind: str | None = None) -> int:
        """Bytes of ``kind`` over all devices (all kinds when ``None``)."""
        return sum(b for per in self.bytes.values() for k, b in per.items() if kind is None or k == kind)

    def model_state_bytes(self) -> int:
        """Parameters + gradients + fp32 master + optimizer states (gathered buffers excluded)."""
        return self.total() - self.total("gathered_buffers")

    def __str__(self) -> str:
        lines = ["| device | " + " | ".join(MEMORY_KINDS) + " |", "|---" * (len(MEMORY_KINDS) + 1) + "|"]
        for dev, per in self.bytes.items():
            lines.append(f"| {dev} | " + " | ".join(str(per.get(k, 0)) for k in MEMORY_KINDS) + " |")
        lines.append(f"offloaded optimizer chunks: {list(self.offload_optim_chunks)}; parameter chunks: {list(self.offload_param_chunks)}")
        return "\n".join(lines)


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class ZeroDDP(nn.Module):
    """Wrap ``module`` for chunk-based ZeRO-3 data parallelism (ColossalAI Gemini's ``ZeroDDP``).

    Args:
        module: any ``nn.Module`` whose floating-point parameters all sit on one device (CUDA → NCCL
            group expected, CPU → gloo). Its parameter objects are kept (tied weights stay tied); their
            ``.data`` becomes a view into the chunk's buffer (the compute dtype, full shape), which holds
            data only while the chunk is gathered — inside ``forward``/backward; read values outside
            with :meth:`state_dict`.
            Every rank must pass the same architecture; initial values are taken from group rank 0.
        process_group: the data-parallel group; ``None`` → the default group if ``torch.distributed``
            is initialized, else a single process.
        chunk_size: chunk capacity in elements; ``None`` → :func:`default_chunk_size` (the core search).
        mixed_precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` — dtype of chunks, compute and gradient
            reduction; the optimizer always updates fp32 master shards. Floating inputs are cast to it.
        reshard_after_forward: release sharded chunks after their use in forward (ZeRO-3); ``False``
            keeps them gathered from forward until the backward reduces them (fewer gathers, more memory).
        find_unused_parameters: reduce a zero gradient for parameters that got none, instead of raising.
        offload_optim_frac: fraction of trainable chunks (first in chunk order, rounded up) whose fp32
            master, gradient and optimizer state live on CPU.
        offload_param_frac: fraction of sharded chunks whose low-precision parameter shard lives on CPU.
        keep_gathered: parameters to pack into keep-gathered (never sharded, all-reduced) chunks: an
            iterable of names (any alias matches) or a predicate ``name -> bool``.

    Shard-level API (for checkpoints): :attr:`layout`, :attr:`rank`, :attr:`world_size`,
    :attr:`process_group`, :attr:`chunks`, :meth:`master_shard`, :meth:`low_precision_shard`,
    :meth:`grad_shard`, :meth:`load_master_shard`.

    Raises:
        ConfigError: a bad argument, a module without trainable floating parameters, parameters
            on several devices, or a non-floating parameter.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group=None,
        chunk_size: int | None = None,
        mixed_precision: str = "fp32",
        reshard_after_forward: bool = True,
        find_unused_parameters: bool = False,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        keep_gathered: Iterable[str] | Callable[[str], bool] | None = None,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"module must be an nn.Module, got {type(module).__name__}")
        if mixed_precision not in _MIXED_PRECISION:
            raise ConfigError(f"mixed_precision must be one of {sorted(_MIXED_PRECISION)}, got {mixed_precision!r}")
        for name, frac in (("offload_optim_frac", offload_optim_frac), ("offload_param_frac", offload_param_frac)):
            if not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
                raise ConfigError(f"{name} must be a number in [0, 1], got {frac!r}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
            raise ConfigError(f"chunk_size must be a positive int (elements) or None, got {chunk_size!r}")

        self.module = module
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        """The data-parallel process group (``None``: single process)."""
        self.world_size: int = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank: int = dist.get_rank(process_group) if process_group is not None else 0
        self.mixed_precision = mixed_precision
        self.compute_dtype: torch.dtype = TORCH_DTYPES[_MIXED_PRECISION[mixed_precision]]
        self.reshard_after_forward = bool(reshard_after_forward)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.offload_optim_frac = float(offload_optim_frac)
        self.offload_param_frac = float(offload_param_frac)

        # ---- parameters, deduplicated by identity, in registration order
        groups: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), (p, []))[1].append(name)
        if not groups:
            raise ConfigError(f"{type(module).__name__} has no parameters to shard")
        devices = {p.device for p, _ in groups.values()}
        if len(devices) != 1:
            raise ConfigError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
        self.device: torch.device = devices.pop()
        for p, names in groups.values():
            if not p.is_floating_point():
                raise ConfigError(f"parameter {names[0]!r} has dtype {p.dtype}; only floating parameters can be sharded")
        is_kg = self._keep_gathered_predicate(keep_gathered)
        dtype_name = _MIXED_PRECISION[mixed_precision]
        specs = [
            TensorSpec(
                names[0], tuple(p.shape), dtype_name, tuple(names[1:]), bool(p.requires_grad), any(is_kg(n) for n in names)
            )
            for p, names in groups.values()
        ]
        keep_below = 0
        if chunk_size is None:
            chunk_size, keep_below = default_chunk_size(specs, self.world_size)
        self.layout: ChunkLayout = ChunkLayout.build(specs, chunk_size, self.world_size, keep_gathered_below_numel=keep_below)
        """The core layout (tensors → chunks → shards); identical on every rank."""

        # ---- placement (offload) decisions
        trainable = [c.index for c in self.layout.chunks if c.requires_grad]
        sharded = [c.index for c in self.layout.chunks if not c.keep_gathered]
        self.offload_optim_chunks: tuple[int, ...] = tuple(trainable[: _offload_count(self.offload_optim_frac, len(trainable))])
        self.offload_param_chunks: tuple[int, ...] = tuple(sharded[: _offload_count(self.offload_param_frac, len(sharded))])
        cpu = torch.device("cpu")

        # ---- build the chunks (one full chunk in memory at a time)
        by_name = {names[0]: p for p, names in groups.values()}
        self.chunks: list[Chunk] = []
        """One :class:`~torch_backend.chunks.Chunk` per layout chunk, by index."""
        self._entries_by_id: dict[int, _Entry] = {}
        self._entries: dict[str, _Entry] = {}
        self._chunk_by_storage: dict[int, Chunk] = {}
        divide_first = mixed_precision == "fp16"
        for info in self.layout.chunks:
            placements = self.layout.chunk_tensors(info.index)
            initial = torch.zeros(info.size, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                for t in placements:
                    initial[t.offset : t.end].copy_(by_name[t.name].detach().reshape(-1))
            collectives.broadcast_from_first(initial, process_group)
            chunk = Chunk(
                self.layout,
                info.index,
                self.rank,
                {t.name: by_name[t.name] for t in placements},
                device=self.device,
                param_device=cpu if info.index in self.offload_param_chunks else self.device,
                master_device=cpu if info.index in self.offload_optim_chunks else self.device,
                group=process_group,
                divide_first=divide_first,
                initial=initial,
            )
            del initial
            self.chunks.append(chunk)
            for t in placements:
                e = _Entry(by_name[t.name], t.name, chunk, t)
                self._entries[t.name] = e
                self._entries_by_id[id(e.param)] = e
            if not chunk.resident:
                self._chunk_by_storage[chunk.storage_key] = chunk

        # ---- hooks
        self._hook_handles = []
        for e in self._entries.values():
            if e.param.requires_grad:
                self._hook_handles.append(e.param.register_post_accumulate_grad_hook(self._make_post_grad_hook(e)))

        self._sync = True
        self._release_in_forward = True
        self._fwd_used: dict[int, set[str]] = {}
        self._bwd_grads: set[str] = set()
        self._finalize_queued = False

    # ================================================================== construction helpers
    @staticmethod
    def _keep_gathered_predicate(keep_gathered) -> Callable[[str], bool]:
        if keep_gathered is None:
            return lambda name: False
        if callable(keep_gathered):
            return lambda name: bool(keep_gathered(name))
        if isinstance(keep_gathered, str):
            keep_gathered = [keep_gathered]
        try:
            names = set(keep_gathered)
        except TypeError:
            raise ConfigError(f"keep_gathered must be names or a predicate, got {type(keep_gathered).__name__}") from None
        return lambda name: name in names

    # ================================================================== forward
    def forward(self, *args, **kwargs):
        """Run the wrapped module with chunks gathered on use (see the module docstring).

        Floating-point tensor inputs are cast to the compute dtype in bf16/fp16.
        """
        if self.compute_dtype != torch.float32:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        grad_enabled = torch.is_grad_enabled()
        self._release_in_forward = self.reshard_after_forward or not grad_enabled
        self._fwd_used = {}
        try:
            with _ParamAccessMode(self):
                if grad_enabled:
                    with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                        return self.module(*args, **kwargs)
                return self.module(*args, **kwargs)
        finally:
            self._fwd_used = {}
            for c in self.chunks:
                self._rest(c, release=self._release_in_forward)

    def _cast_input(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == torch.float32:
            return x.to(self.compute_dtype)
        return x

    def _run_op(self, entries: list[_Entry], func, args, kwargs):
        if len(entries) > 1:
            entries = list({id(e): e for e in entries}.values())
        for e in entries:
            c = e.chunk
            if not c.is_gathered:
                c.gather()
            c.states.transition(e.name, S.COMPUTE)
        try:
            return func(*args, **kwargs)
        finally:
            for e in entries:
                c = e.chunk
                c.states.transition(e.name, S.HOLD)
                used = self._fwd_used.setdefault(c.index, set())
                used.add(e.name)
                if (
                    self._release_in_forward
                    and not c.keep_gathered
                    and len(used) == c.states.num_tensors
                    and c.states.can_release
                ):
                    c.release()

    # ================================================================== backward
    def _pack(self, t):
        e = self._entries_by_id.get(id(t))
        if e is not None and e.param is t:
            return _SavedParam(e)
        if self._chunk_by_storage:
            c = self._chunk_by_storage.get(_storage_key(t))
            if c is not None:
                return _SavedView(c, t)
        return t

    def _unpack(self, x):
        if type(x) is _SavedParam:
            e = x.entry
            self._queue_finalize()
            c = e.chunk
            if not c.is_gathered:
                c.gather()
            if c.states.state(e.name) is not S.READY_FOR_REDUCE:
                c.states.transition(e.name, S.COMPUTE)
            return e.param
        if type(x) is _SavedView:
            self._queue_finalize()
            if not x.chunk.is_gathered:
                x.chunk.gather()
            return x.tensor
        return x

    def _queue_finalize(self) -> None:
        if not self._finalize_queued:
            self._finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _make_post_grad_hook(self, e: _Entry):
        def hook(param):
            self._queue_finalize()
            c = e.chunk
            grad = param.grad
            param.grad = None
            c.add_grad(e.name, e.placement, grad)
            self._bwd_grads.add(e.name)
            state = c.states.state(e.name)
            if state is S.READY_FOR_REDUCE:
                return
            if state in (S.FREE, S.HOLD):
                c.states.transition(e.name, S.COMPUTE)
            if state is not S.HOLD_AFTER_BWD:
                c.states.transition(e.name, S.HOLD_AFTER_BWD)
            c.states.transition(e.name, S.READY_FOR_REDUCE)
            if c.states.can_reduce:
                if self._sync:
                    c.reduce()
                self._rest(c, release=True)

        return hook

    def _finalize_backward(self) -> None:
        """End of a backward pass: unused parameters, reduce leftovers, release, reset states."""
        self._finalize_queued = False
        unused: list[str] = []
        try:
            for c in self.chunks:
                if not c.requires_grad:
                    continue
                missing = [t for t in c.placements if t.name not in self._bwd_grads]
                if not missing:
                    continue
                if not self.find_unused_parameters:
                    unused.extend(t.name + (f" (alias {', '.join(t.aliases)})" if t.aliases else "") for t in missing)
                    continue
                for t in missing:
                    self._to_ready(c, t.name)
                if self._sync:
                    c.reduce()
        finally:
            self._bwd_grads = set()
            for c in self.chunks:
                self._rest(c, release=True)
        if unused:
            for c in self.chunks:
                c.discard_grad_buffer()
            raise UnusedParameterError(
                f"{len(unused)} parameter(s) received no gradient in this backward pass: {', '.join(unused)}. "
                "Make every parameter take part in the loss, freeze it (requires_grad=False) before wrapping, "
                "or pass find_unused_parameters=True to reduce a zero gradient for it."
            )

    @staticmethod
    def _to_ready(c: Chunk, name: str) -> None:
        state = c.states.state(name)
        if state is S.FREE:
            c.states.transition(name, S.HOLD)
            state = S.HOLD
        if state is S.COMPUTE:
            c.states.transition(name, S.HOLD_AFTER_BWD)
            state = S.HOLD_AFTER_BWD
        if state is not S.READY_FOR_REDUCE:
            c.states.transition(name, S.READY_FOR_REDUCE)

    @staticmethod
    def _rest(c: Chunk, *, release: bool) -> None:
        """Bring every tensor of ``c`` to its resting state (HOLD if gathered else FREE); maybe release."""
        target = S.HOLD if c.is_gathered else S.FREE
        for t in c.placements:
            state = c.states.state(t.name)
            if state is target:
                continue
            if state is S.HOLD_AFTER_BWD:
                c.states.transition(t.name, S.READY_FOR_REDUCE)
                state = S.READY_FOR_REDUCE
            if state is S.COMPUTE:
                c.states.transition(t.name, S.HOLD)
                state = S.HOLD
            if state is not target:
                c.states.transition(t.name, target)
        if release and not c.keep_gathered and c.is_gathered:
            c.release()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (full-chunk gradient buffers, compute dtype) without reducing.

        The first backward outside the context reduces everything accumulated so far.
        """
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all accumulated gradients (buffers and fp32 gradient shards)."""
        for c in self.chunks:
            c.zero_grad()

    # ================================================================== shard-level API
    def master_shard(self, chunk: int) -> torch.Tensor:
        """This rank's fp32 master shard of ``chunk``: the live 1-D tensor of ``layout.shard_numel(chunk)``
        elements (a keep-gathered chunk's whole size), padding included (zeros)."""
        return self.chunks[chunk].master.detach()

    def low_precision_shard(self, chunk: int) -> torch.Tensor:
        """This rank's compute-dtype shard of ``chunk`` (1-D, ``shard_numel``): the master itself in fp32;
        in bf16/fp16 the persistent low-precision shard, or a fresh cast of the master where none is
        kept (no offload: the gather casts the master, which saves 2 bytes per element)."""
        return self.chunks[chunk].low_precision_shard()

    def grad_shard(self, chunk: int) -> torch.Tensor | None:
        """This rank's reduced fp32 gradient shard of ``chunk`` (1-D, ``shard_numel``), or ``None``."""
        return self.chunks[chunk].master.grad

    def load_master_shard(self, chunk: int, shard: torch.Tensor) -> None:
        """Overwrite this rank's fp32 master shard of ``chunk`` and refresh the low-precision shard.

        Args:
            shard: 1-D, ``layout.shard_numel(chunk)`` elements, any floating dtype/device.

        Raises:
            ShapeMismatchError: ``shard`` is not of that shape.
        """
        c = self.chunks[chunk]
        if tuple(shard.shape) != (c.shard_numel,):
            raise ShapeMismatchError(f"chunk {chunk} master shard", (c.shard_numel,), tuple(shard.shape))
        c.load_master(shard)

    # ================================================================== state dict
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False) -> dict[str, torch.Tensor]:  # noqa: ARG002
        """The full torch state dict of the wrapped module, on every rank (collective).

        Parameters come from the fp32 master chunks (dtype float32, CPU, full shapes) under every
        alias name (tied names share one tensor); buffers are copied as they are (CPU). One chunk
        is gathered at a time. Keys are the wrapped module's (no ``module.`` prefix); with
        ``destination`` (a parent module's ``state_dict``) they are added to it under ``prefix``.
        """
        params: dict[str, torch.Tensor] = {}
        for c in self.chunks:
            full = c.gather_master()
            for t in c.placements:
                value = full[t.offset : t.end].view(t.shape).to("cpu", copy=True)
                for n in t.names:
                    params[n] = value
            del full
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, value in self.module.state_dict(keep_vars=True).items():
            if key in params:
                out[key] = params[key]
            elif isinstance(value, torch.Tensor):
                out[key] = value.detach().to("cpu", copy=True)
            else:
                out[key] = value
        if destination is not None:
            for k, v in out.items():
                destination[prefix + k] = v
            return destination
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):  # noqa: ARG002
        """Load a full-shaped torch state dict (every rank passes the same one).

        A tied tensor is loaded from the first of its names present; its other names are neither
        missing nor unexpected. Values may have any floating dtype and device.

        Returns:
            ``(missing_keys, unexpected_keys)`` like ``nn.Module.load_state_dict``.

        Raises:
            ShapeMismatchError: a tensor's shape differs (names the key and both shapes).
            CheckpointError: with ``strict``, any missing or unexpected key (all listed); nothing loaded.
        """
        module_sd = self.module.state_dict(keep_vars=True)
        buffer_keys = [k for k in module_sd if k not in self.layout]
        missing: list[str] = []
        chosen: dict[str, torch.Tensor] = {}
        for t in self.layout.tensors:
            present = [n for n in t.names if n in state_dict]
            if not present:
                missing.extend(t.names)
                continue
            for n in present:
                got = tuple(state_dict[n].shape)
                if got != t.shape:
                    raise ShapeMismatchError(n, t.shape, got)
            chosen[t.name] = state_dict[present[0]]
        named_buffers = dict(self.module.named_buffers())
        for k in buffer_keys:
            if k not in state_dict:
                missing.append(k)
            elif k in named_buffers and tuple(state_dict[k].shape) != tuple(named_buffers[k].shape):
                raise ShapeMismatchError(k, tuple(named_buffers[k].shape), tuple(state_dict[k].shape))
        known = set(self.layout.all_names) | set(buffer_keys)
        unexpected = [k for k in state_dict if k not in known]
        if strict and (missing or unexpected):
            raise CheckpointError(
                "Error(s) in loading state_dict for ZeroDDP: "
                + (f"missing keys: {missing}. " if missing else "")
                + (f"unexpected keys: {unexpected}." if unexpected else "")
            )
        for c in self.chunks:
            values = {t.name: chosen[t.name] for t in c.placements if t.name in chosen}
            if values:
                c.load_master(c.shard_from_full(values, base=c.master.detach()))
        with torch.no_grad():
            for k in buffer_keys:
                if k in state_dict and k in named_buffers:
                    named_buffers[k].copy_(state_dict[k])
        return _IncompatibleKeys(missing, unexpected)

    # ================================================================== memory
    def memory_report(self, optimizer=None) -> MemoryReport:
        """Bytes this rank holds now, per device and kind (see :class:`MemoryReport`), with the
        offload decisions.

        Args:
            optimizer: the :class:`~torch_backend.ZeroOptimizer` over this model, whose state shards
                are counted as ``optimizer_states`` (``None``: counted as 0). ``optim.memory_report()``
                passes itself.
        """
        report: dict[str, dict[str, int]] = {}

        def add(device, kind, n):
            per = report.setdefault(str(device), {k: 0 for k in MEMORY_KINDS})
            per[kind] += int(n)

        add(self.device, "parameters", 0)
        for c in self.chunks:
            for device, kind, n in c.bytes_by_kind():
                add(device, kind, n)
        if optimizer is not None:
            for device, n in optimizer.state_bytes():
                add(device, "optimizer_states", n)
        return MemoryReport(report, self.offload_optim_chunks, self.offload_param_chunks)

    def gathered_chunks(self) -> list[int]:
        """Indices of sharded chunks gathered right now (resident chunks — keep-gathered, or every
        chunk when the world size is 1 — are not listed)."""
        return [c.index for c in self.chunks if c.is_gathered and not c.resident]

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, rank={self.rank}, mixed_precision={self.mixed_precision!r}, "
            f"chunks={len(self.chunks)}, chunk_size={self.layout.chunk_size}"
        )
