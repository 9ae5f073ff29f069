"""Restoring and saving chunkzero checkpoints in JAX (jax_backend.checkpoint over chunkzero.checkpoint)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import jax_backend as jb
from chunkzero import CheckpointError, ChunkLayout, ConfigError, TensorSpec
from chunkzero import checkpoint as ckpt
from chunkzero.checkpoint import CheckpointFormatError, OptimizerMeta, chunk_key, orbax_store


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_restore_on_any_device_count(torch_run, n):
    chunks, layout, opt = jb.restore_chunks(torch_run.root, jb.make_mesh(n), with_optimizer=True)
    saved = ckpt.read_meta(torch_run.root).layout
    assert saved.world_size == 3 and layout == saved.relayout(n)
    for c in layout.chunks:
        a = chunks[chunk_key(c.index)]
        assert a.shape == (c.size,) and a.size % n == 0 and a.dtype == jnp.float32
        assert a.sharding.spec == P("shard") and len(a.sharding.device_set) == n
        assert a.addressable_shards[0].data.shape == (c.size // n,)  # each device holds its shard only
    params = jb.unflatten(chunks, layout, nested=False)
    assert sorted(params) == sorted(torch_run.params)
    for name, p in torch_run.params.items():
        np.testing.assert_array_equal(np.asarray(params[name]), p, err_msg=name)
    state = jb.unflatten_optimizer(opt, layout, nested=False)
    for key in ("exp_avg", "exp_avg_sq"):
        for name, x in torch_run.opt_state[key].items():
            np.testing.assert_array_equal(np.asarray(state[key][name]), x, err_msg=f"{key} {name}")


def test_nested_unflatten_uses_module_paths(torch_run):
    chunks, layout = jb.restore_chunks(torch_run.step_dir, jb.make_mesh(2))
    params = jb.unflatten(chunks, layout)
    w = params["transformer"]["h"]["0"]["attn"]["c_attn"]["weight"]
    np.testing.assert_array_equal(np.asarray(w), torch_run.params["transformer.h.0.attn.c_attn.weight"])


def test_root_and_step_dir_resolve_the_same(torch_run, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(torch_run.root, root)
    meta = ckpt.read_meta(root)
    chunks, layout = jb.restore_chunks(root, jb.make_mesh(1))
    # a later step becomes the latest
    later = {k: v * 2 for k, v in chunks.items()}
    jb.save_checkpoint(root, later, layout, step=meta.step + 5)
    assert ckpt.list_steps(root) == [meta.step, meta.step + 5]
    assert ckpt.latest_step(root) == meta.step + 5
    latest, _ = jb.restore_chunks(root, jb.make_mesh(1))
    first, _ = jb.restore_chunks(root, jb.make_mesh(1), step=meta.step)
    np.testing.assert_array_equal(np.asarray(latest["chunk_0000"]), 2 * np.asarray(first["chunk_0000"]))
    with pytest.raises(ConfigError, match="step=4"):
        jb.restore_chunks(root / str(meta.step), jb.make_mesh(1), step=4)
    with pytest.raises(CheckpointError, match="no committed step 4 under"):
        jb.restore_chunks(root, jb.make_mesh(1), step=4)


def test_read_meta_and_array_metadata_without_arrays(torch_run):
    meta = ckpt.read_meta(torch_run.root)
    assert (
        meta.step == torch_run.step and meta.layout.world_size == 3 and meta.model_config == torch_run.config.to_dict()
    )
    assert meta.optimizer.state_keys == ["exp_avg", "exp_avg_sq"]
    arrays = orbax_store.read_array_metadata(torch_run.step_dir)
    assert arrays == meta.expected_arrays()


def test_plain_orbax_user_restores_as_numpy(torch_run):
    """The format is plain Orbax: item names, PyTreeRestore as numpy, JsonRestore, no chunkzero needed."""
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(torch_run.root.absolute(), item_handlers=handlers) as mngr:
        tree = mngr.item_metadata(torch_run.step)["state"]
        as_numpy = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        r = mngr.restore(torch_run.step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(restore_args=as_numpy), meta=ocp.args.JsonRestore()))
    assert r.meta["layout"]["world_size"] == 3
    size = r.meta["layout"]["chunks"][0]["size"]
    assert isinstance(r.state["params"]["chunk_0000"], np.ndarray) and r.state["params"]["chunk_0000"].shape == (size,)


def test_save_restore_keep_gathered_and_frozen(tmp_path):
    specs = [
        TensorSpec("w", (33,)),
        TensorSpec("b", (5,), keep_gathered=True),
        TensorSpec("table", (7,), "bfloat16", requires_grad=False),
    ]
    layout = ChunkLayout.build(specs, chunk_size=64, world_size=2)
    src = {
        "w": np.arange(33, dtype=np.float32),
        "b": -np.ones(5, np.float32),
        "table": np.arange(7).astype(jnp.bfloat16),
    }
    chunks = jb.flatten(src, layout, mesh=jb.make_mesh(2))
    opt = jb.flatten_optimizer(
        {"m": {"w": np.ones(33, np.float32), "b": np.ones(5, np.float32)}}, layout, mesh=jb.make_mesh(2)
    )
    jb.save_checkpoint(tmp_path, chunks, layout, step=1, opt_state_chunks=opt,
                       optimizer_meta=OptimizerMeta("optax.sgd", {"lr": 0.1}, ["m"], 1), mixed_precision="bf16")
    for n in (1, 3, 8):
        r = jb.restore_checkpoint(tmp_path, jb.make_mesh(n), with_optimizer=True)
        kinds = {c.index: c for c in r.layout.chunks}
        for k, a in r.chunks.items():
            c = kinds[int(k[-4:])]
            assert a.sharding.spec == (P() if c.keep_gathered else P("shard"))
            assert a.dtype == (jnp.bfloat16 if not c.requires_grad else jnp.float32)
        back = jb.unflatten(r.chunks, r.layout, nested=False)
        for name, x in src.items():
            np.testing.assert_array_equal(np.asarray(back[name], np.float32), np.asarray(x, np.float32))
        assert sorted(r.opt_state_chunks["m"]) == sorted(chunk_key(c.index) for c in r.layout.chunks if c.requires_grad)
        assert r.meta.mixed_precision == "bf16"
    opt_only, layout8, om = jb.restore_optimizer_chunks(tmp_path, jb.make_mesh(8))
    assert om.class_name == "optax.sgd" and layout8.world_size == 8


def test_save_refuses_to_overwrite_and_bad_dtypes(torch_run, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(torch_run.root, root)
    chunks, layout = jb.restore_chunks(root, jb.make_mesh(3))
    before = (root / str(torch_run.step) / "meta" / "metadata").read_bytes()
    with pytest.raises(CheckpointError, match="already exists"):
        jb.save_checkpoint(root, chunks, layout, step=torch_run.step)
    with pytest.raises(CheckpointError, match="before the latest step"):
        jb.save_checkpoint(root, chunks, layout, step=torch_run.step - 1)
    assert (root / str(torch_run.step) / "meta" / "metadata").read_bytes() == before
    bf = {k: v.astype(jnp.bfloat16) for k, v in chunks.items()}
    with pytest.raises(CheckpointError, match="chunk_0000 is bfloat16"):
        jb.save_checkpoint(root, bf, layout, step=99)
    with pytest.raises(CheckpointError, match="without optimizer_meta"):
        jb.save_checkpoint(root, chunks, layout, step=99, opt_state_chunks={"exp_avg": chunks})
    with pytest.raises(ConfigError, match="mixed_precision"):
        jb.save_checkpoint(root, chunks, layout, step=99, mixed_precision="fp8")
    assert ckpt.list_steps(root) == [torch_run.step]


def test_missing_and_corrupt_checkpoints_name_the_path(torch_run, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=str(missing)):
        jb.restore_chunks(missing, jb.make_mesh(1))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no committed checkpoint step under"):
        jb.restore_chunks(empty, jb.make_mesh(1))

    bad_meta = tmp_path / "bad_meta"
    shutil.copytree(torch_run.root, bad_meta)
    (bad_meta / str(torch_run.step) / "meta" / "metadata").write_text("{not json")
    with pytest.raises(CheckpointError, match=str(bad_meta)):
        jb.restore_chunks(bad_meta, jb.make_mesh(1))

    wrong_layout = tmp_path / "wrong_layout"
    shutil.copytree(torch_run.root, wrong_layout)
    f = wrong_layout / str(torch_run.step) / "meta" / "metadata"
    doc = json.loads(f.read_text())
    size = doc["layout"]["chunks"][0]["size"]
    doc["layout"]["chunks"][0]["size"] += 3  # still a multiple of 3, but not the saved array's size
    doc.pop("checksums", None)
    f.write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError, match=rf"params\.chunk_0000.*float32\[{size}\].*float32\[{size + 3}\]"):
        jb.restore_chunks(wrong_layout, jb.make_mesh(1))

    no_data = tmp_path / "no_data"
    shutil.copytree(torch_run.root, no_data)
    state = no_data / str(torch_run.step) / "state"
    for p in state.rglob("*"):
        if p.is_file() and p.name not in ("_METADATA", "_sharding", "_CHECKPOINT_METADATA"):
            p.unlink()
    with pytest.raises(CheckpointError, match=str(state)):
        jb.restore_chunks(no_data, jb.make_mesh(2))


def test_nonzero_padding_is_reported(tmp_path):
    layout = ChunkLayout.build([TensorSpec("w", (5,))], chunk_size=8, world_size=2)
    chunk = jnp.asarray([1, 2, 3, 4, 5, 9], jnp.float32)  # size 6, utilized 5: padding holds 9
    jb.save_checkpoint(tmp_path, {"chunk_0000": chunk}, layout, step=0)
    with pytest.raises(CheckpointError, match="non-zero padding"):
        jb.restore_chunks(tmp_path, jb.make_mesh(2))
    # at 1 device the padding is truncated away, and the tensors are intact
    chunks, lay1 = jb.restore_chunks(tmp_path, jb.make_mesh(1))
    np.testing.assert_array_equal(np.asarray(chunks["chunk_0000"]), [1, 2, 3, 4, 5])


def test_restore_needs_the_mesh_axis(torch_run):
    import jax
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2,), ("batch",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    with pytest.raises(ConfigError, match=r"no axis named 'shard'.*'batch'"):
        jb.restore_chunks(torch_run.root, mesh)
    chunks, layout = jb.restore_chunks(torch_run.root, mesh, axis="batch")
    assert chunks["chunk_0000"].sharding.spec == P("batch")


def test_params_only_checkpoint_has_no_optimizer(tmp_path, torch_run):
    chunks, layout = jb.restore_chunks(torch_run.root, jb.make_mesh(4))
    jb.save_checkpoint(tmp_path, chunks, layout, step=0)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        jb.restore_chunks(tmp_path, jb.make_mesh(4), with_optimizer=True)


def test_checksum_mismatch_is_reported(torch_run, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(torch_run.root, root)
    f = root / str(torch_run.step) / "meta" / "metadata"
    doc = json.loads(f.read_text())
    assert doc["checksums"]["algorithm"] == "sum64+xor64"
    sums = doc["checksums"]["arrays"]["optim/exp_avg/chunk_0001"]
    sums[1] = "0" * 32
    f.write_text(json.dumps(doc))
    jb.restore_chunks(root, jb.make_mesh(2))  # parameters only: the optimizer state is not read
    with pytest.raises(
        CheckpointError, match=r"'optim\.exp_avg\.chunk_0001' in '.*/state' is corrupted.*saved by rank 1"
    ):
        jb.restore_chunks(root, jb.make_mesh(2), with_optimizer=True)


def test_jax_save_writes_torch_compatible_checksums(torch_run, tmp_path):
    """jax_backend.save_checkpoint records the same checksums the torch backend wrote for the same data."""
    r = jb.restore_checkpoint(torch_run.root, jb.make_mesh(3), with_optimizer=True)
    jb.save_checkpoint(tmp_path, r.chunks, r.layout, step=r.meta.step, opt_state_chunks=r.opt_state_chunks,
                       optimizer_meta=r.meta.optimizer)
    ours = ckpt.read_meta(tmp_path).checksums
    assert ours["algorithm"] == r.meta.checksums["algorithm"]
    if torch_run.writer == "torch_backend.save_checkpoint":
        assert ours["arrays"] == r.meta.checksums["arrays"]


@pytest.mark.parametrize("flags, kept, keep", [
    ([True, True, False, False, False, False], [2, 4, 5, 6], 3),  # the newest finite step outlives keep-last-3
    ([None] * 6, [4, 5, 6], 3),  # checkpoints without the flag count as finite: plain keep-last-3
    ([True] * 3, [3], 1),  # keep-last-1 of finite steps: one step, not the one before it too
    # the step being saved counts at once (its metadata is not on disk yet): finite step 6 releases step 3
    ([True] * 3 + [False] * 2 + [True], [4, 5, 6], 3),
    ([True] * 3 + [False] * 2 + [True, True], [5, 6, 7], 3),
])
def test_keep_last_n_never_deletes_the_newest_finite_step(tmp_path, flags, kept, keep):
    """``max_to_keep`` (``--keep``) rotates out old steps, except the newest one saved with a finite loss
    (``meta.extra["finite"]``), as the training loops of both engines save them (``orbax_store.save_step``)."""
    layout = ChunkLayout.build([TensorSpec("a", (100,))], 128, 1)
    for step, finite in enumerate(flags, start=1):
        extra = {} if finite is None else {"finite": finite}
        jb.save_checkpoint(
            tmp_path,
            {"chunk_0000": np.zeros(layout.chunks[0].size, np.float32)},
            layout,
            step=step,
            extra=extra,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep),
        )
    assert ckpt.list_steps(tmp_path) == kept


def test_a_checkpoint_without_checksums_loads_with_one_warning(tmp_path):
    """Multi-process JAX checkpoints written before checksums were gathered have ``"checksums": null``: a
    restore (JAX) and a read (torch's loader and ``export`` go through ChunkReader) say once that nothing
    is verified, and still load."""
    import warnings

    from chunkzero.checkpoint import UnverifiedCheckpointWarning
    from chunkzero.checkpoint.reader import ChunkReader

    layout = ChunkLayout.build([TensorSpec("a", (100,))], 128, 1)
    jb.save_checkpoint(tmp_path, {"chunk_0000": np.ones(layout.chunks[0].size, np.float32)}, layout, step=1,
                       checksums=False)
    assert ckpt.read_meta(tmp_path).checksums is None
    for load in (lambda: jb.restore_chunks(tmp_path, jb.make_mesh(1)),
                 lambda: ChunkReader(tmp_path / "1", ckpt.read_meta(tmp_path)).read(("params", "chunk_0000"), 0, 100)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load()
        said = [w for w in caught if issubclass(w.category, UnverifiedCheckpointWarning)]
        assert (
            len(said) == 1 and "records no checksums" in str(said[0].message) and "unverified" in str(said[0].message)
        )
