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
  still gathered is released when the forward returns, except the first ``prefetch`` chunks of the
  recorded backward order (gathered ahead, so the backward does not start on a miss).
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

The hooks and per-step state live in :class:`torch_backend.runtime.ChunkRuntime`; this module builds
the chunks (materializing a meta-device module on the way, :mod:`torch_backend.materialize`) and is
the public face. The tensor-state bookkeeping uses the core :class:`chunkzero.ChunkStates` (FREE,
COMPUTE, HOLD, HOLD_AFTER_BWD, READY_FOR_REDUCE).

Limitations: the module's parameters hold data only inside ``forward`` and backward (outside, reading
them raises "data is not allocated" — use :meth:`ZeroDDP.state_dict`); buffers are replicated as-is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from chunkzero import ChunkLayout, ChunkPlacement, Location, TensorSpec, TensorState, static_placement
from chunkzero.errors import ConfigError, ShapeMismatchError

from . import collectives
from .chunks import TORCH_DTYPES, Chunk
from .materialize import MetaMaterializer
from .placement import (DEFAULT_STEADY_DEVICE_CAP_RATIO, AutoPlacement, check_placement_arguments, placement_budget_bytes,
                        warmup_placements)
from .memory import MEMORY_KINDS, MemoryReport
from .runtime import ChunkRuntime, Entry, under_torch_compile
from .schedule import Scheduler
from .state_dict import full_state_dict, load_full_state_dict

S = TensorState

__all__ = ["MemoryReport", "ZeroDDP", "default_chunk_size"]

_MIXED_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def default_chunk_size(specs: list[TensorSpec], world_size: int) -> tuple[int, int]:
    """``(chunk size, keep_gathered_below_numel)`` in elements used when ``ZeroDDP(chunk_size=None)``:
    the core search, ``chunkzero.search.search_chunk_size``."""
    from chunkzero.search import search_chunk_size

    result = search_chunk_size(specs, world_size)
    return int(result.chunk_size), int(result.keep_gathered_below_numel)


def _storage_dtype_name(dtype: torch.dtype) -> str:
    """The dtype a frozen tensor is stored in: its own (float32, bfloat16, float16); float64 is
    narrowed to float32, as trainable tensors' fp32 masters are."""
    name = str(dtype).removeprefix("torch.")
    return name if name in TORCH_DTYPES else "float32"


