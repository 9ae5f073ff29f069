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

- **Forward**: while the wrapped module runs, a ``TorchFunctionMode`` (:mod:`torch_backend.access`)
  sees every torch call. When an argument is a managed parameter its chunk is gathered (if needed),
  the tensor moves to COMPUTE for the call and back to HOLD after it. So a parameter used by
  another module (``F.linear(x, other.weight)``), through an operator (``x @ w``), inside
  ``torch.stack([...])`` or several times is always gathered. A chunk is released (with
  ``reshard_after_forward``) once every tensor of it has been used in this forward; whatever is
  still gathered is released when the forward returns.
- **Backward**: ``saved_tensors_hooks`` replace a saved parameter (or a saved view of a chunk
  buffer) by a reference that counts on its chunk; unpacking it gathers the chunk again, and once
  autograd has freed every reference to a chunk, the chunk is released — so a frozen chunk is
  gathered in backward only if a saved tensor needs it, and only for as long. A recomputation in
  backward (activation checkpointing) runs under the same mode, and keeps what it gathers until the
  chunk's gradients are final (frozen chunks: until the backward ends). A post-accumulate-grad hook
  moves each parameter's final gradient into the chunk's gradient buffer; when all tensors of a
  chunk are READY_FOR_REDUCE the chunk is reduced. A callback queued on the autograd engine (from a
  hook on the forward's outputs, so it belongs to the outermost backward) finishes the backward.

Which collective runs when is decided by :class:`torch_backend.schedule.Scheduler` in rounds that
every rank takes part in, so ranks that use different parameters (MoE routing) or use them in a
different order still issue the same collectives; with ``prefetch > 0`` the next chunks of the
recorded order are gathered ahead and collectives run asynchronously.

Errors found at the end of a backward (a parameter that received no gradient on any rank) are raised
by ``ZeroOptimizer.backward`` right after it, or else by the next ``forward`` or ``step`` — never from
inside the autograd engine, where an exception can abort the process (the CUDA engine threads).

The tensor-state bookkeeping uses the core :class:`chunkzero.ChunkStates` (FREE, COMPUTE, HOLD,
HOLD_AFTER_BWD, READY_FOR_REDUCE).

Limitations: the module's parameters hold data only inside ``forward`` and backward (outside, reading
them raises "data is not allocated" — use :meth:`ZeroDDP.state_dict`); buffers are replicated as-is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from chunkzero import ChunkLayout, ChunkPlacement, Location, TensorSpec, TensorState, static_placement
from chunkzero.errors import ConfigError, ShapeMismatchError, UnusedParameterError

from . import collectives
from .access import ParamAccessMode, SavedParam, SavedView, ShardedGradPlaceholder, storage_key
from .chunks import TORCH_DTYPES, Chunk
from .materialize import MetaMaterializer
from .memory import MEMORY_KINDS, MemoryReport
from .schedule import BACKWARD, FORWARD, OUTSIDE, Scheduler
from .state_dict import full_state_dict, load_full_state_dict

S = TensorState

__all__ = ["MemoryReport", "ZeroDDP", "default_chunk_size"]

_MIXED_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def default_chunk_size(specs: list[TensorSpec], world_size: int) -> tuple[int, int]:
    """``(chunk size, keep_gathered_below_numel)`` in elements used when ``ZeroDDP(chunk_size=None)``:
    the core search, ``chunkzero.search.search_chunk_size``."""
    from chunkzero.search import search_chunk_size

    result = search_chunk_size(specs, world_size)
    return int(result.chunk_size), int(getattr(result, "keep_gathered_below_numel", 0) or 0)


def _engine_code(fn):
    """Marks the engine's own hook code: torch calls inside it bypass the access mode (no gather of
    the buffers it manipulates)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self._in_engine:
            return fn(self, *args, **kwargs)
        self._in_engine = True
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._in_engine = False

    return wrapper


class _Entry:
    """A managed parameter: its object, primary name, tensor index, chunk and placement."""

    __slots__ = ("chunk", "index", "name", "param", "placement", "placeholder", "saved_refs")

    def __init__(self, param, name, index, chunk, placement):
        self.param, self.name, self.index, self.chunk, self.placement = param, name, index, chunk, placement
        self.saved_refs = 0
        self.placeholder = None


def _default_device() -> torch.device:
    """Where a meta-device module is materialized by default: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _under_torch_compile() -> bool:
    """Whether this call runs under ``torch.compile`` (traced, or run eagerly inside a compiled frame)."""
    if torch.compiler.is_compiling():
        return True
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    return eval_frame is not None and eval_frame.get_eval_frame_callback() is not None


