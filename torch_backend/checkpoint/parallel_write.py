"""The torch ranks' parallel checkpoint write: each rank is one JAX process that hands Orbax its own shards.

The first save starts ``jax.distributed`` on CPU (coordinator on ``MASTER_ADDR`` at a free port chosen
by rank 0 and broadcast over the model's process group; ``num_processes`` = world size, ``process_id`` =
rank). A sharded chunk becomes ``jax.make_array_from_single_device_arrays((size,), NamedSharding(mesh,
P('shard')), [shard])`` over a mesh of one CPU device per process, so each rank hands Orbax only its own
shard and Orbax writes each shard from the process that holds it. A keep-gathered chunk is replicated
(``P()``) and written once. Under hybrid sharding (``meta.replicas = R > 1``) the mesh is 2-D,
``('replica', 'shard')`` of shape ``(R, S)`` (rank ``g·S + q`` at ``[g, q]``), and a shard is replicated
over ``'replica'``: Orbax writes each shard once, from its replica-0 copy (ranks ``0 … S-1``). The write
itself — checks, commit, keep-last-N — is :func:`chunkzero.checkpoint.orbax_store.save_step`.

Every wait for the other processes is bounded by ``timeout_s``: the start of ``jax.distributed``, each
Orbax barrier of a save, and the shutdown barrier at the process's exit. A rank that died therefore
ends the others' save with a :class:`~chunkzero.errors.CheckpointError` after ``timeout_s``. JAX then
ends the survivors itself, with an abort: its coordination service stops a job one of whose processes
stopped sending heartbeats (``heartbeat_timeout_seconds = max(100, 2·timeout_s)``, so our error comes
first), and a process's exit fails at the shutdown barrier its dead peer never reaches. Nothing
hangs. (JAX's ``jax_enable_recoverability`` would let the survivors exit cleanly, but then rank 0,
which hosts the coordination service, aborts every rank still running when it exits first.)
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from chunkzero.checkpoint import CheckpointMeta, chunk_index, orbax_store, shard_arrays, state_tree
from chunkzero.errors import CheckpointError
from chunkzero.layout import REPLICA_AXIS, SHARD_AXIS
from chunkzero.workers import reclaim_stop_signals

__all__ = ["ProcessMesh", "current_process_mesh", "process_mesh", "write_shards"]


class ProcessMesh:
    """One CPU device per process on a 1-D mesh ``('shard',)``; device ``r`` belongs to rank ``r``."""

    def __init__(self, rank: int, world_size: int):
        import jax
        from jax.sharding import Mesh

        self.rank, self.world_size = rank, world_size
        if world_size == 1:
            devices = [jax.local_devices(backend="cpu")[0]]
        else:
            by_process: dict[int, Any] = {}
            for d in jax.devices("cpu"):
                by_process.setdefault(d.process_index, d)
            if sorted(by_process) != list(range(world_size)):
                raise CheckpointError(
                    f"jax.distributed sees processes {sorted(by_process)}, expected 0..{world_size - 1}"
                )
            devices = [by_process[p] for p in range(world_size)]
        self.device = devices[rank]
        self.mesh = Mesh(np.array(devices), (SHARD_AXIS,))

    def global_array(self, local: np.ndarray, size: int, replicated: bool, replicas: int = 1):
        """The 1-D global array of ``size`` elements whose only local piece is ``local``.

        ``local`` is this rank's shard (``size / S`` elements, ``S = world_size / replicas``) or, for a
        replicated (keep-gathered) chunk, the whole chunk. With ``replicas > 1`` the shard is replicated
        over the mesh's ``'replica'`` axis (hybrid sharding).
        """
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = self.mesh
        if replicas > 1:
            mesh = Mesh(
                np.array(self.mesh.devices).reshape(replicas, self.world_size // replicas), (REPLICA_AXIS, SHARD_AXIS)
            )
        sharding = NamedSharding(mesh, P() if replicated else P(SHARD_AXIS))
        # An explicit copy: on CPU, device_put may alias an aligned numpy buffer instead of copying it,
        # and ``local`` is a view of a live shard that training changes while an async save writes.
        piece = jax.device_put(np.array(local, copy=True), self.device)
        piece.block_until_ready()
        return jax.make_array_from_single_device_arrays((size,), sharding, [piece])


_RUNTIME: ProcessMesh | None = None
_RUNTIME_LOCK = threading.Lock()


def current_process_mesh() -> ProcessMesh | None:
    """This process's mesh once :func:`process_mesh` has started it (its ``rank`` and ``world_size`` are the only
    ones later saves may use), else ``None``. Starts nothing."""
    return _RUNTIME


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]


def _use_cpu_jax() -> None:
    """Keep JAX in a torch process on the CPU (it must never grab accelerator memory)."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # noqa: BLE001 - backends already initialized: whatever they are, we only use CPU devices
        pass


