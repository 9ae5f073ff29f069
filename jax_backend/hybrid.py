"""Hybrid sharding on a 2-D mesh ``("replica", "shard")``: ZeRO-3 within a shard group, data parallel across.

The layout is the core's :class:`chunkzero.ChunkLayout` for world size ``S`` (the shard group size),
on a mesh of ``R × S`` devices (:func:`jax_backend.mesh.make_hybrid_mesh`): device ``(i, j)`` is rank
``i·S + j`` and holds shard ``j`` of every chunk, the same elements as rank ``j`` of a flat run at
world size ``S``, and every replica ``i`` holds the same shards. The batch is split over all ``R·S``
devices, replica-major.

Per step and per sharded chunk (the calls of :func:`chunkzero.network_cost.hybrid_calls`):

- forward and backward: ``all_gather`` within ``"shard"`` (``S`` devices);
- gradient: ``psum_scatter`` within ``"shard"`` to the device's gradient shard, then ``psum`` of
  that shard across ``"replica"`` (``R`` devices), so every replica applies the same update;
- a keep-gathered chunk: ``psum`` within ``"shard"``, then ``psum`` across ``"replica"`` (the two
  levels the torch engine reduces it on).

This is FSDP2's HSDP (placements ``(Replicate(), Shard(0))`` on a 2-D DeviceMesh) for chunks, and what
``ZeroDDP(..., shard_group_size=S)`` does in torch. ``S = W`` (``R = 1``) is flat ZeRO-3.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh

from chunkzero.errors import ConfigError
from chunkzero.layout import ChunkLayout

from .blocks import Program
from .mesh import REPLICA_AXIS, SHARD_AXIS
from .zero import ChunkUnit, ZeroTrainer


class HybridChunkUnit(ChunkUnit):
    """A :class:`ChunkUnit` whose gradient is also all-reduced across ``replica_axis``."""

    def __init__(self, layout: ChunkLayout, index: int, replica_axis: str):
        super().__init__(layout, index)
        self.replica_axis = replica_axis

    def reduce(self, grads, axis):
        if not self.sharded:  # the whole chunk: all-reduced within the shard group, then across replicas
            return jax.lax.psum(jax.lax.psum(self.full_grad(grads), axis), self.replica_axis)
        return jax.lax.psum(super().reduce(grads, axis), self.replica_axis)


class HybridZeroTrainer(ZeroTrainer):
    """ZeRO-3 within the ``"shard"`` axis, replicated across ``"replica"`` (see the module docstring).

    ```python
    mesh = make_hybrid_mesh(2, 4)                          # R = 2 replicas x S = 4 shards, 8 devices
    layout = build_layout(program.specs, 4)                # the layout at the shard group size
    trainer = HybridZeroTrainer(program, layout, mesh, optax.adamw(3e-4))
    state = trainer.init(program.init(0))
    state, loss = trainer.step(state, batch)               # batch: int32[B, T], B divisible by R*S
    ```

    Args:
        program, layout, mesh, tx: as :class:`ZeroTrainer`; ``layout.world_size`` must be the size of
            ``shard_axis``.
        shard_axis, replica_axis: the mesh's axis names (``"shard"``, ``"replica"``).
        kwargs: more :class:`ZeroTrainer` arguments (``mixed_precision``, ``max_norm``, ``donate``).

    Raises:
        ConfigError: the mesh lacks an axis, both names are the same, or the layout's world size is
            not the shard axis's size.
    """

    name = "chunk-zero3-hybrid"

    def __init__(self, program: Program, layout: ChunkLayout, mesh: Mesh, tx: optax.GradientTransformation, *,
                 shard_axis: str = SHARD_AXIS, replica_axis: str = REPLICA_AXIS, **kwargs):
        if shard_axis == replica_axis:
            raise ConfigError(f"shard_axis and replica_axis must differ, both are {shard_axis!r}")
        if "axis" in kwargs:
            raise ConfigError("HybridZeroTrainer takes shard_axis= and replica_axis=, not axis=")
        self._replica_axis_name = replica_axis
        super().__init__(program, layout, mesh, tx, axis=shard_axis, replica_axis=replica_axis, **kwargs)

    def _chunk_units(self, layout: ChunkLayout) -> list[ChunkUnit]:
        return [HybridChunkUnit(layout, c.index, self._replica_axis_name) for c in layout.chunks]

    @property
    def shard_group_size(self) -> int:
        """``S``: devices a chunk is sharded over."""
        return self.layout.world_size


__all__ = ["HybridChunkUnit", "HybridZeroTrainer"]