def _is_compiled(module: nn.Module) -> bool:
    """A ``torch.compile``'d module (dynamo's ``OptimizedModule``), told without importing dynamo."""
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def _tensors_in(out) -> list[torch.Tensor]:
    """Tensors in a forward's output: nested tuples, lists, dicts and mappings (HF ``ModelOutput``)."""
    leaves, _ = tree_flatten(out)
    found = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif hasattr(leaf, "values") and callable(leaf.values) and not isinstance(leaf, (str, bytes)):
            found.extend(_tensors_in(list(leaf.values())))
    return found


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
        prefetch: chunks gathered ahead of use, in the order recorded during the previous step
            (Gemini's ``max_prefetch``); with ``prefetch > 0`` all-gathers and reduce-scatters are
            asynchronous and overlap the computation. ``0``: gather on first use, blocking collectives.
        reshard_after_forward: release sharded chunks after their use in forward (ZeRO-3); ``False``
            keeps them gathered from forward until the backward reduces them (fewer gathers, more memory).
        find_unused_parameters: reduce a zero gradient for parameters that got none on any rank,
            instead of raising (the optimizer then skips them, as torch skips ``grad is None``).
        placement: ``"static"`` (Gemini's static policy): the two fractions below decide, once, where
            each chunk's tensors live (:func:`chunkzero.static_placement`; :attr:`placements`).
        offload_optim_frac: fraction of trainable chunks (first in chunk order, rounded up) whose fp32
            master, gradient and optimizer state live on the host.
        offload_param_frac: fraction of sharded chunks whose compute-dtype parameter shard lives on the
            host between uses (their master too); each gather copies it to the device first.
        keep_gathered: parameters to pack into keep-gathered (never sharded, all-reduced) chunks: an
            iterable of names (any alias matches) or a predicate ``name -> bool``.
        device: where a module built on the meta device is materialized (default: the current CUDA
            device, else the CPU); for other modules it must be ``None`` or their device.
        param_init_fn: for a module built under ``torch.device("meta")``: ``fn(submodule)`` initializes a
            submodule's own parameters and buffers in place; it is called per submodule, in module
            order, while the chunks are built (FSDP1's convention), so no rank holds the whole model.
            ``None``: each submodule's ``reset_parameters()`` (under the same seed, the values equal
            eager init's). ``lambda m: None`` leaves them uninitialized, for ``load_pretrained``.

    Shard-level API (for checkpoints): :attr:`layout`, :attr:`rank`, :attr:`world_size`,
    :attr:`process_group`, :attr:`chunks`, :meth:`master_shard`, :meth:`low_precision_shard`,
    :meth:`grad_shard`, :meth:`load_master_shard`, :meth:`synchronize`.

    Raises:
        ConfigError: a bad argument, a module without parameters, parameters on several devices, or a
            non-floating parameter.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group=None,
        chunk_size: int | None = None,
        mixed_precision: str = "fp32",
        prefetch: int = 1,
        placement: str = "static",
        reshard_after_forward: bool = True,
        find_unused_parameters: bool = False,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        keep_gathered: Iterable[str] | Callable[[str], bool] | None = None,
        device: torch.device | str | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"module must be an nn.Module, got {type(module).__name__}")
        if mixed_precision not in _MIXED_PRECISION:
            raise ConfigError(f"mixed_precision must be one of {sorted(_MIXED_PRECISION)}, got {mixed_precision!r}")
        for name, frac in (("offload_optim_frac", offload_optim_frac), ("offload_param_frac", offload_param_frac)):
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
                raise ConfigError(f"{name} must be a number in [0, 1], got {frac!r}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
            raise ConfigError(f"chunk_size must be a positive int (elements) or None, got {chunk_size!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch must be a non-negative int (chunks), got {prefetch!r}")
        if placement != "static":
            raise ConfigError(f"placement must be 'static', got {placement!r}")

        self.module = module
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        """The data-parallel process group (``None``: single process)."""
        self.world_size: int = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank: int = dist.get_rank(process_group) if process_group is not None else 0
        self.mixed_precision = mixed_precision
        self.compute_dtype: torch.dtype = TORCH_DTYPES[_MIXED_PRECISION[mixed_precision]]
        self.prefetch = prefetch
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
        devices = {p.device for p, _ in groups.values() if not p.is_meta}
        if len(devices) > 1:
            raise ConfigError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
        materializer = None
        if any(p.is_meta for p, _ in groups.values()):
            target = torch.device(device) if device is not None else (devices.pop() if devices else _default_device())
            materializer = MetaMaterializer(module, target, param_init_fn)
            devices = {target}
        elif device is not None and torch.device(device) != next(iter(devices)):
            raise ConfigError(f"device={str(device)!r} differs from the parameters' device {next(iter(devices))}; "
                              "it is for modules built on the meta device")
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

        # ---- placement: where each chunk's parameter shard, master, gradient and optimizer state live
        self.placements: tuple[ChunkPlacement, ...] = static_placement(
            self.layout.chunks, offload_optim_frac=self.offload_optim_frac, offload_param_frac=self.offload_param_frac)
        """One :class:`chunkzero.ChunkPlacement` per chunk (Gemini's static policy over the fractions)."""
        self.offload_param_chunks: tuple[int, ...] = tuple(p.index for p in self.placements if p.param_offloaded)
        self.offload_optim_chunks: tuple[int, ...] = tuple(p.index for p in self.placements if p.optim_offloaded)
        where = {Location.DEVICE: self.device, Location.HOST: torch.device("cpu"), None: self.device}

        # ---- build the chunks (one full chunk in memory at a time)
        by_name = {names[0]: p for p, names in groups.values()}
        self.chunks: list[Chunk] = []
        """One :class:`~torch_backend.chunks.Chunk` per layout chunk, by index."""
        self._entries_by_id: dict[int, _Entry] = {}
        self._entries: dict[str, _Entry] = {}
        self._chunk_by_storage: dict[int, Chunk] = {}
        divide_first = mixed_precision == "fp16"
        tensor_index = {t.name: i for i, t in enumerate(self.layout.tensors)}
        for info in self.layout.chunks:
            placements = self.layout.chunk_tensors(info.index)
            initial = torch.zeros(info.size, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                for t in placements:
                    if materializer is not None:
                        by_name[t.name] = materializer.values(by_name[t.name])
                    initial[t.offset : t.end].copy_(by_name[t.name].detach().reshape(-1))
            collectives.broadcast_from_first(initial, process_group)
            chunk = Chunk(
                self.layout,
                info.index,
                self.rank,
                {t.name: by_name[t.name] for t in placements},
                device=self.device,
                param_device=where[self.placements[info.index].param],
                master_device=where[self.placements[info.index].master],
                group=process_group,
                divide_first=divide_first,
                initial=initial,
            )
            del initial
            self.chunks.append(chunk)
            for t in placements:
                e = _Entry(by_name[t.name], t.name, tensor_index[t.name], chunk, t)
                self._entries[t.name] = e
                self._entries_by_id[id(e.param)] = e
            if not chunk.resident:
                self._chunk_by_storage[chunk.storage_key] = chunk

        if materializer is not None:
            materializer.finish()  # buffers of submodules after the last parameter

        # ---- collectives, hooks, per-step state
        self._sched = Scheduler(self.chunks, num_tensors=len(self.layout.tensors), prefetch=prefetch,
                                group=collectives.agreement_group(process_group), world_size=self.world_size)
        self._trainable = [e for e in self._entries.values() if e.param.requires_grad]
        self._hook_handles = [e.param.register_post_accumulate_grad_hook(self._make_post_grad_hook(e)) for e in self._trainable]
        # torch.compile'd submodules run as one unit: their chunks are gathered before the call and the
        # access mode is suspended inside it (the compiled graph sees plain, gathered parameters)
        self._compiled: dict[int, list[_Entry]] = {}
        inside: set[int] = set()
        for sub in module.modules():
            if _is_compiled(sub) and id(sub) not in inside:
                self._compiled[id(sub)] = [self._entries_by_id[id(p)] for p in sub.parameters() if id(p) in self._entries_by_id]
                inside |= {id(m) for m in sub._orig_mod.modules()}
        for sub in module.modules():
            if id(sub) not in inside:
                self._hook_handles.append(sub.register_forward_pre_hook(self._submodule_pre_hook))
                self._hook_handles.append(sub.register_forward_hook(self._submodule_post_hook, always_call=True))
        self._suspended: list[tuple[nn.Module, Any]] = []
        self._release_later: list[tuple[Chunk, Any]] = []
        self._sync = True
        self._in_engine = False
        self._phase: str | None = None
        self._mode_stack: list[tuple[nn.Module, ParamAccessMode]] = []
        self._release_in_forward = True
        self._fwd_used: dict[int, set[str]] = {}
        self._bwd_grads: set[int] = set()
        self._finalize_queued = False
        self._pending_error: Exception | None = None
        self._placeholders_set = False
        self.backward_passes = 0
        """Backward passes through this model finished so far (ZeroOptimizer checks fp16 scaling with it)."""
        self.grad_received = torch.zeros(len(self.layout.tensors), dtype=torch.bool)
        """Per layout tensor: whether it received a gradient on some rank since the last ``zero_grad``."""

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

        Raises:
            UnusedParameterError: the previous backward left a parameter without a gradient on every rank.
        """
        if _under_torch_compile():
            raise ConfigError("torch.compile of a ZeroDDP is not supported: compile the module or its blocks before "
                              "wrapping, ZeroDDP(torch.compile(block)) (the engine gathers chunks between compiled calls)")
        self.raise_pending_error()
        self._clear_placeholders()
        if self.compute_dtype != torch.float32:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        grad_enabled = torch.is_grad_enabled()
        self._release_in_forward = self.reshard_after_forward or not grad_enabled
        self._fwd_used = {}
        self._phase = FORWARD
        self._sched.start(FORWARD)
        try:
            with self._intercepting():
                if grad_enabled:
                    with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                        out = self.module(*args, **kwargs)
                else:
                    out = self.module(*args, **kwargs)
        finally:
            self._phase = None
            self._fwd_used = {}
            self._sched.end(FORWARD, prefetch_next=BACKWARD if grad_enabled else None)
            keep = self._sched.prefetched_for(BACKWARD) if grad_enabled else set()
            for c in self.chunks:
                self._rest(c, release=self._release_in_forward and c.index not in keep)
        if grad_enabled:
            for t in _tensors_in(out):
                if t.requires_grad:
                    t.register_hook(self._output_grad_hook)
        return out

    def _cast_input(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == torch.float32:
            return x.to(self.compute_dtype)
        return x

    @contextlib.contextmanager
    def _intercepting(self):
        mode = ParamAccessMode(self)
        self._mode_stack.append((self, mode))
        try:
            with mode:
                yield
        finally:
            self._mode_stack.pop()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with this model's parameter access on for the whole backward, so that a
        recomputation that uses parameters outside any module call (``checkpoint(fn, ...)`` of a plain
        function) finds them gathered. ``ZeroOptimizer.backward`` calls it. (A plain
        ``loss.backward()`` covers recomputations that call modules: activation checkpointing of
        blocks, Hugging Face ``gradient_checkpointing_enable()``.)"""
        run = getattr(torch.autograd.graph, "_engine_run_backward", None)
        if run is None or self._mode_stack:
            loss.backward()
            return
        with self._intercepting():
            # the engine directly: Tensor.backward would go through the mode, whose handler runs with
            # the mode off, and the engine keeps the modes active when it starts
            run((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True)

    def _use_chunk(self, c: Chunk) -> None:
        """Have ``c`` gathered for a computation now (forward, or a recomputation in backward)."""
        if c.resident:
            return
        if self._phase is BACKWARD and c.pinned is None:
            c.pinned = "recompute"  # kept until its gradients are final: the recomputed graph needs it
        self._sched.ensure(c, self._phase or FORWARD)

    def _run_op(self, entries: list[_Entry], func, args, kwargs):
        if len(entries) > 1:
            entries = list({id(e): e for e in entries}.values())
        for e in entries:
            self._use_chunk(e.chunk)
            if e.chunk.states.state(e.name) in (S.FREE, S.HOLD):
                e.chunk.states.transition(e.name, S.COMPUTE)
        try:
            return func(*args, **kwargs)
        finally:
            for e in entries:
                if e.chunk.states.state(e.name) is S.COMPUTE:
                    e.chunk.states.transition(e.name, S.HOLD)
                self._after_use(e)

    def _after_use(self, e: _Entry) -> None:
        """In forward, a chunk is released once every tensor of it has been used."""
        if self._phase is not FORWARD:
            return
        c = e.chunk
        used = self._fwd_used.setdefault(c.index, set())
        used.add(e.name)
        if self._release_in_forward and not c.resident and len(used) == c.states.num_tensors and c.states.can_release:
            c.release()

    # ------------------------------------------------------------------ submodule calls outside forward
    @_engine_code
    def _submodule_pre_hook(self, module, args):
        if not self._mode_stack:  # not inside ZeroDDP.forward, nor already intercepting
            if torch._C._current_autograd_node() is not None:
                # called while the autograd engine runs a node: a recomputation (activation checkpointing)
                self._begin_backward()
            elif torch.is_grad_enabled():
                raise ConfigError(
                    f"{type(module).__name__} (inside a ZeroDDP) was called directly with gradients enabled: call "
                    "the ZeroDDP wrapper itself (model(...)) so that its backward can re-gather the chunks; under "
                    "torch.no_grad() submodules may be called directly (e.g. model.module.generate(...))")
            else:
                self._phase = OUTSIDE
                self._sched.start(OUTSIDE)
            mode = ParamAccessMode(self)
            mode.__enter__()
            self._mode_stack.append((module, mode))
        entries = self._compiled.get(id(module))
        if entries is not None:
            for c in sorted({e.chunk.index for e in entries}):
                self._use_chunk(self.chunks[c])
            top = torch._C._pop_torch_function_stack()
            if isinstance(top, ParamAccessMode):
                self._suspended.append((module, top))
            else:  # another mode above ours: leave the stack as it is
                torch._C._push_on_torch_function_stack(top)

    @_engine_code
    def _submodule_post_hook(self, module, args, output):
        if self._suspended and self._suspended[-1][0] is module:
            torch._C._push_on_torch_function_stack(self._suspended.pop()[1])
            for e in self._compiled[id(module)]:
                self._after_use(e)
        if not self._mode_stack or self._mode_stack[-1][0] is not module:
            return
        _, mode = self._mode_stack.pop()
        mode.__exit__(None, None, None)
        if self._phase is OUTSIDE:  # an inference call outside forward: release what it gathered
            self._phase = None
            self._sched.end(OUTSIDE)
            for c in self.chunks:
                self._rest(c, release=True)

    # ================================================================== backward
    @_engine_code
    def _pack(self, t):
        e = self._entries_by_id.get(id(t))
        if e is not None and e.param is t:
            return SavedParam(self, e) if not e.chunk.resident else t
        if self._chunk_by_storage:
            c = self._chunk_by_storage.get(storage_key(t))
            if c is not None:
                return SavedView(self, c, t)
        return t

    @_engine_code
    def _unpack(self, x):
        if type(x) is SavedParam:
            self._begin_backward()
            e = x.entry
            self._unpacked(e.chunk)
            if e.chunk.states.state(e.name) in (S.FREE, S.HOLD):
                e.chunk.states.transition(e.name, S.COMPUTE)
            return e.param
        if type(x) is SavedView:
            self._begin_backward()
            self._unpacked(x.chunk)
            return x.tensor
        return x

    def _unpacked(self, c: Chunk) -> None:
        self._flush_releases()
        if torch.is_grad_enabled():  # a create_graph backward: the new graph keeps raw references
            c.pinned = "graph"
        self._sched.ensure(c, BACKWARD)

    @_engine_code
    def _saved_released(self, c: Chunk, e: _Entry | None) -> None:
        """Autograd freed a saved reference to ``c`` (``e``: the parameter it referred to).

        A chunk no saved tensor needs is released at once — autograd frees a node's saved tensors
        after the node ran — except inside a custom ``autograd.Function``'s backward, which may free
        them before it computes with them (compiled graphs do): then once that node has finished.
        """
        c.saved_refs -= 1
        if e is not None and e.saved_refs == 0 and c.states.state(e.name) is S.COMPUTE:
            c.states.transition(e.name, S.HOLD)
        if self._phase is not BACKWARD or c.saved_refs != 0 or c.pinned is not None:
            return
        node = torch._C._current_autograd_node()
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            if not any(n is node for _, n in self._release_later):
                node.register_hook(lambda *_, n=node: self._flush_releases(finished=n))
            self._release_later.append((c, node))
        else:
            self._release_if_idle(c)

    @_engine_code
    def _flush_releases(self, finished=None) -> None:
        """Release the chunks whose last reference a custom function's backward freed, once it ran
        (``finished``: the node whose post-hook calls this)."""
        if not self._release_later:
            return
        node = torch._C._current_autograd_node()
        keep = []
        for c, freed_in in self._release_later:
            if freed_in is node and freed_in is not finished:
                keep.append((c, freed_in))  # that node is still running
            elif c.saved_refs == 0 and c.pinned is None:
                self._release_if_idle(c)
        self._release_later = keep

    @staticmethod
    def _release_if_idle(c: Chunk) -> None:
        if c.is_gathered and not c.resident and c.states.count(S.COMPUTE) == 0 and c.states.count(S.HOLD_AFTER_BWD) == 0:
            c.release()

    @_engine_code
    def _output_grad_hook(self, grad):
        self._begin_backward()
        return grad

    def _begin_backward(self) -> None:
        if self._phase is BACKWARD:
            return
        self._phase = BACKWARD
        self._sched.start(BACKWARD)
        self._clear_placeholders()
        self._bwd_grads = set()
        if not self._finalize_queued:
            self._finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _make_post_grad_hook(self, e: _Entry):
        return lambda param: self._on_grad(e, param)

    @_engine_code
    def _on_grad(self, e: _Entry, param) -> None:
        self._begin_backward()
        self._flush_releases()
        c = e.chunk
        grad = param.grad
        param.grad = None
        c.add_grad(e.name, e.placement, grad)
        self._bwd_grads.add(e.index)
        state = c.states.state(e.name)
        if state is not S.READY_FOR_REDUCE:
            if state in (S.FREE, S.HOLD):
                c.states.transition(e.name, S.COMPUTE)
            c.states.transition(e.name, S.HOLD_AFTER_BWD)
            c.states.transition(e.name, S.READY_FOR_REDUCE)
            if c.states.can_reduce:
                if self._sync:
                    self._sched.mark_ready(c)
                if c.pinned in (None, "recompute") and c.saved_refs == 0:
                    self._release_if_idle(c)

    @_engine_code
    def _finalize_backward(self) -> None:
        """End of a backward pass (autograd callback): agree on what got gradients, reduce what is
        left, release, reset states. Never raises (an error is kept for :meth:`raise_pending_error`)."""
        self._finalize_queued = False
        error = None
        try:
            used = torch.zeros(len(self.layout.tensors), dtype=torch.int32)
            if self._bwd_grads:
                used[sorted(self._bwd_grads)] = 1
            received = self._sched.end(BACKWARD, used) > 0
            self.backward_passes += 1
            trainable = self._trainable
            if any(bool(received[e.index]) for e in trainable):
                unused = [e for e in trainable if not received[e.index]]
                if unused and not self.find_unused_parameters:
                    error = UnusedParameterError(
                        f"{len(unused)} parameter(s) received no gradient on any rank in this backward pass: "
                        + ", ".join(e.name + (f" (alias {', '.join(e.placement.aliases)})" if e.placement.aliases else "")
                                    for e in unused)
                        + ". Make every parameter take part in the loss, freeze it (requires_grad=False) before "
                        "wrapping, or pass find_unused_parameters=True to reduce a zero gradient for it.")
                    for c in self.chunks:
                        c.discard_grad_buffer()
                else:
                    self.grad_received |= received.to(torch.bool)
                    if self._sync:
                        self._sched.final_reduce()
        except Exception as e:  # noqa: BLE001 - kept and raised outside the autograd engine
            error = e
        finally:
            self._phase = None
            self._bwd_grads = set()
            self._release_later = []
            for c in self.chunks:
                # a create_graph backward's chunks stay for the next backward; every other pin ends here
                c.pinned = "graph-held" if c.pinned == "graph" else None
                self._rest(c, release=True)
            self._set_placeholders()
        if error is not None:
            self._pending_error = error

    def raise_pending_error(self) -> None:
        """Raise (once) the error the last backward found, if any (ZeroOptimizer calls it)."""
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    @staticmethod
    def _rest(c: Chunk, *, release: bool) -> None:
        """Bring every tensor of ``c`` to its resting state (HOLD if gathered else FREE); maybe release
        (never a pinned chunk)."""
        release = release and c.pinned is None
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
        if release and not c.resident and c.is_gathered:
            c.release()

    # ------------------------------------------------------------------ placeholders
    def _set_placeholders(self) -> None:
        for e in self._trainable:
            if e.param.grad is None and bool(self.grad_received[e.index]):
                if e.placeholder is None:
                    e.placeholder = ShardedGradPlaceholder(e.param, e.name)
                e.param.grad = e.placeholder
                self._placeholders_set = True

    def _clear_placeholders(self) -> None:
        if self._placeholders_set:
            for e in self._trainable:
                if e.param.grad is e.placeholder:
                    e.param.grad = None
            self._placeholders_set = False

    # ================================================================== gradients
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (full-chunk gradient buffers, compute dtype) without reducing.

        The first backward outside the context reduces everything accumulated so far (and so does
        ``ZeroOptimizer.step`` after backwards that all ran inside it).
        """
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for every collective in flight (prefetched gathers, gradient reductions)."""
        self._sched.wait_all()

    def finish_gradients(self) -> None:
        """Complete every gradient reduction (collective): waits for those in flight, and reduces
        gradients still accumulated locally (backwards that ran under :meth:`no_sync`)."""
        self._sched.wait_all()
        self._sched.final_reduce()
        self._sched.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - the shards are always dropped
        """Drop all accumulated gradients (buffers, reductions in flight and fp32 gradient shards)."""
        self._clear_placeholders()
        for c in self.chunks:
            c.zero_grad()
        self.grad_received.zero_()

    # ================================================================== shard-level API
    def master_shard(self, chunk: int) -> torch.Tensor:
        """This rank's fp32 master shard of ``chunk``: the live 1-D tensor of ``layout.shard_numel(chunk)``
        elements (a keep-gathered chunk's whole size), padding included (zeros). A frozen chunk keeps
        no master: a fresh fp32 cast of its compute-dtype shard is returned."""
        return self.chunks[chunk].master_values()

    def low_precision_shard(self, chunk: int) -> torch.Tensor:
        """This rank's compute-dtype shard of ``chunk`` (1-D, ``shard_numel``): the master itself in fp32;
        in bf16/fp16 the persistent low-precision shard, or a fresh cast of the master where none is
        kept (no offload: the gather casts the master, which saves 2 bytes per element)."""
        return self.chunks[chunk].low_precision_shard()

    def grad_shard(self, chunk: int) -> torch.Tensor | None:
        """This rank's reduced fp32 gradient shard of ``chunk`` (1-D, ``shard_numel``), or ``None``."""
        master = self.chunks[chunk].master
        return None if master is None else master.grad

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
        self.synchronize()
        c.load_master(shard)

    # ================================================================== state dict
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False) -> dict[str, torch.Tensor]:  # noqa: ARG002
        """The full torch state dict of the wrapped module, on every rank (collective).

        Parameters come from the fp32 master chunks (dtype float32, CPU, full shapes) under every
        alias name (tied names share one tensor); buffers are copied as they are (CPU). One chunk
        is gathered at a time. Keys are the wrapped module's (no ``module.`` prefix); with
        ``destination`` (a parent module's ``state_dict``) they are added to it under ``prefix``.
        """
        self.synchronize()
        out = full_state_dict(self)
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
        self.synchronize()
        return load_full_state_dict(self, state_dict, strict)

    # ================================================================== memory
    def memory_report(self, optimizer=None) -> MemoryReport:
        """Bytes this rank holds now, per device and kind (see :class:`MemoryReport`), with the
        offload decisions and the peak number of gathered chunks.

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
        return MemoryReport(report, self.offload_optim_chunks, self.offload_param_chunks, self._sched.peak_gathered)

    def gathered_chunks(self) -> list[int]:
        """Indices of sharded chunks gathered, or being gathered, right now (resident chunks —
        keep-gathered, or every chunk when the world size is 1 without parameter offload — are not
        listed)."""
        return [c.index for c in self.chunks if not c.resident and (c.is_gathered or c.gather_in_flight)]

    @property
    def collective_stats(self) -> dict[str, int]:
        """``rounds`` (vote all-reduces), ``gathers`` (all-gathers issued), ``misses`` (uses of a chunk not
        gathered ahead), ``peak_gathered_chunks`` and ``order_recordings`` (how often the prefetch order
        was recorded) so far."""
        s = self._sched
        return {"rounds": s.rounds, "gathers": s.gathers, "misses": s.misses, "peak_gathered_chunks": s.peak_gathered,
                "order_recordings": sum(o.recordings for o in s.orders.values())}

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, rank={self.rank}, mixed_precision={self.mixed_precision!r}, "
            f"chunks={len(self.chunks)}, chunk_size={self.layout.chunk_size}, prefetch={self.prefetch}"
        )
