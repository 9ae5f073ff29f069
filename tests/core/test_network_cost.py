"""The two-level cost model against hand-computed cases and against a brute-force simulation of the
collectives over explicit ranks (tests/core/ring_sim.py), counting bytes per link level."""

from __future__ import annotations

import pytest

from chunkzero import ChunkLayout, ConfigError, TensorSpec
from chunkzero.collective_cost import collective_cost, group_crossings, ring_link_bytes
from chunkzero.configs import model_specs, param_numel
from chunkzero.network_cost import (
    Topology,
    compare_network,
    compute_time_s,
    format_network_table,
    hiding_tokens,
    step_comm,
)

from .ring_sim import groups_of, simulate

F32 = 4


def test_ring_by_hand():
    """All-gather of 3200 B over 16 ranks, 2 nodes of 8: 15 steps of 200 B on each of 16 links, 2 of
    which cross nodes: per rank 3000 B, of which 2/16 inter = 375 B, intra 2625 B; latency 15 inter steps."""
    c = collective_cost("all-gather", 3200, "shard", 16, 16, 8)
    assert (c.intra_bytes, c.inter_bytes, c.intra_steps, c.inter_steps) == (2625, 375, 0, 15)
    # 2625 / 100 vs 375 / 10 -> inter-bound 37.5 s, + 15 · 2 s
    assert c.time_s(100, 10, 1, 2) == pytest.approx(37.5 + 30)
    # within a node: no crossing, intra latency
    c = collective_cost("all-gather", 3200, "shard", 8, 16, 8)
    assert (c.intra_bytes, c.inter_bytes, c.intra_steps, c.inter_steps) == (2800, 0, 7, 0)
    # all-reduce of 400 B across the 2 replicas {i, i+8}: 2 steps of 200 B on 2 crossing links
    c = collective_cost("all-reduce", 400, "replica", 2, 16, 8)
    assert (c.intra_bytes, c.inter_bytes, c.inter_steps) == (0, 400, 2)
    assert ring_link_bytes("all-reduce", 400, 2) == 400


def test_hierarchical_by_hand():
    """Reduce-scatter of 6400 B over 4 nodes × 8: intra 7/8·6400 = 5600 B in 7 steps, then inter
    3/4·800 = 600 B in 3 steps, one after the other."""
    c = collective_cost("reduce-scatter", 6400, "shard", 32, 32, 8, "hierarchical")
    assert (c.intra_bytes, c.inter_bytes, c.intra_steps, c.inter_steps, c.concurrent) == (5600, 600, 7, 3, False)
    assert c.time_s(100, 10, 1, 2) == pytest.approx(56 + 60 + 7 + 6)
    with pytest.raises(ConfigError, match="whole nodes"):
        collective_cost("all-gather", 1200, "shard", 12, 24, 8, "hierarchical")
    with pytest.raises(ConfigError, match="all-reduce is a ring"):
        from chunkzero.collective_cost import hierarchical_cost

        hierarchical_cost("all-reduce", 1200, 16, 16, 8)


def test_crossings_by_hand():
    # 24 ranks, 8 per node, shard groups of 12: [0,12) spans nodes 0-1, [12,24) spans 1-2 -> 2 crossings each
    assert group_crossings("shard", 12, 24, 8) == 2
    # shard groups of 4 inside nodes: none
    assert group_crossings("shard", 4, 24, 8) == 0
    # replica groups of stride 2 over 16 ranks on 2 nodes: {0,2,..,14} spans 2 nodes -> 2
    assert group_crossings("replica", 8, 16, 8) == 2
    # replica groups of stride 8 over 32 ranks: 4 members on 4 nodes -> 4
    assert group_crossings("replica", 4, 32, 8) == 4


CASES = [  # (kind, group, group size, world, gpus per node, algorithm)
    ("all-gather", "shard", 16, 16, 8, "ring"),
    ("reduce-scatter", "shard", 16, 16, 8, "ring"),
    ("all-gather", "shard", 4, 16, 8, "ring"),
    ("reduce-scatter", "shard", 8, 24, 4, "ring"),
    ("all-gather", "shard", 6, 24, 4, "ring"),       # groups straddling nodes unevenly
    ("all-reduce", "replica", 4, 16, 4, "ring"),     # one member per node
    ("all-reduce", "replica", 8, 16, 4, "ring"),     # two members per node
    ("all-reduce", "shard", 12, 12, 4, "ring"),
    ("all-reduce", "replica", 3, 12, 2, "ring"),
    ("all-gather", "shard", 16, 16, 4, "hierarchical"),
    ("reduce-scatter", "shard", 16, 16, 4, "hierarchical"),
    ("reduce-scatter", "shard", 8, 24, 4, "hierarchical"),
    ("all-gather", "shard", 2, 8, 4, "hierarchical"),  # inside a node: a ring
]


