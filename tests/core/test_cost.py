"""Cost model figures on hand-computed examples, and the ZeRO paper's formulas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkzero import ChunkLayout, ConfigError, TensorSpec
from chunkzero.configs import model_specs, transformer_block_unit
from chunkzero.cost import (
    chunk_zero3_cost,
    compare_strategies,
    ddp_buckets,
    ddp_cost,
    format_cost_table,
    fsdp_cost,
    fsdp_shard_numel,
    zero_paper_model_state_bytes,
    zero_paper_wire_bytes,
)
from chunkzero.search import build_layout

from .strategies import spec_lists


def test_chunk_zero3_by_hand():
    """a(6) b(4) c(10), capacity 10, W=2, bf16 + Adam.

    Chunks [a b] and [c], 10 elements each, shards of 5: each rank stores 10 elements.
      params 10·2 = 20 B, grads 10·2 = 20 B, fp32 master 10·4 = 40 B, Adam 10·4·2 = 80 B -> 160 B
      = 16·Ψ/W = 16·20/2.
      all-gather: 2 chunks × (forward + backward) × (W−1)·5·2 B = 40 B; reduce-scatter 2 × 1·5·2 = 20 B
      -> 60 B = (n−1)/n·Ψ·(2·2 + 2) = ½·20·6.
      peak gathered: two chunks' parameters (10 + 10)·2 = 40 B + one gradient chunk 10·2 = 20 B -> 60 B.
    """
    layout = ChunkLayout.build([TensorSpec("a", (2, 3)), TensorSpec("b", (4,)), TensorSpec("c", (10,))], 10, 2)
    c = chunk_zero3_cost(layout, "bf16", "adam")
    assert (c.param_bytes, c.grad_bytes, c.master_bytes, c.optimizer_state_bytes) == (20, 20, 40, 80)
    assert c.model_state_bytes == 160 == zero_paper_model_state_bytes(20, 2)
    assert (c.allgather_bytes, c.reduce_scatter_bytes, c.allreduce_bytes) == (40, 20, 0)
    assert c.comm_bytes == 60 == zero_paper_wire_bytes(20, 2)
    assert (c.num_allgathers, c.num_reduce_scatters, c.num_allreduces, c.num_collectives) == (4, 2, 0, 6)
    assert c.peak_gathered_bytes == 60 and c.peak_bytes == 220
    assert (c.param_numel, c.stored_numel, c.padding_numel, c.num_units) == (20, 10, 0, 2)
    # without resharding after forward: one all-gather per chunk, and both chunks stay gathered
    c = chunk_zero3_cost(layout, "bf16", "adam", reshard_after_forward=False, prefetch=0)
    assert (c.allgather_bytes, c.num_allgathers, c.peak_gathered_bytes) == (20, 2, 20 * 2 + 10 * 2)


def test_chunk_zero3_frozen_and_keep_gathered_by_hand():
    """a(5) trainable, f(4) frozen, k(3) keep-gathered; capacity 8, W=3, fp32 + SGD momentum.

    Chunks: 0 = [a] size 6 (shard 2), 1 = [f] size 6 (shard 2, frozen), 2 = [k] size 3 kept whole.
      stored 2 + 2 + 3 = 7 elements -> params 28 B; trainable 2 + 3 = 5 -> grads 20 B, no master
      (fp32), momentum 20 B.
      all-gather: chunks 0 and 1, 2 passes × 2 peers × 2 elements × 4 B = 32 B each -> 64 B (4 calls);
      reduce-scatter: chunk 0 only, 2 × 2 × 4 = 16 B; all-reduce: chunk 2, 2·(2/3)·3·4 = 16 B.
      padding 1 + 2 + 0 = 3; peak gathered (6 + 6)·4 + 6·4 = 72 B.
    """
    specs = [
        TensorSpec("a", (5,)),
        TensorSpec("f", (4,), requires_grad=False),
        TensorSpec("k", (3,), keep_gathered=True),
    ]
    layout = ChunkLayout.build(specs, 8, 3)
    assert [(ch.size, ch.keep_gathered, ch.requires_grad) for ch in layout.chunks] == [
        (6, False, True),
        (6, False, False),
        (3, True, True),
    ]
    c = chunk_zero3_cost(layout, "fp32", "sgd")
    assert (c.stored_numel, c.param_bytes, c.grad_bytes, c.master_bytes, c.optimizer_state_bytes) == (7, 28, 20, 0, 20)
    assert (c.allgather_bytes, c.reduce_scatter_bytes, c.allreduce_bytes) == (64, 16, 16)
    assert (c.num_allgathers, c.num_reduce_scatters, c.num_allreduces) == (4, 1, 1)
    assert (c.padding_numel, c.peak_gathered_bytes) == (3, 72)


def test_fsdp_by_hand():
    """Shapes (5, 2), (3,), () on W=3, bf16 + Adam, one unit per parameter (FSDP2 dim-0 padding).

      (5, 2): ceil(5/3) = 2 rows -> shard 4, padded 12;  (3,): shard 1, padded 3;  (): as (1,), shard 1,
      padded 3. stored 6 -> params 12 B, grads 12 B, master 24 B, Adam 48 B; padding 18 − 14 = 4.
      all-gather 2 passes × 2 peers × (4 + 1 + 1) elements × 2 B = 48 B in 6 calls; reduce-scatter
      2 × 6 × 2 = 24 B in 3 calls. Peak gathered: units 12 and 3 -> 15·2 + 12·2 = 54 B.
    """
    specs = [TensorSpec("w", (5, 2)), TensorSpec("b", (3,)), TensorSpec("s", ())]
    assert [fsdp_shard_numel(s.shape, 3) for s in specs] == [4, 1, 1]
    c = fsdp_cost(specs, 3, "bf16", "adam")
    assert (c.param_numel, c.stored_numel, c.padding_numel) == (14, 6, 4)
    assert (c.param_bytes, c.grad_bytes, c.master_bytes, c.optimizer_state_bytes) == (12, 12, 24, 48)
    assert (c.allgather_bytes, c.reduce_scatter_bytes, c.num_allgathers, c.num_reduce_scatters) == (48, 24, 6, 3)
    assert c.peak_gathered_bytes == 54
    # one unit for everything: the same bytes in 2 all-gathers and 1 reduce-scatter
    one = fsdp_cost(specs, 3, "bf16", "adam", unit_of=lambda name: "all")
    assert (one.allgather_bytes, one.reduce_scatter_bytes, one.num_allgathers, one.num_reduce_scatters) == (
        48,
        24,
        2,
        1,
    )
    assert one.peak_gathered_bytes == 18 * 2 + 18 * 2


def test_ddp_buckets_by_hand():
    """bf16 gradients, first cap 10 B then 20 B, reverse order p4 p3 | p2 p1 p0; frozen q excluded.

      p4 2 B -> p3 +12 = 14 >= 10: close [p4, p3]; p2 4 + p1 8 + p0 6 = 18 < 20: last bucket.
    """
    specs = [TensorSpec("p0", (3,)), TensorSpec("p1", (4,)), TensorSpec("q", (9,), requires_grad=False),
             TensorSpec("p2", (2,)), TensorSpec("p3", (6,)), TensorSpec("p4", (1,))]
    assert ddp_buckets(specs, 2, bucket_cap_bytes=20, first_bucket_bytes=10) == [["p4", "p3"], ["p2", "p1", "p0"]]


def test_ddp_by_hand():
    """Ψ = 16 on W = 4, bf16 + Adam: 16Ψ = 256 B replicated; all-reduce 2·(3/4)·16·2 = 48 B."""
    specs = [TensorSpec("a", (4, 2)), TensorSpec("b", (8,))]
    c = ddp_cost(specs, 4, "bf16", "adam")
    assert (c.param_bytes, c.grad_bytes, c.master_bytes, c.optimizer_state_bytes) == (32, 32, 64, 128)
    assert c.model_state_bytes == 16 * 16
    assert (c.allreduce_bytes, c.num_allreduces, c.allgather_bytes, c.peak_gathered_bytes) == (48, 1, 0, 0)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_zero_paper_16_psi_over_n(world_size):
    """hf-gpt2 and llama-1b layouts: model states are 16 bytes per stored element (mixed-precision Adam),
    and exactly 16Ψ/N_d where the layout has no padding; the wire is (n−1)/n·(Ψ + padding)·(2·2 + 2)."""
    for name in ("hf-gpt2", "llama-1b"):
        specs = model_specs(name)
        layout = build_layout(specs, world_size)
        c = chunk_zero3_cost(layout, "bf16", "adam")
        assert c.model_state_bytes == 16 * c.stored_numel
        assert c.stored_numel * world_size == layout.total_numel
        assert c.comm_bytes == zero_paper_wire_bytes(layout.total_numel, world_size)
        if layout.padding_numel == 0:
            assert c.model_state_bytes == zero_paper_model_state_bytes(layout.utilized_numel, world_size)
        ddp = ddp_cost(specs, world_size, "bf16", "adam")
        assert ddp.model_state_bytes == 16 * layout.utilized_numel
        # ZeRO-3 moves 1.5x DDP's bytes (paper §7.2.2), up to padding
        if world_size > 1:
            assert c.comm_bytes == pytest.approx(1.5 * ddp.comm_bytes, rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(spec_lists(max_tensors=10, dtypes=("float32",)), st.integers(1, 300), st.integers(1, 8),
       st.sampled_from(["fp32", "bf16", "fp16"]), st.sampled_from(["adam", "sgd"]))
def test_per_element_accounting(specs, chunk_size, world_size, precision, optimizer):
    """Model-state bytes are b_param per stored element plus (b_grad + master + states) per trainable
    stored element, for every strategy."""
    b = {"fp32": (4, 4, 0), "bf16": (2, 2, 4), "fp16": (2, 2, 4)}[precision]
    k = {"adam": 8, "sgd": 4}[optimizer]
    layout = ChunkLayout.build(specs, chunk_size, world_size)
    c = chunk_zero3_cost(layout, precision, optimizer)
    trainable = sum(layout.shard_numel(ch.index) for ch in layout.chunks if ch.requires_grad)
    assert c.model_state_bytes == b[0] * c.stored_numel + (b[1] + b[2] + k) * trainable
    for cost in (fsdp_cost(specs, world_size, precision, optimizer), ddp_cost(specs, world_size, precision, optimizer)):
        assert cost.param_bytes == b[0] * cost.stored_numel
        assert (
            cost.stored_numel * (world_size if cost.strategy == "fsdp" else 1) == cost.param_numel + cost.padding_numel
        )
        if world_size == 1:
            assert cost.comm_bytes == 0


def test_compare_strategies_and_table():
    costs = compare_strategies(model_specs("hf-gpt2"), 8)
    assert [c.strategy for c in costs] == ["chunk-zero3", "fsdp", "ddp"]
    zero, fsdp, ddp = costs
    assert zero.model_state_bytes < ddp.model_state_bytes / 7
    assert fsdp.num_units == 13  # 12 blocks + root (wte = tied lm_head, wpe, ln_f)
    assert fsdp.num_allgathers == 26 and fsdp.num_reduce_scatters == 13
    row = zero.as_row()
    assert row["model_state_bytes"] == zero.model_state_bytes and row["strategy"] == "chunk-zero3"
    table = format_cost_table(costs)
    assert table.count("\n") == 4 and "| fsdp | 8 | bf16 |" in table
    assert transformer_block_unit("transformer.h.3.mlp.c_fc.bias") == "transformer.h.3"


@pytest.mark.parametrize("call,match", [
    (lambda L, s: chunk_zero3_cost(L, "int8"), "precision"),
    (lambda L, s: chunk_zero3_cost(L, "bf16", "lion"), "optimizer"),
    (lambda L, s: chunk_zero3_cost(L, prefetch=-1), "prefetch"),
    (lambda L, s: fsdp_cost(s, 0), "world_size"),
    (lambda L, s: ddp_cost(s, 2, "bf32"), "precision"),
])
def test_bad_arguments(call, match):
    specs = [TensorSpec("w", (4,))]
    with pytest.raises(ConfigError, match=match):
        call(ChunkLayout.build(specs, 4, 2), specs)
