"""A brute-force simulation of ring and hierarchical collectives over explicit ranks.

Every message is a real numpy block moved from one rank to another, step by step; each transfer is
recorded as ``(src_rank, dst_rank, nbytes)``. The results are checked against numpy (the gathered
buffer, the summed shards), so the byte counts are those of a working algorithm. Nothing here uses
the cost model's formulas.
"""

from __future__ import annotations

import numpy as np

Transfer = tuple[int, int, int]


def ring_all_gather(ranks: list[int], parts: list[np.ndarray], log: list[Transfer]) -> list[list[np.ndarray]]:
    """Ring all-gather: position ``i`` starts with ``parts[i]``; returns every position's list of all parts."""
    n = len(ranks)
    have = [{i: parts[i]} for i in range(n)]
    for step in range(n - 1):
        msgs = [(i, (i + 1) % n, (i - step) % n) for i in range(n)]
        for src, dst, b in msgs:
            data = have[src][b]
            have[dst][b] = data
            log.append((ranks[src], ranks[dst], data.nbytes))
    return [[have[i][b] for b in range(n)] for i in range(n)]


def ring_reduce_scatter(ranks: list[int], pieces: list[list[np.ndarray]], log: list[Transfer]) -> list[np.ndarray]:
    """Ring reduce-scatter: position ``i`` contributes ``pieces[i][b]`` for every block ``b``; returns the sum
    over positions of block ``i`` at position ``i``."""
    n = len(ranks)
    acc = [[p.copy() for p in pieces[i]] for i in range(n)]
    for step in range(n - 1):
        msgs = [(i, (i + 1) % n, (i - step - 1) % n) for i in range(n)]
        sent = [(src, dst, b, acc[src][b].copy()) for src, dst, b in msgs]
        for src, dst, b, data in sent:
            acc[dst][b] += data
            log.append((ranks[src], ranks[dst], data.nbytes))
    return [acc[i][i] for i in range(n)]


def ring_all_reduce(ranks: list[int], buffers: list[np.ndarray], log: list[Transfer]) -> list[np.ndarray]:
    """Reduce-scatter then all-gather, both rings."""
    n = len(ranks)
    shards = ring_reduce_scatter(ranks, [np.split(b, n) for b in buffers], log)
    return [np.concatenate(p) for p in ring_all_gather(ranks, shards, log)]


def hierarchical_all_gather(
    ranks: list[int], shards: list[np.ndarray], per_node: int, log: list[Transfer]
) -> list[np.ndarray]:
    """Across nodes first (ranks with the same place in their node), then within each node."""
    n = len(ranks)
    k = n // per_node
    bundles: dict[int, list[tuple[int, np.ndarray]]] = {}
    for local in range(per_node):
        pos = [a * per_node + local for a in range(k)]
        got = ring_all_gather([ranks[p] for p in pos], [shards[p] for p in pos], log)
        for j, p in enumerate(pos):
            bundles[p] = [(pos[b], got[j][b]) for b in range(k)]
    out = [None] * n
    for a in range(k):
        pos = [a * per_node + local for local in range(per_node)]
        flat = [np.concatenate([blk for _, blk in bundles[p]]) for p in pos]
        got = ring_all_gather([ranks[p] for p in pos], flat, log)
        for j, p in enumerate(pos):
            blocks = {}
            for local, arr in enumerate(got[j]):
                for (idx, _), piece in zip(bundles[pos[local]], np.split(arr, k)):
                    blocks[idx] = piece
            out[p] = np.concatenate([blocks[b] for b in range(n)])
    return out


def hierarchical_reduce_scatter(
    ranks: list[int], buffers: list[np.ndarray], per_node: int, log: list[Transfer]
) -> list[np.ndarray]:
    """Within each node first (piece ``l`` = the blocks of the ranks at place ``l``), then across nodes."""
    n = len(ranks)
    k = n // per_node
    blocks = [np.split(b, n) for b in buffers]
    node_sums: dict[int, np.ndarray] = {}
    for a in range(k):
        pos = [a * per_node + local for local in range(per_node)]
        pieces = [
            [np.concatenate([blocks[p][b * per_node + local] for b in range(k)]) for local in range(per_node)]
            for p in pos
        ]
        got = ring_reduce_scatter([ranks[p] for p in pos], pieces, log)
        for j, p in enumerate(pos):
            node_sums[p] = got[j]
    out = [None] * n
    for local in range(per_node):
        pos = [a * per_node + local for a in range(k)]
        got = ring_reduce_scatter([ranks[p] for p in pos], [np.split(node_sums[p], k) for p in pos], log)
        for j, p in enumerate(pos):
            out[p] = got[j]
    return out


def groups_of(kind: str, group_size: int, world_size: int) -> list[list[int]]:
    """Shard groups (contiguous ranks) or replica groups (strided ranks) covering the world."""
    if kind == "shard":
        return [list(range(s, s + group_size)) for s in range(0, world_size, group_size)]
    stride = world_size // group_size
    return [list(range(i, world_size, stride)) for i in range(stride)]


def simulate(kind: str, buffer_numel: int, group: str, group_size: int, world_size: int, gpus_per_node: int,
             algorithm: str = "ring", seed: int = 0) -> tuple[float, float]:
    """Run one collective of ``buffer_numel`` float32 elements over every group; check its result with
    numpy; return the mean bytes sent per rank on ``(intra-node, inter-node)`` links."""
    rng = np.random.default_rng(seed)
    log: list[Transfer] = []
    for ranks in groups_of(group, group_size, world_size):
        n = len(ranks)
        if kind == "all-gather":
            full = rng.standard_normal(buffer_numel).astype(np.float32)
            shards = np.split(full, n)
            if algorithm == "hierarchical" and n > gpus_per_node:
                got = hierarchical_all_gather(ranks, shards, gpus_per_node, log)
            else:
                got = [np.concatenate(p) for p in ring_all_gather(ranks, shards, log)]
            for g in got:
                np.testing.assert_array_equal(g, full)
        else:
            buffers = [rng.standard_normal(buffer_numel).astype(np.float32) for _ in ranks]
            total = np.sum(buffers, axis=0)
            if kind == "all-reduce":
                for g in ring_all_reduce(ranks, buffers, log):
                    np.testing.assert_allclose(g, total, rtol=1e-5, atol=1e-5)
            else:
                if algorithm == "hierarchical" and n > gpus_per_node:
                    got = hierarchical_reduce_scatter(ranks, buffers, gpus_per_node, log)
                else:
                    got = ring_reduce_scatter(ranks, [np.split(b, n) for b in buffers], log)
                for i, g in enumerate(got):
                    np.testing.assert_allclose(g, np.split(total, n)[i], rtol=1e-5, atol=1e-5)
    intra = sum(b for s, d, b in log if s // gpus_per_node == d // gpus_per_node)
    inter = sum(b for s, d, b in log if s // gpus_per_node != d // gpus_per_node)
    return intra / world_size, inter / world_size
