"""Hybrid sharding on a 2 x 4 ("replica", "shard") mesh: the step equals the flat ZeRO-3 step on 8
devices and the unsharded reference (fp32), and the collectives in its compiled HLO are the cost
model's (chunkzero.network_cost.hybrid_calls), by kind, group size and bytes per level."""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from zero_utils import ADAMW, BATCH, CHUNK_SIZE, FP32_RTOL, SEQ, batches, normwise_rel_err, tiny_program

from chunkzero import ChunkLayout
from chunkzero.errors import ConfigError
from chunkzero.network_cost import Topology, hybrid_calls, price_calls
from jax_backend import make_mesh
from jax_backend.analysis import parse_collectives
from jax_backend.blocks import gpt_reference_loss
from jax_backend.hybrid import HybridZeroTrainer
from jax_backend.mesh import make_hybrid_mesh
from jax_backend.schedule import reference_train
from jax_backend.zero import ZeroTrainer

R, S = 2, 4


@pytest.fixture(scope="module")
def program():
    return tiny_program()


def _train(trainer, p0, data):
    state = trainer.init(p0)
    losses = []
    for b in data:
        state, loss = trainer.step(state, b)
        losses.append(float(loss))
    return trainer.full_params(state), losses, state


def test_hybrid_step_equals_flat_and_reference(program):
    """3 AdamW steps (eps 1e-6): 2 x 4 hybrid == flat ZeRO-3 over 8 == unsharded, fp32 tolerance."""
    tx = optax.adamw(**ADAMW)
    p0 = program.init(0)
    data = batches(program)
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, S)
    hybrid, h_losses, state = _train(HybridZeroTrainer(program, layout, make_hybrid_mesh(R, S), tx), p0, data)
    flat, f_losses, _ = _train(ZeroTrainer(program, layout.relayout(R * S), make_mesh(R * S), tx), p0, data)
    ref, ref_losses = reference_train(program, p0, data, tx, loss_fn=gpt_reference_loss(program.config))
    np.testing.assert_allclose(h_losses, f_losses, rtol=FP32_RTOL)
    np.testing.assert_allclose(h_losses, ref_losses, rtol=FP32_RTOL)
    assert normwise_rel_err(hybrid, flat) < FP32_RTOL
    assert normwise_rel_err(hybrid, ref) < FP32_RTOL
    # sharded over "shard", replicated over "replica": one quarter of each chunk per device
    for k, v in state.master.items():
        assert v.sharding.shard_shape(v.shape) == (v.shape[0] // S,), k
        assert v.sharding.spec == P("shard"), k


def test_hybrid_without_replica_reduction_is_wrong(program):
    """The mutant: reduce-scatter within the shard group only (no all-reduce across replicas) trains
    each replica on half the batch, and the test above would see it."""
    from jax_backend import hybrid as hybrid_mod

    class NoReplicaUnit(hybrid_mod.HybridChunkUnit):
        def reduce(self, grads, axis):
            return hybrid_mod.ChunkUnit.reduce(self, grads, axis)

    class Mutant(HybridZeroTrainer):
        def _chunk_units(self, layout):
            return [NoReplicaUnit(layout, c.index, "replica") for c in layout.chunks]

    tx = optax.sgd(0.5)
    p0 = program.init(0)
    data = batches(program, 1)
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, S)
    bad, _, _ = _train(Mutant(program, layout, make_hybrid_mesh(R, S), tx), p0, data)
    ref, _ = reference_train(program, p0, data, tx)
    assert normwise_rel_err(bad, ref) > 100 * FP32_RTOL


