"""Device meshes for the chunk layout: one data-parallel mesh axis, one shard per device.

A :class:`chunkzero.ChunkLayout` at world size ``W`` maps onto a mesh whose data axis has ``W``
devices: device ``r`` along that axis holds rank ``r``'s shard ``[r*size/W, (r+1)*size/W)`` of every
sharded chunk (``NamedSharding(mesh, P(axis))``) and the whole of every keep-gathered chunk
(``NamedSharding(mesh, P())``). These are the same elements a torch rank ``r`` holds.

Meshes are built with ``AxisType.Auto`` (``jax.make_mesh`` defaults to ``Explicit``), so the
compiler propagates shardings through ordinary jnp code (DESIGN.md §7).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkzero.errors import ConfigError
from chunkzero.layout import REPLICA_AXIS, SHARD_AXIS, ChunkInfo

DEFAULT_AXIS = SHARD_AXIS
"""Name of the data-parallel mesh axis unless told otherwise: ``"shard"`` (:data:`chunkzero.layout.SHARD_AXIS`),
the axis a chunk's shards lie along, the same name in the hybrid mesh and the torch checkpoint writer."""


def make_mesh(n_devices: int | None = None, *, axis: str = DEFAULT_AXIS, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh of ``n_devices`` devices named ``axis``, with ``AxisType.Auto``.

    Args:
        n_devices: devices along the axis; ``None`` means all of ``devices`` (default ``jax.devices()``).
            With simulated CPU devices any count up to ``--xla_force_host_platform_device_count`` works.
        axis: the axis name (``"shard"``).
        devices: devices to take the first ``n_devices`` from (default ``jax.devices()``).

    Raises:
        ConfigError: ``n_devices`` is not positive or exceeds the devices available.
    """
    pool = list(jax.devices() if devices is None else devices)
    n = len(pool) if n_devices is None else n_devices
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n_devices must be a positive int, got {n_devices!r}")
    if n > len(pool):
        raise ConfigError(
            f"n_devices={n} but only {len(pool)} devices are available ({pool[0].platform}); on CPU, simulate "
            f"more by setting XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax is imported"
        )
    return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Auto,), devices=pool[:n])




def make_hybrid_mesh(replicas: int, shard_group_size: int, *, axes: tuple[str, str] = (REPLICA_AXIS, SHARD_AXIS),
                     devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 2-D mesh ``(replicas, shard_group_size)`` named ``("replica", "shard")``, ``AxisType.Auto`` on both.

    Device ``i·S + j`` (of ``devices``, default ``jax.devices()``) is replica ``i``, shard ``j``: the shard
    groups are contiguous devices, as torchrun's ranks put a node's GPUs in one group
    (``ZeroDDP(..., shard_group_size=S)``).

    Raises:
        ConfigError: a count not positive, or more devices asked for than there are.
    """
    for name, v in (("replicas", replicas), ("shard_group_size", shard_group_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive int, got {v!r}")
    pool = list(jax.devices() if devices is None else devices)
    n = replicas * shard_group_size
    if n > len(pool):
        raise ConfigError(f"a {replicas} x {shard_group_size} mesh needs {n} devices but only {len(pool)} are available; "
                          f"on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax is imported")
    grid = np.array(pool[:n], dtype=object).reshape(replicas, shard_group_size)  # in device order, not reordered
    return Mesh(grid, axes, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_world_size(mesh: Mesh, axis: str = DEFAULT_AXIS) -> int:
    """Number of devices along ``axis`` of ``mesh``: the data-parallel world size.

    Raises:
        ConfigError: ``mesh`` is not a ``jax.sharding.Mesh`` or has no axis called ``axis``
            (the message lists the axes it has).
    """
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ConfigError(
            f"mesh has no axis named {axis!r} (its axes are {tuple(mesh.axis_names)}); "
            f"pass axis= one of them, or build the mesh with jax_backend.make_mesh(n, axis={axis!r})"
        )
    return int(mesh.shape[axis])


def chunk_sharding(mesh: Mesh, chunk: ChunkInfo, axis: str = DEFAULT_AXIS) -> NamedSharding:
    """The sharding of ``chunk``'s 1-D array: ``P(axis)`` if sharded, replicated ``P()`` if keep-gathered."""
    return NamedSharding(mesh, P() if chunk.keep_gathered else P(axis))
