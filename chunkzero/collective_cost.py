"""What one collective costs on a two-level network: bytes per rank on each link level, and time.

The network has ``N`` nodes of ``G`` GPUs; rank ``r`` is on node ``r // G`` (torchrun's rank order).
Every GPU has an **intra-node** link (NVLink) and an **inter-node** link (its own NIC), each with a
bandwidth per direction (bytes/s) and a latency per message (s).

A collective runs over **groups** of ranks; every rank is in exactly one group of a kind:

- ``"shard"`` groups: contiguous ranks ``[g·S, (g+1)·S)`` (``S = W`` is the whole world, ``S = G``
  one node);
- ``"replica"`` groups: strided ranks ``{i, i+S, i+2S, …}`` — the ranks holding the same shard, one
  per shard group.

Algorithms (Patarasuk & Yuan 2009 for the ring; NCCL's ring order, one node after the other):

- **ring** over ``n`` ranks in rank order: every step each rank sends ``buffer/n`` bytes to its
  successor, for ``n−1`` steps (all-gather, reduce-scatter) or ``2(n−1)`` (all-reduce = reduce-scatter
  then all-gather). A link between two nodes is a **crossing**; a ring spanning ``k > 1`` nodes in rank
  order has ``k`` crossings. Bytes per rank on a level are the mean over ranks — as NCCL spreads its
  channels' crossings over every NIC of a node, so each NIC carries the mean.
- **hierarchical** all-gather / reduce-scatter over ``k`` nodes × ``g`` ranks each: a reduce-scatter is
  a ring reduce-scatter inside each node (``(g−1)/g·buffer`` intra) then a ring reduce-scatter of the
  ``buffer/g`` piece among the ``k`` ranks with the same place in their node (``(k−1)/k·buffer/g``
  inter); an all-gather is the reverse. Fewer steps on the slow level: ``g−1`` intra and ``k−1`` inter
  instead of ``n−1`` ring steps each paying the inter-node latency.

Time (the alpha-beta model): a ring's levels run at once, so its bandwidth term is the slower level's
``max(intra_bytes/B_intra, inter_bytes/B_inter)``, and each of its steps pays the latency of its slowest
hop (inter-node when it crosses a node). A hierarchical collective runs its phases one after the
other: ``intra_bytes/B_intra + inter_bytes/B_inter`` plus each phase's steps times its latency.

Every byte figure here is bytes **sent per rank** (the ring sends as much as it receives), for one
collective of a ``buffer_bytes`` buffer (the all-gather's output, the reduce-scatter's input, the
all-reduce's operand).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

KINDS = ("all-gather", "reduce-scatter", "all-reduce")
"""Collective kinds, spelled as XLA's HLO spells them."""
ALGORITHMS = ("ring", "hierarchical")
"""``"ring"`` everywhere, or ``"hierarchical"`` for the all-gathers and reduce-scatters of groups spanning
several nodes (all-reduces stay rings)."""
GROUPS = ("shard", "replica")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ConfigError(f"collective kind must be one of {KINDS}, got {kind!r}")
    return kind


def ring_steps(kind: str, group_size: int) -> int:
    """Steps of a ring over ``group_size`` ranks: ``n−1`` (all-gather, reduce-scatter), ``2(n−1)`` (all-reduce)."""
    n = _positive("group_size", group_size)
    return 2 * (n - 1) if _kind(kind) == "all-reduce" else n - 1


def ring_link_bytes(kind: str, buffer_bytes: float, group_size: int) -> float:
    """Bytes one link of the ring carries over the whole collective: ``steps · buffer_bytes / n``.

    It is also what each rank sends: ``(n−1)/n·buffer`` (all-gather, reduce-scatter) or
    ``2(n−1)/n·buffer`` (all-reduce), the accounting of the ZeRO paper and :mod:`chunkzero.cost`."""
    return ring_steps(kind, group_size) * buffer_bytes / group_size


def nodes_spanned(ranks_first: int, ranks_last: int, gpus_per_node: int) -> int:
    """Nodes holding ranks ``ranks_first .. ranks_last`` when no node in between is skipped."""
    return ranks_last // gpus_per_node - ranks_first // gpus_per_node + 1


def group_crossings(group: str, group_size: int, world_size: int, gpus_per_node: int) -> float:
    """Mean number of node crossings of a ring over one group of kind ``group`` (see the module docstring).

    A ring over ranks in increasing order spanning ``k`` nodes crosses ``k`` times if ``k > 1``, else never.
    ``"shard"`` groups are ``[g·n, (g+1)·n)``; ``"replica"`` groups ``{i, i+S, …}`` with ``S = W/n``.

    Raises:
        ConfigError: ``group_size`` does not divide ``world_size``, or a bad count.
    """
    n, w, g = (
        _positive(k, v)
        for k, v in (("group_size", group_size), ("world_size", world_size), ("gpus_per_node", gpus_per_node))
    )
    if w % n:
        raise ConfigError(f"group_size {n} does not divide world_size {w}")
    if group not in GROUPS:
        raise ConfigError(f"group must be one of {GROUPS}, got {group!r}")
    total = 0
    if group == "shard":
        starts = range(0, w, n)
        spans = [nodes_spanned(s, s + n - 1, g) for s in starts]
    else:
        stride = w // n
        starts = range(stride)
        if stride >= g:  # consecutive members on different nodes
            spans = [n] * stride
        else:            # steps of stride < G: no node skipped
            spans = [nodes_spanned(i, i + (n - 1) * stride, g) for i in starts]
    total = sum(k for k in spans if k > 1)
    return total / len(spans)