@pytest.mark.parametrize("kind,group,n,w,g,algorithm", CASES)
def test_matches_simulation(kind, group, n, w, g, algorithm):
    numel = 2 * n * n  # divisible by every split the algorithms make
    sim_intra, sim_inter = simulate(kind, numel, group, n, w, g, algorithm)
    c = collective_cost(kind, numel * F32, group, n, w, g, algorithm)
    assert (c.intra_bytes, c.inter_bytes) == pytest.approx((sim_intra, sim_inter), rel=1e-12)


def test_simulation_counts_levels():
    """The simulation's own check: a ring inside one node sends nothing across nodes; the same ring with
    1 GPU per node sends everything across."""
    assert simulate("all-gather", 32, "shard", 4, 4, 4)[1] == 0
    assert simulate("all-gather", 32, "shard", 4, 4, 1)[0] == 0
    assert groups_of("replica", 2, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _small_layout(world: int):
    specs = [TensorSpec("a", (48, 4)), TensorSpec("b", (64,)), TensorSpec("c", (128,), keep_gathered=True),
             TensorSpec("f", (40,), requires_grad=False)]
    return specs, ChunkLayout.build(specs, 256, world)


def _simulated_step(result, topo: Topology) -> tuple[float, float]:
    intra = inter = 0.0
    for c in result.calls:
        assert c.buffer_bytes % (F32 * c.group_size) == 0
        i, e = simulate(c.kind, c.buffer_bytes // F32, c.group, c.group_size, topo.world_size, topo.gpus_per_node,
                        result.algorithm)
        intra, inter = intra + c.count * i, inter + c.count * e
    return intra, inter


@pytest.mark.parametrize("nodes,g,algorithm", [(2, 4, "ring"), (4, 2, "ring"), (2, 4, "hierarchical")])
def test_step_matches_simulation(nodes, g, algorithm):
    """A whole step of every strategy on a small layout (a frozen chunk, a keep-gathered one), fp32:
    the model's bytes per level equal the simulation of its calls; and the calls are the strategy's."""
    topo = Topology(nodes, g)
    w = topo.world_size
    specs, layout = _small_layout(w)
    for s in [1, 2, 4, 8]:
        r = step_comm("hybrid", layout, topo, shard_group_size=s, precision="fp32", algorithm=algorithm)
        assert (r.intra_bytes, r.inter_bytes) == pytest.approx(_simulated_step(r, topo), rel=1e-12)
    for strategy in ("zero3", "hpz"):
        r = step_comm(strategy, layout, topo, precision="fp32", algorithm=algorithm)
        assert (r.intra_bytes, r.inter_bytes) == pytest.approx(_simulated_step(r, topo), rel=1e-12)


def test_strategy_calls_by_hand():
    """One trainable chunk of 1600 bf16 elements (3200 B), 2 nodes × 8.

    flat: 2 all-gathers + 1 reduce-scatter over 16: 3 × (2625 intra, 375 inter).
    hybrid S=8: the same three within the node (3 × 2800 intra), then the 400 B shard all-reduced
      over 2 replicas on 2 nodes: 400 inter.
    hpZ: world all-gather and reduce-scatter (2 × 2625 / 375) + the backward all-gather in the node (2800).
    DDP: one 3200 B all-reduce over 16: 6000 B, 2/16 of it inter.
    """
    specs = [TensorSpec("a", (1600,))]
    layout = ChunkLayout.build(specs, 1600, 16)
    topo = Topology(2, 8)
    got = {
        r.name: (r.intra_bytes, r.inter_bytes)
        for r in compare_network(specs, topo, layout=layout, shard_group_sizes=[8])
    }
    assert got == {"zero3": (7875, 1125), "hybrid S=8": (8400, 400), "hpz": (8050, 750), "ddp": (5250, 750)}
    hybrid = step_comm("hybrid", layout, topo, shard_group_size=8)
    assert hybrid.counts() == {("all-gather", 8): 2, ("reduce-scatter", 8): 1, ("all-reduce", 2): 1}
    assert (hybrid.shard_group_size, hybrid.replicas) == (8, 2)
    # model states: bf16 param + grad + fp32 master + Adam = 16 B per element of the 200-element shard
    assert hybrid.model_state_bytes == 16 * 200
    assert step_comm("zero3", layout, topo).model_state_bytes == 16 * 100
    assert step_comm("hpz", layout, topo).model_state_bytes == 16 * 100 + 2 * 200  # + the bf16 secondary partition


def test_hybrid_ends_are_flat_and_ddp():
    """S = W is flat ZeRO-3 exactly; S = 1 is DDP with the chunks as buckets (same bytes as DDP's when
    one bucket holds it all)."""
    specs = model_specs("gpt-mini")
    topo = Topology(2, 4, inter_latency_s=3e-6)
    layout = ChunkLayout.build(specs, 2**30, 8)  # one chunk per group: one bucket-sized chunk
    flat = step_comm("zero3", layout, topo)
    full = step_comm("hybrid", layout, topo, shard_group_size=8)
    assert (full.calls, full.intra_bytes, full.inter_bytes, full.time_s) == (
        flat.calls,
        flat.intra_bytes,
        flat.inter_bytes,
        flat.time_s,
    )
    one = step_comm("hybrid", layout, topo, shard_group_size=1)
    ddp = step_comm("ddp", layout, topo, specs=specs)
    assert {c.kind for c in one.calls} == {"all-reduce"}
    assert sum(c.buffer_bytes * c.count for c in one.calls) == layout.total_numel * 2
    assert one.inter_bytes == pytest.approx(ddp.inter_bytes * layout.total_numel / param_numel("gpt-mini"))


def test_hierarchical_cuts_latency_not_bytes_across_nodes():
    """At 1,024 GPUs the flat ring pays 1,023 inter-node latencies per collective; the hierarchical form
    7 + 127, with nearly the same inter-node bytes."""
    specs = model_specs("gpt-mini")
    topo = Topology.from_gbps(128, 8, inter_gbps=100)
    layout = ChunkLayout.build(specs, 2**20, 1024)
    ring = step_comm("zero3", layout, topo)
    hier = step_comm("zero3", layout, topo, algorithm="hierarchical")
    assert hier.time_s < ring.time_s
    assert hier.inter_bytes == pytest.approx(ring.inter_bytes, rel=0.01)
    assert hier.intra_bytes > ring.intra_bytes  # the ring sends 1/8 of its bytes across nodes, hierarchical 1/1024


def test_compute_and_hiding():
    assert compute_time_s(10**9, 1000, peak_flops=1e12, mfu=0.5) == pytest.approx(12.0)
    assert hiding_tokens(12.0, 10**9, peak_flops=1e12, mfu=0.5) == pytest.approx(1000)
    with pytest.raises(ConfigError, match="mfu"):
        compute_time_s(1, 1, mfu=0)


def test_table_and_bad_input():
    specs = model_specs("gpt-mini")
    topo = Topology(2, 4)
    rows = compare_network(specs, topo)
    assert [r.name for r in rows] == ["zero3", "hybrid S=2", "hybrid S=4", "hpz", "ddp"]
    text = format_network_table(rows, param_numel("gpt-mini"), tokens_per_gpu=1024, hbm_bytes=1e6)
    assert "| hybrid S=4 | 4 | 2 |" in text and "✗" in text and "tokens/GPU to hide" in text
    layout = rows[0].calls and ChunkLayout.build(specs, 2**20, 8)
    with pytest.raises(ConfigError, match="divisor of the world size 8"):
        step_comm("hybrid", layout, topo, shard_group_size=3)
    with pytest.raises(ConfigError, match="strategy must be"):
        step_comm("fsdp", layout, topo)
    with pytest.raises(ConfigError, match="algorithm"):
        step_comm("zero3", layout, topo, algorithm="tree")
    with pytest.raises(ConfigError, match="needs specs"):
        step_comm("ddp", layout, topo)
    with pytest.raises(ConfigError, match="gpus_per_node"):
        Topology(2, 0)
    with pytest.raises(ConfigError, match="inter_bytes_per_s"):
        Topology(2, 8, inter_bytes_per_s=0)