def _default_device() -> torch.device:
    """Where a meta-device module is materialized by default: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _device_arg(device: torch.device | str) -> torch.device:
    """``device`` with a CUDA index (``"cuda"`` is the current device, as torch places tensors), so it
    compares equal to the parameters' device and names the same memory-report key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
            reduction; the optimizer always updates fp32 master shards. fp32 tensor inputs are cast to it.
            Frozen parameters (``requires_grad=False``) keep the dtype they came in (float32, bfloat16 or
            float16; float64 as float32): their chunks are stored sharded in it, without a master, and
            cast to the compute dtype when gathered, so :meth:`state_dict` and checkpoints return them
            exactly.
        prefetch: chunks gathered ahead of use, in the order recorded during the previous step
            (Gemini's ``max_prefetch``); with ``prefetch > 0`` all-gathers and reduce-scatters are
            asynchronous and overlap the computation. ``0``: gather on first use, blocking collectives.
        reshard_after_forward: release sharded chunks after their use in forward (ZeRO-3); ``False``
            keeps them gathered from forward until the backward reduces them (fewer gathers, more memory).
        find_unused_parameters: reduce a zero gradient for parameters that got none on any rank,
            instead of raising (the optimizer then skips them, as torch skips ``grad is None``).
        placement: ``"static"`` (Gemini's static policy): the two fractions below decide, once, where
            each chunk's tensors live (:func:`chunkzero.static_placement`; :attr:`placements`).
            ``"auto"`` (Gemini's auto policy, :mod:`torch_backend.placement`): a warm-up step with every
            chunk on the host records the non-model memory at each chunk access; from the next step the
            parameter shards move between host and device by Belady's farthest-next-use rule within the
            budget, and the optimizer state of the chunks the margin cannot hold stays on the host
            (:attr:`auto_placement`).
        device_memory_bytes: ``placement="auto"`` only: the device memory to plan within (default: the
            CUDA device's total memory; on CPU the machine's physical RAM).
        steady_device_cap_ratio: ``placement="auto"``: share in ``(0, 1]`` of ``device_memory_bytes``
            that the chunks on the device plus the non-model memory may use (Gemini's
            ``steady_cuda_cap_ratio``).
        offload_optim_frac: fraction of trainable chunks (first in chunk order, rounded up) whose fp32
            master, gradient and optimizer state live on the host.
        offload_param_frac: fraction of sharded chunks whose compute-dtype parameter shard lives on the
            host between uses (their master too); each gather copies it to the device first. Both
            fractions are for ``placement="static"``.
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
        ConfigError: a bad argument (named), a module without parameters, parameters on several devices, or a
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
        device_memory_bytes: int | None = None,
        steady_device_cap_ratio: float = DEFAULT_STEADY_DEVICE_CAP_RATIO,
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
        check_placement_arguments(placement, offload_optim_frac, offload_param_frac, device_memory_bytes,
                                  steady_device_cap_ratio)
        auto = placement == "auto"

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
            target = _device_arg(device) if device is not None else (devices.pop() if devices else _default_device())
            materializer = MetaMaterializer(module, target, param_init_fn)
            devices = {target}
        elif device is not None and _device_arg(device) != next(iter(devices)):
            raise ConfigError(f"device={str(device)!r} differs from the parameters' device {next(iter(devices))}; "
                              "it is for modules built on the meta device")
        self.device: torch.device = devices.pop()
        budget = placement_budget_bytes(self.device, device_memory_bytes, steady_device_cap_ratio) if auto else None
        for p, names in groups.values():
            if not p.is_floating_point():
                raise ConfigError(f"parameter {names[0]!r} has dtype {p.dtype}; only floating parameters can be sharded")
        is_kg = self._keep_gathered_predicate(keep_gathered)
        dtype_name = _MIXED_PRECISION[mixed_precision]
        # a trainable tensor's chunk is in the compute dtype (its fp32 master is apart); a frozen one's
        # in its storage dtype, so frozen tensors of different dtypes never share a chunk
        specs = [
            TensorSpec(
                names[0], tuple(p.shape), dtype_name if p.requires_grad else _storage_dtype_name(p.dtype),
                tuple(names[1:]), bool(p.requires_grad), any(is_kg(n) for n in names)
            )
            for p, names in groups.values()
        ]
        keep_below = 0
        if chunk_size is None:
            chunk_size, keep_below = default_chunk_size(specs, self.world_size)
        self.layout: ChunkLayout = ChunkLayout.build(specs, chunk_size, self.world_size, keep_gathered_below_numel=keep_below)
        """The core layout (tensors → chunks → shards); identical on every rank."""

        # ---- placement: where each chunk's parameter shard, master, gradient and optimizer state live
        self._static_placements: tuple[ChunkPlacement, ...] = warmup_placements(self.layout.chunks) if auto else \
            static_placement(self.layout.chunks, offload_optim_frac=self.offload_optim_frac,
                             offload_param_frac=self.offload_param_frac)
        self.auto_placement: AutoPlacement | None = None
        """``placement="auto"``: the tracer and applier (its plan, trace, budget and bytes moved)."""
        where = {Location.DEVICE: self.device, Location.HOST: torch.device("cpu"), None: self.device}

        # ---- build the chunks (one full chunk in memory at a time)
        by_name = {names[0]: p for p, names in groups.values()}
        self.chunks: list[Chunk] = []
        """One :class:`~torch_backend.chunks.Chunk` per layout chunk, by index."""
        entries: list[Entry] = []
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
                param_device=where[self._static_placements[info.index].param],
                master_device=where[self._static_placements[info.index].master],
                param_offloaded=self._static_placements[info.index].param_offloaded,
                group=process_group,
                divide_first=divide_first,
                initial=initial,
                movable=auto,
                compute_dtype=self.compute_dtype,
            )
            del initial
            self.chunks.append(chunk)
            for t in placements:
                entries.append(Entry(by_name[t.name], t.name, tensor_index[t.name], chunk, t))

        if materializer is not None:
            materializer.finish()  # buffers of submodules after the last parameter

        # ---- collectives, hooks, per-step state
        scheduler = Scheduler(self.chunks, num_tensors=len(self.layout.tensors), prefetch=prefetch,
                              group=collectives.agreement_group(process_group), world_size=self.world_size)
        self._runtime = ChunkRuntime(module, self.layout, self.chunks, entries, scheduler,
                                     find_unused_parameters=self.find_unused_parameters,
                                     reshard_after_forward=self.reshard_after_forward)
        if auto:
            self.auto_placement = AutoPlacement(self.chunks, scheduler, self._runtime, placements=self._static_placements,
                                                device=self.device, budget_bytes=budget, prefetch=prefetch)

    # ================================================================== placement
    @property
    def placements(self) -> tuple[ChunkPlacement, ...]:
        """One :class:`chunkzero.ChunkPlacement` per chunk, as things are now (Gemini's static policy
        over the fractions; with ``placement="auto"`` the applier's, which change between accesses)."""
        if self.auto_placement is not None:
            return tuple(self.auto_placement.placements)
        return self._static_placements

    @property
    def offload_param_chunks(self) -> tuple[int, ...]:
        """Chunks whose parameter shard is on the host now."""
        return tuple(p.index for p in self.placements if p.param_offloaded)

    @property
    def offload_optim_chunks(self) -> tuple[int, ...]:
        """Chunks whose master, gradient and optimizer state are on the host now."""
        return tuple(p.index for p in self.placements if p.optim_offloaded)

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

    # ================================================================== forward / backward
    def forward(self, *args, **kwargs):
        """Run the wrapped module with chunks gathered on use (see the module docstring).

        fp32 tensor inputs (anywhere in ``args``/``kwargs``) are cast to the compute dtype in bf16/fp16;
        other dtypes are passed as they are.

        Raises:
            UnusedParameterError: the previous backward left a parameter without a gradient on every rank.
            ConfigError: called under ``torch.compile`` (compile the module or its blocks instead).
            PlacementBudgetError: ``placement="auto"``: after the warm-up, the budget cannot hold some
                chunk access (the chunk plus the non-model memory there; both numbers named).
        """
        if under_torch_compile():
            raise ConfigError("torch.compile of a ZeroDDP is not supported: compile the module or its blocks before "
                              "wrapping, ZeroDDP(torch.compile(block)) (the engine gathers chunks between compiled calls)")
        self._runtime.finish_aborted_backward()
        if self.compute_dtype != torch.float32:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        if self.auto_placement is not None:
            self._runtime.raise_pending_error()
            self.auto_placement.before_forward(torch.is_grad_enabled())
        return self._runtime.forward(args, kwargs)

    def _cast_input(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == torch.float32:
            return x.to(self.compute_dtype)
        return x

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with this model's parameter access on for the whole backward, so that a
        recomputation that uses parameters outside any module call (``checkpoint(fn, ...)`` of a plain
        function) finds them gathered. ``ZeroOptimizer.backward`` calls it. (A plain
        ``loss.backward()`` covers recomputations that call modules: activation checkpointing of
        blocks, Hugging Face ``gradient_checkpointing_enable()``.)

        Raises:
            ShapeMismatchError: ``loss`` has more than one element (as ``loss.backward()`` refuses).
        """
        self._runtime.backward(loss)

    def raise_pending_error(self) -> None:
        """Raise (once) the error the last backward found, if any (ZeroOptimizer calls it)."""
        self._runtime.raise_pending_error()

    @property
    def backward_passes(self) -> int:
        """Backward passes through this model finished so far (ZeroOptimizer checks fp16 scaling with it)."""
        return self._runtime.backward_passes

    @property
    def grad_received(self) -> torch.Tensor:
        """Per layout tensor (bool): whether it received a gradient on some rank since the last ``zero_grad``."""
        return self._runtime.grad_received

    # ================================================================== gradients
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (full-chunk gradient buffers, compute dtype) without reducing.

        The first backward outside the context reduces everything accumulated so far (and so does
        ``ZeroOptimizer.step`` after backwards that all ran inside it).
        """
        runtime = self._runtime
        previous = runtime.sync
        runtime.sync = False
        try:
            yield
        finally:
            runtime.sync = previous
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for every collective in flight (prefetched gathers, gradient reductions) and, with
        ``placement="auto"`` on CUDA, every placement copy."""
        self._runtime.sched.wait_all()
        if self.auto_placement is not None:
            self.auto_placement.synchronize()

    def finish_gradients(self) -> None:
        """Complete every gradient reduction (collective): waits for those in flight, and reduces
        gradients still accumulated locally (backwards that ran under :meth:`no_sync`)."""
        self._runtime.finish_aborted_backward()
        sched = self._runtime.sched
        sched.wait_all()
        sched.final_reduce()
        sched.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - the shards are always dropped
        """Drop all accumulated gradients (buffers, reductions in flight and fp32 gradient shards)."""
        self._runtime.zero_grad()

    # ================================================================== shard-level API
    def master_shard(self, chunk: int) -> torch.Tensor:
        """This rank's fp32 master shard of ``chunk``: the live 1-D tensor of ``layout.shard_numel(chunk)``
        elements (a keep-gathered chunk's whole size), padding included (zeros). A frozen chunk keeps
        no master: its storage-dtype shard as fp32 is returned (exact; the live shard when fp32)."""
        return self.chunks[chunk].master_values()

    def low_precision_shard(self, chunk: int) -> torch.Tensor:
        """This rank's compute-dtype shard of ``chunk`` (1-D, ``shard_numel``): the master itself in fp32;
        in bf16/fp16 the persistent low-precision shard, or a fresh cast of the master where none is
        kept (no offload: the gather casts the master, which saves 2 bytes per element), or of a
        frozen shard stored in another dtype."""
        return self.chunks[chunk].low_precision_shard()

    def grad_shard(self, chunk: int) -> torch.Tensor | None:
        """This rank's reduced fp32 gradient shard of ``chunk`` (1-D, ``shard_numel``), or ``None``
        (frozen, or no gradient reduced yet). Reductions of it still in flight are completed first."""
        c = self.chunks[chunk]
        if c.master is None:
            return None
        c.finish_reduces()
        c.finish_host_gradients()
        return c.master.grad

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
        frozen: dict[str, dict[str, int]] = {}
        for c in self.chunks:
            for device, kind, n in c.bytes_by_kind():
                add(device, kind, n)
            for device, dtype, n in c.frozen_bytes_by_dtype():
                per = frozen.setdefault(str(device), {})
                per[dtype] = per.get(dtype, 0) + int(n)
        if optimizer is not None:
            for device, n in optimizer.state_bytes():
                add(device, "optimizer_states", n)
        return MemoryReport(report, self.offload_optim_chunks, self.offload_param_chunks, self._runtime.sched.peak_gathered,
                            frozen)

    def gathered_chunks(self) -> list[int]:
        """Indices of sharded chunks gathered, or being gathered, right now (resident chunks —
        keep-gathered, or every chunk when the world size is 1 without parameter offload — are not
        listed)."""
        return [c.index for c in self.chunks if not c.resident and (c.is_gathered or c.gather_in_flight)]

    @property
    def collective_stats(self) -> dict[str, int]:
        """``rounds`` (vote all-reduces), ``gathers`` (all-gathers issued), ``misses`` (uses of a chunk not
        gathered ahead), ``late_gathers`` (prefetched gathers issued only at the chunk's use),
        ``peak_gathered_chunks`` and ``order_recordings`` (how often the prefetch order was recorded) so far."""
        s = self._runtime.sched
        return {"rounds": s.rounds, "gathers": s.gathers, "misses": s.misses, "late_gathers": s.late_gathers,
                "peak_gathered_chunks": s.peak_gathered, "order_recordings": sum(o.recordings for o in s.orders.values())}

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, rank={self.rank}, mixed_precision={self.mixed_precision!r}, "
            f"chunks={len(self.chunks)}, chunk_size={self.layout.chunk_size}, prefetch={self.prefetch}"
        )