def process_mesh(rank: int, world_size: int, process_group=None, *, coordinator: str | None = None,
                 timeout_s: float = orbax_store.DEFAULT_TIMEOUT_S) -> ProcessMesh:
    """This process's JAX mesh, starting ``jax.distributed`` on CPU the first time (world size > 1).

    Args:
        rank, world_size: this process's data-parallel rank and the world size.
        process_group: the torch process group over which rank 0 broadcasts the coordinator port;
            ``None`` is the default group. Not needed when ``coordinator`` is given.
        coordinator: ``host:port`` of the JAX coordinator (default: ``MASTER_ADDR`` and a free port).
        timeout_s: how long, in seconds, the start waits for every process to join, and the exit of
            the process for the others at JAX's shutdown barrier (the first call's value holds for
            the process).

    Raises:
        CheckpointError: JAX was already started for another world size or rank in this process, a
            process did not join within ``timeout_s``, or JAX computations ran before the first save
            (``jax.distributed`` must start first).
    """
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is not None:
            if (_RUNTIME.rank, _RUNTIME.world_size) != (rank, world_size):
                raise CheckpointError(
                    f"this process already checkpoints as rank {_RUNTIME.rank} of {_RUNTIME.world_size}; "
                    f"cannot switch to rank {rank} of {world_size} (jax.distributed starts once per process)"
                )
            return _RUNTIME
        import jax

        _use_cpu_jax()
        if world_size > 1:
            if coordinator is None:
                import torch.distributed as dist

                from ..zero.collectives import broadcast_int

                host = os.environ.get("MASTER_ADDR", "127.0.0.1")
                group = process_group if process_group is not None else dist.group.WORLD
                port = broadcast_int(_free_port(host) if rank == 0 else 0, group)
                coordinator = f"{host}:{port}"
            try:
                jax.distributed.initialize(
                    coordinator_address=coordinator,
                    num_processes=world_size,
                    process_id=rank,
                    local_device_ids=None,
                    initialization_timeout=orbax_store.whole_seconds(timeout_s),
                    shutdown_timeout_seconds=orbax_store.whole_seconds(timeout_s),
                    # JAX ends every process once a peer misses heartbeats this long: after our own timeouts
                    heartbeat_timeout_seconds=max(100, 2 * orbax_store.whole_seconds(timeout_s)),
                )
            except Exception as e:  # RuntimeError, or JaxRuntimeError once the deadline passes
                raise CheckpointError(
                    f"cannot start jax.distributed for rank {rank} of {world_size} at {coordinator} within "
                    f"timeout_s={timeout_s:g} s: {e} (every rank must save; in a torch training process JAX must "
                    "not run computations before the first save)"
                ) from e
            reclaim_stop_signals()  # JAX's preemption notifier took SIGTERM: a chunkzero train worker takes it back
        _RUNTIME = ProcessMesh(rank, world_size)
        return _RUNTIME


def write_shards(
    directory: str | os.PathLike,
    meta: CheckpointMeta,
    rank: int,
    params: Mapping[int, np.ndarray],
    optim: Mapping[str, Mapping[int, np.ndarray]] | None = None,
    *,
    ema: Mapping[int, np.ndarray] | None = None,
    async_save: bool = False,
    max_to_keep: int | None = None,
    process_group=None,
    coordinator: str | None = None,
    timeout_s: float = orbax_store.DEFAULT_TIMEOUT_S,
) -> Path:
    """Write step ``meta.step`` from this rank's shards (collective over the ``meta.world_size`` ranks).

    Args:
        directory: checkpoint root; the step goes to ``directory/<step>/``.
        meta: the metadata document (its layout's world size times ``meta.replicas`` is the number of
            processes; hybrid sharding: each shard is written once, by the replica-0 process holding it).
        rank: this process's rank (of all ``world_size · replicas``).
        params: chunk index -> this rank's shard of the chunk's ``params`` array (``shard_numel``
            elements, padded, dtype :func:`~chunkzero.checkpoint.param_array_dtype`), for every chunk;
            keep-gathered chunks whole.
        optim: state key -> chunk index -> fp32 shard, for every trainable chunk.
        ema: chunk index -> fp32 EMA shard, for every trainable chunk (with ``meta.ema``).
        async_save: return once the shards are handed to Orbax; the write completes in the
            background (the next save, a load of ``directory`` or process exit waits for it).
        max_to_keep: keep only the newest ``max_to_keep`` steps (``None``: keep all).
        process_group, coordinator: as :func:`process_mesh`.
        timeout_s: the bound, in seconds, on every wait for the other ranks: the start of
            ``jax.distributed`` and each of Orbax's barriers (:func:`chunkzero.checkpoint.orbax_store.save_step`).

    Returns:
        ``directory/<step>`` (committed unless ``async_save``).

    Raises:
        ConfigError: a shard is missing, bad ``max_to_keep`` or ``timeout_s``, metadata that is not JSON-serializable.
        CheckpointError: the step already exists or is not after the latest step, the write failed, or
            another rank did not arrive within ``timeout_s`` (it died, hangs, or saves elsewhere).
        ShapeMismatchError: a shard's numel differs from the layout's shard numel (names the array).
    """
    layout = meta.layout
    timeout_s = orbax_store.check_timeout(timeout_s)

    def tree():
        shards = shard_arrays(meta, params, optim, ema)  # checked before jax.distributed starts
        runtime = process_mesh(rank, layout.world_size * meta.replicas, process_group, coordinator=coordinator,
                               timeout_s=timeout_s)
        arrays = {}
        for path, local in shards.items():
            c = layout.chunks[chunk_index(path[-1])]
            arrays[path] = runtime.global_array(local, c.size, c.keep_gathered, meta.replicas)
        return state_tree(arrays)

    return orbax_store.save_step(
        directory, meta, tree, async_save=async_save, max_to_keep=max_to_keep, timeout_s=timeout_s
    )
