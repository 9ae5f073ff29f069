"""Every reduce-scatter of the JAX steps, in one function: :func:`reduce_scatter_sum`.

Inside ``jax.shard_map`` a reduce-scatter over the data axis is ``jax.lax.psum_scatter(tiled=True)``.
On CPU across processes XLA runs it over gloo, where a reported bug (jax-ml/jax#40830) gave wrong
values at the end of rank 0's block for 4 MiB float64 blocks. So every call goes through
:func:`reduce_scatter_sum`, which runs one of two methods:

- ``"psum_scatter"`` (the default): XLA's reduce-scatter;
- ``"all_to_all"``: the input cut into ``W`` blocks along the scatter dimension, one
  ``all_to_all`` (device ``r`` receives block ``r`` of every device) and a local sum — what the torch
  engine does on gloo (:func:`torch_backend.zero.collectives.reduce_scatter_avg`).

The method in use is :func:`reduce_scatter_method`: the environment variable
``CHUNKZERO_JAX_REDUCE_SCATTER`` if set, else ``"all_to_all"`` in a multi-process CPU run (gloo: the bug
above, and a check at start-up found ``psum_scatter`` wrong at a 1 MiB fp32 block on some starts of one job
and right on others, so no start-up check can clear it; one fixed method also keeps the compiled step the
same from start to start, for the persistent compilation cache), else ``"psum_scatter"``.
:func:`check_reduce_scatter` runs both on a mesh at given block sizes with values whose sums are exact in
any order and compares them with ``psum`` plus a slice (``tests/jax/test_multiprocess.py``). The method is
read when a step is traced.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkzero.errors import ConfigError

from .mesh import DEFAULT_AXIS, mesh_world_size

METHODS = ("psum_scatter", "all_to_all")
ENV_METHOD = "CHUNKZERO_JAX_REDUCE_SCATTER"
"""The environment variable that forces a method (one of :data:`METHODS`)."""



def reduce_scatter_method() -> str:
    """The method :func:`reduce_scatter_sum` uses now (see the module docstring).

    Raises:
        ConfigError: ``CHUNKZERO_JAX_REDUCE_SCATTER`` names no method of :data:`METHODS`.
    """
    forced = os.environ.get(ENV_METHOD)
    if forced:
        if forced not in METHODS:
            raise ConfigError(f"{ENV_METHOD}={forced!r}: expected one of {', '.join(METHODS)}")
        return forced
    return "all_to_all" if jax.process_count() > 1 and jax.default_backend() == "cpu" else "psum_scatter"


def reduce_scatter_sum(x: jax.Array, axis: str, *, scatter_dimension: int = 0, method: str | None = None) -> jax.Array:
    """Inside ``shard_map``: the sum of ``x`` over the devices of ``axis``, of which this device keeps
    block ``r`` (its index along ``axis``) of ``W`` equal blocks along ``scatter_dimension`` —
    ``psum_scatter(x, axis, scatter_dimension=d, tiled=True)``.

    Args:
        x: this device's array; ``x.shape[d]`` must be divisible by ``W``.
        method: one of :data:`METHODS`; default :func:`reduce_scatter_method`.

    Returns:
        An array of ``x``'s dtype, ``x.shape`` with ``x.shape[d] / W`` at ``d``.

    Raises:
        ConfigError: an unknown ``method``, or ``x.shape[d]`` not divisible by ``W``.
    """
    method = method or reduce_scatter_method()
    if method not in METHODS:
        raise ConfigError(f"reduce-scatter method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "psum_scatter":
        return jax.lax.psum_scatter(x, axis, scatter_dimension=scatter_dimension, tiled=True)
    world = jax.lax.axis_size(axis)
    d = scatter_dimension
    if x.shape[d] % world:
        raise ConfigError(f"reduce-scatter: dimension {d} of shape {x.shape} is not divisible by {world} devices")
    blocks = x.reshape(x.shape[:d] + (world, x.shape[d] // world) + x.shape[d + 1:])
    received = jax.lax.all_to_all(blocks, axis, split_axis=d, concat_axis=d)  # [j] = block r of device j
    return jnp.sum(received, axis=d, dtype=x.dtype)


def _exact_values(numel: int, rank: int, dtype) -> np.ndarray:
    """Small integers (exact sums in any order, in fp32 and fp64) that differ per position and rank."""
    return (((np.arange(numel, dtype=np.int64) * 7 + rank * 13) % 61) - 30).astype(dtype)


def check_reduce_scatter(mesh: Mesh, block_bytes: Iterable[int], dtypes: Iterable = (jnp.float32,), *,
                         axis: str = DEFAULT_AXIS) -> list[dict]:
    """Compare both methods of :func:`reduce_scatter_sum` with ``psum`` plus a slice on ``mesh``, for each
    per-device input size in ``block_bytes`` (bytes; rounded down to a multiple of ``W`` elements)
    and dtype. Collective over every process of ``mesh``; all must call it alike.

    Returns:
        One record per case: ``{"dtype", "block_bytes", "numel", "psum_scatter_ok", "all_to_all_ok",
        "psum_scatter_max_error", "first_bad_index"}`` (this process's devices; the verdicts are agreed
        across processes).

    Raises:
        ConfigError: ``all_to_all`` is wrong (the method multi-process CPU runs use).
    """
    world = mesh_world_size(mesh, axis)
    sharding = NamedSharding(mesh, P(axis))
    order = list(mesh.devices.reshape(-1))
    records = []
    for dtype in dtypes:
        dtype = jnp.dtype(dtype)
        for nbytes in block_bytes:
            numel = max(world, (int(nbytes) // dtype.itemsize) // world * world)
            local = {d: jax.device_put(_exact_values(numel, order.index(d), dtype), d)
                     for d in mesh.local_devices}
            x = jax.make_array_from_single_device_arrays((numel * world,), sharding,
                                                         [local[d] for d in mesh.local_devices])

            def body(v):
                r = jax.lax.axis_index(axis)
                whole = jax.lax.psum(v, axis)
                want = jax.lax.dynamic_slice_in_dim(whole, r * (numel // world), numel // world)  # noqa: B023 - traced in this iteration
                a = reduce_scatter_sum(v, axis, method="psum_scatter")
                b = reduce_scatter_sum(v, axis, method="all_to_all")
                bad_a = jnp.abs(a - want)
                first = jnp.where(jnp.any(bad_a > 0), jnp.argmax(bad_a > 0), -1)
                out_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32  # noqa: B023 - traced in this iteration
                bad = jnp.stack([jnp.max(bad_a).astype(out_dtype), jnp.max(jnp.abs(b - want)).astype(out_dtype)])
                worst = jax.lax.pmax(bad, axis)
                return worst.reshape(1, 2), jax.lax.pmax(first, axis).reshape(1)

            fn = jax.jit(
                jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=(P(axis), P(axis)), check_vma=False)
            )
            worst, first = fn(x)
            w = np.asarray(worst.addressable_shards[0].data)[0]
            f = int(np.asarray(first.addressable_shards[0].data)[0])
            records.append({"dtype": dtype.name, "block_bytes": numel * dtype.itemsize, "numel": numel,
                            "psum_scatter_ok": bool(w[0] == 0), "all_to_all_ok": bool(w[1] == 0),
                            "psum_scatter_max_error": float(w[0]), "first_bad_index": f})
    if any(not r["all_to_all_ok"] for r in records):
        bad = next(r for r in records if not r["all_to_all_ok"])
        raise ConfigError(
            f"reduce-scatter check: all_to_all + local sum, the method of multi-process CPU runs, is wrong ({bad})"
        )
    return records


__all__ = ["ENV_METHOD", "METHODS", "check_reduce_scatter", "reduce_scatter_method", "reduce_scatter_sum"]
