"""Hybrid sharding's process groups: shard within a group of ranks, replicate across the groups.

``ZeroDDP(..., shard_group_size=S)`` on a data-parallel group of ``W = S · R`` ranks (HSDP in FSDP2's
terms, MiCS in DeepSpeed's). :class:`ShardingGroups` owns the two groups and answers every
"which group, which rank" question, so nothing else in the engine knows about the two levels:

- the **shard group** (*intra* level): ``S`` ranks with consecutive group ranks ``g·S … g·S+S-1``
  (under torchrun's rank order a node's GPUs), over which each chunk is sharded — the core
  :class:`chunkzero.ChunkLayout` for world size ``S``, whose rank is :attr:`ShardingGroups.shard_rank`;
- the **replica group** (*inter* level): the ``R`` ranks holding the same shard, one per shard group
  (group ranks ``q, q+S, …``), across which a reduced gradient shard is all-reduced.

A chunk's gradient is reduce-scattered over its shard group (summed), the shard then all-reduced over
its replica group (summed) and divided once by ``W`` (fp16: divided by ``W`` before both, as flat
ZeRO-3 does), so it is the mean over all ``W`` ranks. A keep-gathered chunk is all-reduced over the
shard group, then over the replica group. Gathers run within the shard group only.

``S = W`` is flat ZeRO-3: no new group, the shard group *is* the data-parallel group and
:attr:`ShardingGroups.replica_group` is ``None``, so every collective is exactly the flat one. ``S = 1`` is
DDP with chunked buckets: every chunk is whole on every rank (resident) and all-reduced over the
data-parallel group, again without a new group.

**Collective bytes.** :class:`CollectiveBytes` counts, per level, the payload of each chunk collective
(the full buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor) and the
bytes a rank sends under the ring algorithm (``(n-1)/n`` of the payload for an all-gather or a
reduce-scatter over ``n`` ranks, ``2(n-1)/n`` for an all-reduce), for comparison with a cost model.
Collectives that state dicts and checkpoints issue are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from chunkzero.errors import ConfigError

from .torch_internals import process_group_timeout

__all__ = ["CollectiveBytes", "ShardingGroups", "build_sharding_groups"]

INTRA, INTER = "intra", "inter"


@dataclass
class CollectiveBytes:
    """Bytes moved by the engine's chunk collectives on this rank, per level (``"intra"``: the shard
    group; ``"inter"``: the replica group): ``payload`` (the collectives' full buffers) and ``sent``
    (what a rank sends under the ring algorithm). All in bytes, since construction."""

    payload: dict[str, int] = field(default_factory=lambda: {INTRA: 0, INTER: 0})
    sent: dict[str, int] = field(default_factory=lambda: {INTRA: 0, INTER: 0})

    def add(self, level: str, kind: str, nbytes: int, ranks: int) -> None:
        """Count one collective of ``kind`` (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``)
        over ``ranks`` ranks with a payload of ``nbytes`` bytes (nothing for a single rank)."""
        if ranks <= 1:
            return
        self.payload[level] += nbytes
        factor = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
        self.sent[level] += nbytes * factor // ranks

    def as_stats(self) -> dict[str, int]:
        return {"intra_payload_bytes": self.payload[INTRA], "inter_payload_bytes": self.payload[INTER],
                "intra_sent_bytes": self.sent[INTRA], "inter_sent_bytes": self.sent[INTER]}


@dataclass
class ShardingGroups:
    """The data-parallel group split into shard groups of ``shard_group_size`` ranks and replica groups
    of ``replicas`` ranks (module docstring).

    Attributes:
        group: the data-parallel group (``None``: a single process).
        world_size, rank: its size ``W`` and this rank in it.
        shard_group_size: ``S``; ``replicas``: ``R = W / S``.
        shard_group: the process group of this rank's shard group (``group`` itself when ``S = W``;
            ``None`` when ``S = 1``).
        replica_group: the process group of this rank's replica group (``None`` when ``R = 1``; ``group``
            itself when ``S = 1``).
        shard_rank: this rank in its shard group (the layout's rank); ``replica_index``: which shard group.
        bytes: the chunk collectives' bytes counted so far (:class:`CollectiveBytes`).
    """

    group: object
    world_size: int
    rank: int
    shard_group_size: int
    shard_group: object
    replica_group: object
    bytes: CollectiveBytes = field(default_factory=CollectiveBytes)

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_group_size

    @property
    def shard_rank(self) -> int:
        return self.rank % self.shard_group_size

    @property
    def replica_index(self) -> int:
        return self.rank // self.shard_group_size

    @property
    def hybrid(self) -> bool:
        """Whether shards are replicated (``R > 1`` with ``S > 1``: two levels of groups). ``S = 1`` is one
        level: every chunk whole on every rank, all-reduced over the data-parallel group."""
        return self.replicas > 1 and self.shard_group_size > 1

    def count(self, level: str, kind: str, nbytes: int) -> None:
        """Count a chunk collective of ``nbytes`` payload on ``level`` (:class:`CollectiveBytes`)."""
        self.bytes.add(level, kind, nbytes, self.shard_group_size if level == INTRA else self.replicas)


def _check_size(shard_group_size, world_size: int) -> int:
    if shard_group_size is None:
        return world_size
    if isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int) or shard_group_size < 1:
        raise ConfigError(f"shard_group_size must be a positive int (ranks) or None, got {shard_group_size!r}")
    if world_size % shard_group_size:
        raise ConfigError(
            f"shard_group_size={shard_group_size} does not divide the data-parallel world size "
            f"{world_size} (W = S x R: pick S among {[s for s in range(1, world_size + 1) if world_size % s == 0]})"
        )
    return shard_group_size


def build_sharding_groups(group, shard_group_size: int | None) -> ShardingGroups:
    """The :class:`ShardingGroups` of ``group`` for ``shard_group_size`` ranks per shard group (``None``: the
    whole group, flat ZeRO-3). Collective over ``group`` when ``1 < S < W`` (every rank creates its own
    shard group and replica group; ranks outside ``group`` need not call it).

    Raises:
        ConfigError: ``shard_group_size`` is not a positive int dividing the world size (named).
    """
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    s = _check_size(shard_group_size, world)
    r = world // s
    if r == 1:
        return ShardingGroups(group, world, rank, s, group, None)
    if s == 1:
        return ShardingGroups(group, world, rank, s, None, group)
    ranks = dist.get_process_group_ranks(group)  # global ranks in group-rank order
    g, q = rank // s, rank % s
    timeout = process_group_timeout(group)
    kwargs = {"backend": dist.get_backend(group), "use_local_synchronization": True}
    if timeout is not None:
        kwargs["timeout"] = timeout
    shard_group = dist.new_group(ranks[g * s : (g + 1) * s], **kwargs)
    replica_group = dist.new_group(ranks[q::s], **kwargs)
    return ShardingGroups(group, world, rank, s, shard_group, replica_group)
