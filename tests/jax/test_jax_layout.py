"""Chunk arrays <-> tensors in JAX (jax_backend.layout, jax_backend.mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_backend as jb
from chunkzero import ChunkLayout, ConfigError, LayoutError, ShapeMismatchError, TensorSpec
from chunkzero.checkpoint import chunk_key

SPECS = [
    TensorSpec("emb.weight", (7, 5), aliases=("head.weight",)),
    TensorSpec("a.weight", (3, 5)),
    TensorSpec("a.bias", (3,)),
    TensorSpec("b.weight", (4, 3)),
    TensorSpec("b.bias", (4,)),
    TensorSpec("frozen.table", (6,), "bfloat16", requires_grad=False),
]


def tensors(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for s in SPECS:
        x = rng.standard_normal(s.shape).astype(np.float32)
        out[s.name] = x.astype(jnp.bfloat16) if s.dtype == "bfloat16" else x
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_flatten_unflatten_roundtrip_on_mesh(world):
    layout = ChunkLayout.build(SPECS, chunk_size=20, world_size=world)
    mesh = jb.make_mesh(world)
    src = tensors()
    chunks = jb.flatten(src, layout, mesh=mesh)
    assert sorted(chunks) == [chunk_key(c.index) for c in layout.chunks]
    for c in layout.chunks:
        a = chunks[chunk_key(c.index)]
        assert a.shape == (c.size,) and a.sharding.spec == P("shard")
        assert a.dtype == (jnp.float32 if c.requires_grad else jnp.bfloat16)
        assert not np.asarray(a[c.utilized:], np.float32).any(), "padding must be zeros"
    flat = jb.unflatten(chunks, layout, nested=False, include_aliases=True)
    for name, x in src.items():
        np.testing.assert_array_equal(np.asarray(flat[name]), x)
    np.testing.assert_array_equal(np.asarray(flat["head.weight"]), src["emb.weight"])
    nested = jb.unflatten(chunks, layout)
    np.testing.assert_array_equal(np.asarray(nested["b"]["weight"]), src["b.weight"])
    assert "head" not in nested  # aliases only on request
    # nested input flattens the same
    again = jb.flatten(nested, layout, mesh=mesh)
    for k in chunks:
        np.testing.assert_array_equal(np.asarray(again[k], np.float32), np.asarray(chunks[k], np.float32))


def test_unflatten_gathers_each_sharded_chunk_once(monkeypatch):
    """Note [one gather per chunk]: outside ``jit``, unflatten moves each chunk sharded on the mesh to every device
    once (one ``device_put`` each, so one all-gather), then slices it there; the tensors come out replicated. One
    program per slice of the sharded chunk would make no such move, and gather once per tensor instead."""
    layout = ChunkLayout.build(SPECS, chunk_size=20, world_size=4)
    chunks = jb.flatten(tensors(), layout, mesh=jb.make_mesh(4))
    moved = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: moved.append(x.shape) or device_put(x, *a, **k))
    flat = jb.unflatten(chunks, layout, nested=False)
    assert sorted(moved) == sorted((c.size,) for c in layout.chunks if not c.keep_gathered)
    assert all(v.sharding.is_fully_replicated for v in flat.values())
    for name, x in tensors().items():
        np.testing.assert_array_equal(np.asarray(flat[name]), x)


def test_keep_gathered_chunks_are_replicated():
    specs = [TensorSpec("big", (40,)), TensorSpec("small", (3,), keep_gathered=True)]
    layout = ChunkLayout.build(specs, chunk_size=64, world_size=4)
    chunks = jb.flatten({"big": np.arange(40.0), "small": np.ones(3)}, layout, mesh=jb.make_mesh(4))
    kg = [c for c in layout.chunks if c.keep_gathered][0]
    assert chunks[chunk_key(kg.index)].sharding.spec == P()
    assert chunks[chunk_key(kg.index)].shape == (3,)


def test_unflatten_is_differentiable():
    layout = ChunkLayout.build(SPECS[:5], chunk_size=20, world_size=3)
    chunks = jb.flatten(tensors(), layout, mesh=jb.make_mesh(3))

    def loss(ch):
        p = jb.unflatten(ch, layout, nested=False)
        return sum(jnp.sum(v**2) for v in p.values())

    grads = jax.jit(jax.grad(loss))(chunks)
    for c in layout.chunks:
        g, x = np.asarray(grads[chunk_key(c.index)]), np.asarray(chunks[chunk_key(c.index)])
        np.testing.assert_allclose(g[: c.utilized], 2 * x[: c.utilized], rtol=1e-6)
        assert not g[c.utilized:].any()


def test_optimizer_state_covers_trainable_chunks_only():
    layout = ChunkLayout.build(SPECS, chunk_size=20, world_size=2)
    src = {k: v for k, v in tensors(1).items() if k != "frozen.table"}
    opt = jb.flatten_optimizer({"exp_avg": src, "exp_avg_sq": src}, layout, mesh=jb.make_mesh(2))
    trainable = [chunk_key(c.index) for c in layout.chunks if c.requires_grad]
    assert sorted(opt["exp_avg"]) == trainable
    back = jb.unflatten_optimizer(opt, layout, nested=False)
    assert "frozen.table" not in back["exp_avg"]
    np.testing.assert_array_equal(np.asarray(back["exp_avg_sq"]["a.weight"]), src["a.weight"])


def test_bad_input_names_the_tensor_and_shapes():
    layout = ChunkLayout.build(SPECS, chunk_size=20, world_size=2)
    src = tensors()
    bad = dict(src, **{"b.weight": np.zeros((3, 4), np.float32)})
    with pytest.raises(ShapeMismatchError, match=r"b\.weight.*\(4, 3\).*\(3, 4\)"):
        jb.flatten(bad, layout)
    missing = {k: v for k, v in src.items() if k != "a.bias"}
    with pytest.raises(LayoutError, match=r"a\.bias"):
        jb.flatten(missing, layout)
    chunks = jb.flatten(src, layout)
    with pytest.raises(ShapeMismatchError, match="chunk_0000"):
        jb.unflatten({**chunks, "chunk_0000": jnp.zeros(3)}, layout)
    with pytest.raises(LayoutError, match="missing chunk_0001"):
        jb.unflatten({"chunk_0000": chunks["chunk_0000"]}, layout)
    with pytest.raises(ConfigError, match="layout.relayout"):
        jb.flatten(src, layout, mesh=jb.make_mesh(4))


def test_mesh_without_the_axis_says_so():
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    layout = ChunkLayout.build(SPECS, chunk_size=20, world_size=2)
    with pytest.raises(ConfigError, match=r"no axis named 'shard'.*\('data',\)"):
        jb.flatten(tensors(), layout, mesh=mesh)
    # the same layout works when told the axis name
    chunks = jb.flatten(tensors(), layout, mesh=mesh, axis="data")
    assert chunks["chunk_0000"].sharding.spec == P("data")


def test_make_mesh_is_auto_and_checks_count():
    mesh = jb.make_mesh(3)
    assert mesh.axis_names == ("shard",) and mesh.shape["shard"] == 3
    assert mesh.axis_types == (AxisType.Auto,)
    with pytest.raises(ConfigError, match="only 8 devices"):
        jb.make_mesh(9)