@dataclass(frozen=True)
class CollectiveCost:
    """One collective on the two-level network, per rank.

    Attributes:
        intra_bytes, inter_bytes: bytes sent per rank on intra-node and inter-node links.
        intra_steps, inter_steps: message steps paying the intra-node / inter-node latency.
        concurrent: the levels run at once (ring: ``max`` of their times), else one after the other.
    """

    intra_bytes: float
    inter_bytes: float
    intra_steps: int
    inter_steps: int
    concurrent: bool

    @property
    def total_bytes(self) -> float:
        return self.intra_bytes + self.inter_bytes

    def time_s(self, intra_bytes_per_s: float, inter_bytes_per_s: float, intra_latency_s: float,
               inter_latency_s: float) -> float:
        """Seconds: bandwidth terms (``max`` when concurrent, else the sum) plus steps times latency."""
        a = self.intra_bytes / intra_bytes_per_s
        b = self.inter_bytes / inter_bytes_per_s
        return (
            (max(a, b) if self.concurrent else a + b)
            + self.intra_steps * intra_latency_s
            + self.inter_steps * inter_latency_s
        )


def ring_cost(kind: str, buffer_bytes: float, group: str, group_size: int, world_size: int,
              gpus_per_node: int) -> CollectiveCost:
    """A ring collective of ``buffer_bytes`` over every group of kind ``group`` (size ``group_size``).

    Per rank: ``ring_link_bytes`` in all, of which ``crossings/n`` on inter-node links (the mean over
    ranks, :func:`group_crossings`). Every step pays the inter-node latency if the ring crosses a node.
    """
    n = group_size
    link = ring_link_bytes(kind, buffer_bytes, n)
    crossings = group_crossings(group, n, world_size, gpus_per_node)
    inter = crossings / n * link
    steps = ring_steps(kind, n)
    crosses = crossings > 0
    return CollectiveCost(link - inter, inter, 0 if crosses else steps, steps if crosses else 0, True)


def hierarchical_cost(kind: str, buffer_bytes: float, group_size: int, world_size: int,
                      gpus_per_node: int) -> CollectiveCost:
    """A hierarchical all-gather or reduce-scatter over contiguous (``"shard"``) groups of ``group_size``.

    A group within one node is a plain ring there. A group of ``k`` whole nodes (``G`` divides ``n``):
    intra ``(G−1)/G·buffer`` in ``G−1`` steps, inter ``(k−1)/k·buffer/G`` in ``k−1`` steps, one phase
    after the other.

    Raises:
        ConfigError: an all-reduce (rings only), or groups that hold part of a node and span several
            (``n`` neither divides nor is a multiple of ``G``).
    """
    if _kind(kind) == "all-reduce":
        raise ConfigError("the hierarchical form is for all-gather and reduce-scatter; all-reduce is a ring")
    n, g = _positive("group_size", group_size), _positive("gpus_per_node", gpus_per_node)
    if group_crossings("shard", n, world_size, g) == 0:
        return ring_cost(kind, buffer_bytes, "shard", n, world_size, g)
    if n % g:
        raise ConfigError(f"a hierarchical collective needs whole nodes: group size {n} is not a multiple of "
                          f"{g} GPUs per node")
    k = n // g
    return CollectiveCost((g - 1) / g * buffer_bytes, (k - 1) / k * buffer_bytes / g, g - 1, k - 1, False)


def collective_cost(kind: str, buffer_bytes: float, group: str, group_size: int, world_size: int,
                    gpus_per_node: int, algorithm: str = "ring") -> CollectiveCost:
    """The cost of one collective with ``algorithm`` (:data:`ALGORITHMS`): hierarchical applies to
    all-gathers and reduce-scatters of ``"shard"`` groups; everything else is a ring.

    Raises:
        ConfigError: an unknown algorithm, kind or group, or sizes that do not fit (see the callees).
    """
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "hierarchical" and kind != "all-reduce" and group == "shard":
        return hierarchical_cost(kind, buffer_bytes, group_size, world_size, gpus_per_node)
    return ring_cost(kind, buffer_bytes, group, group_size, world_size, gpus_per_node)


__all__ = ["ALGORITHMS", "CollectiveCost", "GROUPS", "KINDS", "collective_cost", "group_crossings",
           "hierarchical_cost", "nodes_spanned", "ring_cost", "ring_link_bytes", "ring_steps"]
