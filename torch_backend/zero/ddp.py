"""``ZeroDDP``: chunk-based ZeRO-3 data parallelism for any ``nn.Module`` — the public face.

The method is ColossalAI Gemini's ``ZeroDDP`` (itself PatrickStar's chunk manager, Fang et al. 2021,
on top of ZeRO stage 3, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models"): parameters are packed into flat chunks in parameter order (the core
:class:`chunkzero.ChunkLayout`), each chunk is sharded over the ranks, gathered before the
computation that needs it and released afterwards; gradients land in per-chunk buffers and each
chunk is reduce-scattered as soon as all its gradients are final.

This module builds the engine and answers its users; each mechanism is described once, where it
lives:

- :mod:`torch_backend.zero.chunks` — one chunk's storage on a rank (shard, master, the gathered buffer
  the parameters are views of, the gradient buffer) and its life (tensor states, saved references,
  pins, release);
- :mod:`torch_backend.zero.runtime` — how torch's events (torch calls, saved tensors, gradient hooks, the
  end of a backward) become chunk calls;
- :mod:`torch_backend.zero.schedule` — which collective runs when, decided identically on every rank;
- :mod:`torch_backend.zero.collectives` — every torch collective;
- :mod:`torch_backend.zero.optim` — the step on the fp32 master shards.

Construction (:meth:`ZeroDDP.__init__`) collects the parameters, builds the layout (the core chunk
search unless ``chunk_size`` is given), decides placement, builds the chunks one at a time
(materializing a meta-device module on the way, :mod:`torch_backend.zero.materialize`), and starts the
runtime.

Errors found at the end of a backward (a parameter that received no gradient on any rank) are raised
by ``ZeroOptimizer.backward`` right after it, or else by the next ``forward`` or ``step`` — never from
inside the autograd engine, where an exception can abort the process (the CUDA engine threads).

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

from chunkzero import ChunkLayout, ChunkPlacement, Location, static_placement
from chunkzero.errors import ConfigError, ShapeMismatchError

from . import collectives
from .access_mode import Entry
from .chunks import TORCH_DTYPES, Chunk
from .config import (
    AutoPlacementPolicy,
    MixedPrecision,
    PlacementPolicy,
    PrefetchPolicy,
    resolve_mixed_precision,
    resolve_placement,
    resolve_prefetch,
)
from .materialize import MetaMaterializer, training_device
from .memory import AllocationTracker, MemoryReport
from .module_layout import ParamGroups, build_module_layout, collect_parameters
from .pinned import arena_bytes
from .placement import AutoPlacement, placement_budget_bytes, warmup_placements
from .runtime import ChunkRuntime
from .schedule import Scheduler
from .sharding_groups import ShardingGroups, build_sharding_groups
from .state_dict import full_state_dict, load_full_state_dict
from .torch_internals import compile_frame_callback

__all__ = ["MemoryReport", "ZeroDDP"]

class ZeroDDP(nn.Module):
    """Wrap ``module`` for chunk-based ZeRO-3 data parallelism (ColossalAI Gemini's ``ZeroDDP``).

    Options are frozen dataclasses of :mod:`torch_backend.zero.config` or their flat keywords (not both).

    Args:
        module: an ``nn.Module`` whose floating-point parameters share one device (CUDA → NCCL, CPU →
            gloo), the same architecture on every rank; values are taken from group rank 0. Its
            parameter objects are kept; their ``.data`` holds data only inside forward and backward
            (read values with :meth:`state_dict`).
        process_group: the data-parallel group; ``None``: the default group if initialized, else one process.
        shard_group_size: ``S``, ranks each chunk is sharded over (hybrid sharding, FSDP2's HSDP;
            :mod:`torch_backend.zero.sharding_groups`); ``None`` or ``W``: flat ZeRO-3; ``1``: DDP.
        chunk_size: chunk capacity in elements; ``None``: searched (:func:`default_chunk_size`).
        mixed_precision: a :class:`~torch_backend.zero.config.MixedPrecision` or ``"fp32"``/``"bf16"``/
            ``"fp16"``: the dtype of chunks, compute and gradient reduction (fp32 tensor inputs are cast to
            it); masters are fp32; frozen parameters keep their own dtype (float64 as float32).
        prefetch: a :class:`~torch_backend.zero.config.PrefetchPolicy` or its ``chunks``: chunks gathered
            ahead of use in the last step's order; ``> 0`` makes the collectives asynchronous, ``0``
            blocking.
        reshard_after_forward: release sharded chunks after their use in forward (default ``True``).
        find_unused_parameters: reduce a zero gradient for a parameter no rank gave one, instead of raising.
        placement: ``"static"`` / :class:`~torch_backend.zero.config.StaticPlacement` (the offload
            fractions decide once: :attr:`placements`) or ``"auto"`` /
            :class:`~torch_backend.zero.config.AutoPlacementPolicy` (planned from a traced step:
            :mod:`torch_backend.zero.placement`, ``docs/placement.md``).
        device_memory_bytes, steady_device_cap_ratio: ``placement="auto"``'s policy fields (bytes; a
            share in ``(0, 1]``).
        offload_optim_frac, offload_param_frac: ``placement="static"``'s fields (fractions in ``[0, 1]``
            of trainable chunks whose master, gradient and optimizer state, and of sharded chunks whose
            parameter shard, live on the host).
        keep_gathered: names (any alias) or a predicate ``name -> bool`` of parameters packed into
            never-sharded, all-reduced chunks.
        device: where a meta-device module is materialized (default: the current CUDA device, else the
            CPU); ``None`` or the module's device otherwise.
        param_init_fn: for a meta-device module, ``fn(submodule)`` initializes the submodule's own
            tensors in place, called per submodule in module order while the chunks are built;
            ``None``: ``reset_parameters()``; ``lambda m: None`` leaves them uninitialized.

    Shard-level API (checkpoints): :attr:`layout`, :attr:`rank`, :attr:`world_size`, :attr:`process_group`,
    :attr:`shard_rank`, :attr:`shard_group_size`, :attr:`replicas`, :attr:`chunks`, :meth:`master_shard`,
    :meth:`low_precision_shard`, :meth:`grad_shard`, :meth:`load_master_shard`, :meth:`synchronize`.

    Raises:
        ConfigError: a bad argument (named), a dataclass given with its flat keywords (both named), a
            module without parameters, a module that is or holds a ZeroDDP already, parameters on several
            devices, or a non-floating parameter.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group=None,
        shard_group_size: int | None = None,
        chunk_size: int | None = None,
        mixed_precision: MixedPrecision | str = "fp32",
        prefetch: PrefetchPolicy | int = 1,
        placement: PlacementPolicy | str = "static",
        device_memory_bytes: int | None = None,
        steady_device_cap_ratio: float | None = None,
        reshard_after_forward: bool | None = None,
        find_unused_parameters: bool = False,
        offload_optim_frac: float | None = None,
        offload_param_frac: float | None = None,
        keep_gathered: Iterable[str] | Callable[[str], bool] | None = None,
        device: torch.device | str | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"module must be an nn.Module, got {type(module).__name__}")
        wrapped = next((name for name, sub in module.named_modules() if isinstance(sub, ZeroDDP)), None)
        if wrapped is not None:  # its parameters are chunk views already: a second wrap would shard the views
            where = "the module is" if wrapped == "" else f"its submodule {wrapped!r} is"
            raise ConfigError(f"{where} a ZeroDDP already: wrap a module once (wrap the inner module, not its ZeroDDP)")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ConfigError(f"chunk_size must be a positive int (elements) or None, got {chunk_size!r}")
        self.mixed_precision_policy: MixedPrecision = resolve_mixed_precision(mixed_precision)
        """The dtype of chunks, compute and gradient reduction (see :attr:`mixed_precision`)."""
        self._compute_dtype = TORCH_DTYPES[self.mixed_precision_policy.dtype_name]
        self.prefetch_policy: PrefetchPolicy = resolve_prefetch(prefetch, reshard_after_forward)
        """How far chunks are gathered ahead, and whether forward releases them."""
        self.placement_policy: PlacementPolicy = resolve_placement(
            placement, offload_optim_frac=offload_optim_frac, offload_param_frac=offload_param_frac,
            device_memory_bytes=device_memory_bytes, steady_device_cap_ratio=steady_device_cap_ratio)
        """A :class:`~torch_backend.zero.config.StaticPlacement` or an
        :class:`~torch_backend.zero.config.AutoPlacementPolicy`."""
        self.find_unused_parameters = bool(find_unused_parameters)
        self.module = module
        self._join_group(process_group, shard_group_size)
        groups = collect_parameters(module)
        self.device, materializer = training_device(module, [p for p, _ in groups.values()], device, param_init_fn)
        self.layout: ChunkLayout = self._build_layout(groups, chunk_size, keep_gathered)
        """The core layout (tensors → chunks → shards); identical on every rank."""
        self._static_placements, budget_bytes = self._plan_placement()
        self.chunks, entries = self._build_chunks(groups, materializer)
        """One :class:`~torch_backend.zero.chunks.Chunk` per layout chunk, by index."""
        if materializer is not None:
            materializer.finish()  # buffers of submodules after the last parameter
        self._runtime, self.auto_placement = self._start_runtime(entries, budget_bytes)
        """``placement="auto"``: the tracer and applier (its plan, trace, budget and bytes moved); else ``None``."""

    # ================================================================== options
    @property
    def mixed_precision(self) -> str:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``: :attr:`mixed_precision_policy`'s ``compute``."""
        return self.mixed_precision_policy.compute

    @property
    def compute_dtype(self) -> torch.dtype:
        """The torch dtype of the chunks, the computation and the gradient reduction."""
        return self._compute_dtype

    @property
    def prefetch(self) -> int:
        """Chunks gathered ahead of use (:attr:`prefetch_policy`'s ``chunks``)."""
        return self.prefetch_policy.chunks

    @property
    def reshard_after_forward(self) -> bool:
        """Whether forward releases sharded chunks after their use (:attr:`prefetch_policy`)."""
        return self.prefetch_policy.reshard_after_forward

    @property
    def offload_optim_frac(self) -> float:
        """:class:`~torch_backend.zero.config.StaticPlacement`'s fraction (0.0 with ``placement="auto"``)."""
        return getattr(self.placement_policy, "offload_optim_frac", 0.0)

    @property
    def offload_param_frac(self) -> float:
        """:class:`~torch_backend.zero.config.StaticPlacement`'s fraction (0.0 with ``placement="auto"``)."""
        return getattr(self.placement_policy, "offload_param_frac", 0.0)

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

    # ================================================================== construction steps
    def _join_group(self, process_group, shard_group_size) -> None:
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        """The data-parallel process group (``None``: single process)."""
        self.world_size: int = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank: int = dist.get_rank(process_group) if process_group is not None else 0
        self.sharding_groups: ShardingGroups = build_sharding_groups(process_group, shard_group_size)
        """The shard group and the replica group (flat ZeRO-3: the group itself, no replicas)."""

    @property
    def shard_group_size(self) -> int:
        """``S``: ranks each chunk is sharded over (the layout's world size; :attr:`world_size` when flat)."""
        return self.sharding_groups.shard_group_size

    @property
    def replicas(self) -> int:
        """``R = world_size / shard_group_size``: copies of each shard (1 when flat)."""
        return self.sharding_groups.replicas

    @property
    def shard_rank(self) -> int:
        """This rank in its shard group: the layout's rank of its shards (:attr:`rank` when flat)."""
        return self.sharding_groups.shard_rank

    def _build_layout(self, groups: ParamGroups, chunk_size: int | None, keep_gathered) -> ChunkLayout:
        return build_module_layout(groups, self.mixed_precision_policy.dtype_name, self.shard_group_size, chunk_size,
                            keep_gathered)

    def _plan_placement(self) -> tuple[tuple[ChunkPlacement, ...], int | None]:
        """Where each chunk's parameter shard, master, gradient and optimizer state start, and the auto
        placement's budget in bytes (``None`` for the static one)."""
        policy = self.placement_policy
        if isinstance(policy, AutoPlacementPolicy):
            return warmup_placements(self.layout.chunks), placement_budget_bytes(self.device, policy)
        return static_placement(self.layout.chunks, offload_optim_frac=policy.offload_optim_frac,
                                offload_param_frac=policy.offload_param_frac), None

    def _build_chunks(
        self, groups: ParamGroups, materializer: MetaMaterializer | None
    ) -> tuple[list[Chunk], list[Entry]]:
        """One chunk per layout chunk, filled from group rank 0's values (materialized one submodule
        at a time for a meta-device module: one full chunk in memory at a time), and one runtime entry
        per parameter."""
        by_name = {names[0]: p for p, names in groups.values()}
        tensor_index = {t.name: i for i, t in enumerate(self.layout.tensors)}
        where = {Location.DEVICE: self.device, Location.HOST: torch.device("cpu"), None: self.device}
        auto = isinstance(self.placement_policy, AutoPlacementPolicy)
        chunks: list[Chunk] = []
        entries: list[Entry] = []
        self.allocations = AllocationTracker()
        """Every buffer the engine allocates, now and at its peak
        (:class:`~torch_backend.zero.memory.AllocationTracker`; read through :meth:`memory_report`)."""
        for info in self.layout.chunks:
            tensors = self.layout.chunk_tensors(info.index)
            initial = self.allocations.track(torch.zeros(info.size, dtype=torch.float32, device=self.device), "staging")
            with torch.no_grad():
                for t in tensors:
                    if materializer is not None:
                        by_name[t.name] = materializer.values(by_name[t.name])
                    initial[t.offset : t.end].copy_(by_name[t.name].detach().reshape(-1))
            collectives.broadcast_from_first(initial, self.process_group)
            start = self._static_placements[info.index]
            chunk = Chunk(
                self.layout,
                info.index,
                self.shard_rank,
                {t.name: by_name[t.name] for t in tensors},
                device=self.device,
                param_device=where[start.param],
                master_device=where[start.master],
                param_offloaded=start.param_offloaded,
                group=self.sharding_groups.shard_group,
                divide_first=self.mixed_precision == "fp16",
                initial=initial,
                movable=auto,
                compute_dtype=self.compute_dtype,
                tracker=self.allocations,
                sharding_groups=self.sharding_groups,
            )
            del initial
            chunks.append(chunk)
            entries += [Entry(by_name[t.name], t.name, tensor_index[t.name], chunk, t) for t in tensors]
        return chunks, entries

    def _start_runtime(
        self, entries: list[Entry], budget_bytes: int | None
    ) -> tuple[ChunkRuntime, AutoPlacement | None]:
        """The scheduler, the hooks and per-step state, and (``placement="auto"``) the placement applier."""
        scheduler = Scheduler(self.chunks, num_tensors=len(self.layout.tensors), prefetch=self.prefetch,
                              group=collectives.agreement_group(self.process_group), world_size=self.world_size)
        runtime = ChunkRuntime(self.module, self.layout, self.chunks, entries, scheduler,
                               find_unused_parameters=self.find_unused_parameters,
                               reshard_after_forward=self.reshard_after_forward)
        self._scheduler = scheduler
        if budget_bytes is None:
            return runtime, None
        placement = AutoPlacement(self.chunks, scheduler.orders, placements=self._static_placements,
                                  device=self.device, budget_bytes=budget_bytes, prefetch=self.prefetch)
        scheduler.set_policy(placement)
        return runtime, placement

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
        if torch.compiler.is_compiling() or compile_frame_callback() is not None:
            raise ConfigError(
                "torch.compile of a ZeroDDP is not supported: compile the module or its blocks before "
                "wrapping, ZeroDDP(torch.compile(block)) (the engine gathers chunks between compiled calls)"
            )
        self._runtime.finish_aborted_backward()
        if self.compute_dtype != torch.float32:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        if self.auto_placement is not None:
            self._runtime.raise_pending_error()
            grad_enabled = torch.is_grad_enabled()
            if self.auto_placement.replans(grad_enabled):
                self._scheduler.wait_all()
            self.auto_placement.before_forward(grad_enabled)
            self._runtime.count_saved_activations(self.auto_placement.saved_counter)
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
        try:
            with self._runtime.syncing(False):
                yield
        finally:
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for every collective in flight (prefetched gathers, gradient reductions) and, with
        ``placement="auto"`` on CUDA, every placement copy."""
        self._scheduler.wait_all()
        if self.auto_placement is not None:
            self.auto_placement.synchronize()

    def finish_gradients(self) -> None:
        """Complete every gradient reduction (collective): waits for those in flight, and reduces
        gradients still accumulated locally (backwards that ran under :meth:`no_sync`)."""
        self._runtime.finish_aborted_backward()
        self._scheduler.finish_gradients()

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
        c.gradient.finish_reduces()
        c.gradient.finish_host_gradients()
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
        offload decisions, the peak number of gathered chunks, and what the engine's own allocations
        hold now and held at their peak (``allocated``, ``peak_allocated``, ``peak_allocated_total``:
        counted at each allocation and free, since construction or :meth:`reset_peak_memory`).

        Args:
            optimizer: the :class:`~torch_backend.ZeroOptimizer` over this model, whose state shards
                are counted as ``optimizer_states`` (``None``: counted as 0). ``optim.memory_report()``
                passes itself.
        """
        return MemoryReport.collect(self.chunks, self.device, optimizer, offload_optim_chunks=self.offload_optim_chunks,
                                    offload_param_chunks=self.offload_param_chunks,
                                    peak_gathered_chunks=self._scheduler.peak_gathered, tracker=self.allocations,
                                    **arena_bytes(self.device))

    def reset_peak_memory(self) -> None:
        """Start :meth:`memory_report`'s allocation peaks again from what is allocated now (as
        ``torch.cuda.reset_peak_memory_stats`` does for the allocator's)."""
        self.allocations.reset_peak()

    def gathered_chunks(self) -> list[int]:
        """Indices of sharded chunks gathered, or being gathered, right now (resident chunks —
        keep-gathered, or every chunk when the world size is 1 without parameter offload — are not
        listed)."""
        return [c.index for c in self.chunks if not c.resident and (c.is_gathered or c.gather_in_flight)]

    @property
    def collective_stats(self) -> dict[str, int]:
        """``rounds`` (vote all-reduces), ``gathers`` (all-gathers issued), ``misses`` (uses of a chunk not
        gathered ahead), ``late_gathers`` (prefetched gathers issued only at the chunk's use),
        ``peak_gathered_chunks`` and ``order_recordings`` (how often the prefetch order was recorded) so far;
        and the bytes of the chunk collectives per level (``intra``: the shard group, ``inter``: the replica
        group), ``*_payload_bytes`` (their full buffers) and ``*_sent_bytes`` (what this rank sends under the
        ring algorithm; :class:`~torch_backend.zero.sharding_groups.CollectiveBytes`)."""
        return {**self._scheduler.stats(), **self.sharding_groups.bytes.as_stats()}

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, rank={self.rank}, shard_group_size={self.shard_group_size}, "
            f"mixed_precision={self.mixed_precision!r}, "
            f"chunks={len(self.chunks)}, chunk_size={self.layout.chunk_size}, prefetch={self.prefetch}"
        )