def _hlo_by_group(trainer) -> dict[tuple[str, int], tuple[int, int]]:
    """``{(kind, group size): (buffers, ring bytes per device)}`` of the compiled step."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for c in parse_collectives(trainer.lower(BATCH, SEQ).compile().as_text(), R * S):
        n, b = out.get((c.kind, c.group_size), (0, 0))
        out[(c.kind, c.group_size)] = (n + c.buffers, b + c.wire_bytes)
    return out


def _model_by_group(calls) -> dict[tuple[str, int], tuple[int, int]]:
    from chunkzero.collective_cost import ring_link_bytes

    out: dict[tuple[str, int], tuple[int, int]] = {}
    for c in calls:
        n, b = out.get((c.kind, c.group_size), (0, 0))
        out[(c.kind, c.group_size)] = (
            n + c.count,
            b + round(c.count * ring_link_bytes(c.kind, c.buffer_bytes, c.group_size)),
        )
    return out


def test_hlo_collectives_match_the_cost_model(program):
    """Per sharded chunk: 2 all-gathers and 1 reduce-scatter over 4 devices, 1 all-reduce of the shard over
    2 — the model's counts and bytes; on 2 nodes of 4 the shard groups' bytes are intra-node, the
    replicas' all-reduce inter-node."""
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, S)
    trainer = HybridZeroTrainer(program, layout, make_hybrid_mesh(R, S), optax.adamw(**ADAMW))
    calls = hybrid_calls(layout, R, "fp32")
    hlo, model = _hlo_by_group(trainer), _model_by_group(calls)
    n = len(layout.chunks)
    assert model == {("all-gather", 4): (2 * n, model[("all-gather", 4)][1]),
                     ("reduce-scatter", 4): (n, model[("reduce-scatter", 4)][1]),
                     ("all-reduce", 2): (n, model[("all-reduce", 2)][1])}
    assert hlo == model
    intra, inter, _ = price_calls(calls, Topology(R, S))
    assert intra == sum(b for (kind, g), (_, b) in hlo.items() if g == S)
    assert inter == sum(b for (kind, g), (_, b) in hlo.items() if g == R)
    print(f"2x4 hybrid, {n} chunks: HLO {hlo}; model intra {intra:,.0f} B, inter {inter:,.0f} B per device")


def test_hybrid_keep_gathered_and_clipping(program):
    """Keep-gathered chunks: all-reduced over the shard group, then across replicas; global-norm clipping over the shard
    group only (replicas hold the same gradient shard). SGD, compared with flat ZeRO-3 over 8."""
    specs = [dataclasses.replace(s, keep_gathered=".ln_" in s.name) for s in program.specs]
    layout = ChunkLayout.build(specs, CHUNK_SIZE, S)
    tx = optax.sgd(0.5)
    p0 = program.init(1)
    data = batches(program, 2, seed=10)
    trainer = HybridZeroTrainer(program, layout, make_hybrid_mesh(R, S), tx, max_norm=0.1)
    hybrid, _, _ = _train(trainer, p0, data)
    flat, _, _ = _train(ZeroTrainer(program, layout.relayout(R * S), make_mesh(R * S), tx, max_norm=0.1), p0, data)
    assert normwise_rel_err(hybrid, flat) < FP32_RTOL
    hlo, model = _hlo_by_group(trainer), _model_by_group(hybrid_calls(layout, R, "fp32"))
    n_kg = sum(c.keep_gathered for c in layout.chunks)
    assert model[("all-reduce", 4)][0] == n_kg > 0 and ("all-reduce", 8) not in model
    # + the scalar gradient-norm all-reduce over the shard group, which the model leaves out
    n, b = hlo.pop(("all-reduce", 4))
    m, mb = model.pop(("all-reduce", 4))
    assert (n, b) == (m + 1, mb + round(2 * 3 / 4 * 4))
    assert hlo == model


def test_hybrid_bad_input(program):
    layout = ChunkLayout.build(program.specs, CHUNK_SIZE, S)
    tx = optax.sgd(0.1)
    with pytest.raises(ConfigError, match="world size 4 but mesh axis 'shard' has 2"):
        HybridZeroTrainer(program, layout, make_hybrid_mesh(4, 2), tx)
    with pytest.raises(ConfigError, match="no axis named 'replica'"):
        HybridZeroTrainer(program, layout, make_mesh(S, axis="shard"), tx)
    with pytest.raises(ConfigError, match="must differ"):
        HybridZeroTrainer(program, layout, make_hybrid_mesh(R, S), tx, replica_axis="shard")
    with pytest.raises(ConfigError, match="needs 16 devices"):
        make_hybrid_mesh(4, 4)
    trainer = HybridZeroTrainer(program, layout, make_hybrid_mesh(R, S), tx)
    with pytest.raises(ConfigError, match="not divisible by the world size 8"):
        trainer.abstract_batch(4, SEQ)
