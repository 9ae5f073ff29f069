"""torch -> JAX -> torch: torch trains K steps, JAX restores the checkpoint, takes one optax AdamW
step on the chunk arrays and saves step K+1, torch resumes from it."""

from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
from jaxtest_utils import CHUNK_SIZE, HYPER, batch

import jax_backend as jb
from chunkzero.checkpoint import chunk_key, read_meta

PARAM_ATOL = 1e-6
"""Parameters after the step, absolute (params are O(0.1); fp32 rounding of one update is ~1e-9)."""
MOMENT_RTOL = 1e-6
"""Adam moments after the step: max |jax - torch| / max |torch| per tensor (fp32 rounding)."""


@functools.lru_cache(maxsize=8)
def _grad_fn(layout, cfg):
    """Jitted gradient of the mean next-token cross-entropy w.r.t. the chunk arrays, through
    ``unflatten`` and the Flax GPT (cached: one compilation per layout in a test process)."""

    def loss(chunks, x, y):
        logits = jb.gpt_from_chunks(chunks, layout, cfg)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jax.jit(jax.grad(loss))


def jax_grads(r, x, y):
    return _grad_fn(r.layout, jb.GPTConfig.from_dict(r.meta.model_config))(r.chunks, x, y)


def jax_step(root, n, x, y, grads=None):
    """Restore on ``n`` devices, one AdamW step on the chunks (with ``grads``, default the loss's
    gradient computed in JAX), save step K+1 under ``root``."""
    r = jb.restore_checkpoint(root, jb.make_mesh(n), with_optimizer=True)
    if grads is None:
        grads = jax_grads(r, x, y)
    else:
        grads = jb.shard_chunks(jb.flatten(grads, r.layout), r.layout, jb.make_mesh(n))
    chunks, opt, om = jb.adamw_step(r.chunks, grads, r.opt_state_chunks, r.meta.optimizer)
    assert om.step == r.meta.optimizer.step + 1
    for k, a in chunks.items():  # the step keeps every chunk where it was
        assert a.sharding.is_equivalent_to(r.chunks[k].sharding, 1)
    out = jb.save_checkpoint(root, chunks, r.layout, step=r.meta.step + 1, opt_state_chunks=opt, optimizer_meta=om,
                             mixed_precision=r.meta.mixed_precision, model_config=r.meta.model_config)
    return chunks, opt, r.layout, out


def torch_reference_step(run, x, y):
    """The same step in plain torch: the K-step model and AdamW, one more step; also its gradients."""
    model = run.torch_model().train()
    opt = run.torch_optimizer(model)
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)).flatten(0, 1), torch.from_numpy(y).flatten())
    opt.zero_grad()
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    opt.step()
    return model, opt, grads


@pytest.mark.parametrize("n", [1, 3, 8])
def test_jax_adamw_step_matches_torch_and_saves_for_torch(torch_run, tmp_path, n):
    """Given torch's gradients, the optax step on chunk arrays is torch's AdamW step (1e-6), and the
    saved step K+1 holds exactly the JAX result, readable by plain Orbax."""
    root = tmp_path / "ckpt"
    shutil.copytree(torch_run.root, root)
    xt, yt = batch(11)
    x, y = xt.numpy(), yt.numpy()
    ref_model, ref_opt, torch_grads = torch_reference_step(torch_run, x, y)
    chunks, opt, layout, step_dir = jax_step(root, n, x, y, grads=torch_grads)

    params = jb.unflatten(chunks, layout, nested=False)
    state = jb.unflatten_optimizer(opt, layout, nested=False)
    worst = 0.0
    for name, p in ref_model.named_parameters():
        got = np.asarray(params[name])
        worst = max(worst, float(np.abs(got - p.detach().numpy()).max()))
        np.testing.assert_allclose(got, p.detach().numpy(), rtol=0, atol=PARAM_ATOL, err_msg=name)
        s = ref_opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):  # optax b·m + (1-b)·g vs torch's lerp: fp32 rounding only
            ref = s[key].numpy()
            err = float(np.abs(np.asarray(state[key][name]) - ref).max()) / max(float(np.abs(ref).max()), 1e-30)
            assert err < MOMENT_RTOL, f"{name} {key}: {err:.2e}"
        assert int(s["step"]) == torch_run.step + 1
    print(f"adamw n={n}: max |param_jax - param_torch| = {worst:.2e}")

    meta = read_meta(root)
    assert meta.step == torch_run.step + 1 and meta.optimizer.step == torch_run.step + 1
    assert meta.layout.world_size == n and meta.optimizer.class_name == "torch.optim.AdamW"
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(root.absolute(), item_handlers=handlers) as mngr:
        as_numpy = jax.tree.map(
            lambda m: ocp.RestoreArgs(restore_type=np.ndarray), mngr.item_metadata(meta.step)["state"]
        )
        saved = mngr.restore(meta.step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=as_numpy)))[
            "state"
        ]
    for c in layout.chunks:
        np.testing.assert_array_equal(
            np.asarray(saved["params"][chunk_key(c.index)]), np.asarray(chunks[chunk_key(c.index)])
        )
        np.testing.assert_array_equal(np.asarray(saved["optim"]["exp_avg_sq"][chunk_key(c.index)]),
                                      np.asarray(opt["exp_avg_sq"][chunk_key(c.index)]))


@pytest.mark.parametrize("n", [3])
def test_jax_gradients_on_chunks_match_torch(torch_run, n):
    """The loss gradient w.r.t. the chunk arrays (through unflatten and the Flax GPT) is torch's,
    tensor by tensor, and zero in the padding. Tolerance: fp32 backward, normwise per tensor."""
    xt, yt = batch(11)
    r = jb.restore_checkpoint(torch_run.root, jb.make_mesh(n), with_optimizer=True)
    grads = jax_grads(r, xt.numpy(), yt.numpy())
    for k, g in grads.items():  # gradients live where the chunks do
        assert g.sharding.is_equivalent_to(r.chunks[k].sharding, 1)
    for c in r.layout.chunks:
        assert not np.asarray(grads[chunk_key(c.index)])[c.utilized:].any()
    _, _, torch_grads = torch_reference_step(torch_run, xt.numpy(), yt.numpy())
    per_tensor = jb.unflatten(grads, r.layout, nested=False)
    scale = max(float(np.abs(g).max()) for g in torch_grads.values())
    for name, ref in torch_grads.items():
        err = float(np.abs(np.asarray(per_tensor[name]) - ref).max()) / scale
        assert err < 1e-5, f"{name}: gradient error {err:.2e} of the largest gradient"


def test_jax_step_saved_at_3_devices_restores_at_8(torch_run, tmp_path):
    """The AdamW step saved from 3 devices restores on 8 with the same parameters."""
    root = tmp_path / "ckpt"
    shutil.copytree(torch_run.root, root)
    xt, yt = batch(11)
    _, _, torch_grads = torch_reference_step(torch_run, xt.numpy(), yt.numpy())
    chunks, opt, layout, _ = jax_step(root, 3, xt.numpy(), yt.numpy(), grads=torch_grads)
    back, layout8, opt8 = jb.restore_chunks(root, jb.make_mesh(8), with_optimizer=True)
    a, b = jb.unflatten(chunks, layout, nested=False), jb.unflatten(back, layout8, nested=False)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    assert read_meta(root).optimizer.step == torch_run.step + 1


def test_torch_resumes_from_the_jax_step(torch_run, tmp_path):
    from torch_backend import ZeroDDP, ZeroOptimizer, load_checkpoint
    from torch_backend.train.gpt import GPT

    root = tmp_path / "ckpt"
    shutil.copytree(torch_run.root, root)
    xt, yt = batch(11)
    # JAX's own gradient (through the Flax GPT) and optax AdamW on 3 devices; saved at world size 3, step K+1
    chunks, opt, layout, _ = jax_step(root, 3, xt.numpy(), yt.numpy())
    expected = jb.unflatten(chunks, layout, nested=False)
    expected_opt = jb.unflatten_optimizer(opt, layout, nested=False)

    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    model = ZeroDDP(GPT(torch_run.config), chunk_size=CHUNK_SIZE)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **HYPER)
    meta = load_checkpoint(root, model, optim, load_rng=False)  # world size 1, in this process
    assert meta.step == torch_run.step + 1
    state = model.state_dict()
    ostate = optim.state_dict()["state"]
    for name in torch_run.params:
        # bitwise: the fp32 chunks JAX saved, copied into torch's (a load moves no arithmetic)
        np.testing.assert_array_equal(state[name].numpy(), np.asarray(expected[name]), err_msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(ostate[name][key].numpy(), np.asarray(expected_opt[key][name]))
        assert int(ostate[name]["step"]) == torch_run.step + 1
    # and it trains on from there
    x, y = batch(12)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optim.backward(loss)
    optim.step()
    assert torch.isfinite(loss)


def test_adamw_bridge_bad_input():
    from chunkzero import ConfigError
    from chunkzero.checkpoint import OptimizerMeta
    from jax_backend.optim import adamw_hyperparameters

    hp = adamw_hyperparameters(OptimizerMeta("torch.optim.AdamW", {"lr": 0.1, "betas": [0.8, 0.9]}, [], 0))
    assert hp == {"learning_rate": 0.1, "b1": 0.8, "b2": 0.9, "eps": 1e-8, "weight_decay": 1e-2}  # torch defaults
    with pytest.raises(ConfigError, match="'torch.optim.SGD' is not AdamW"):
        adamw_hyperparameters(OptimizerMeta("torch.optim.SGD", {"lr": 0.1}, [], 0))
    with pytest.raises(ConfigError, match="amsgrad"):
        adamw_hyperparameters(OptimizerMeta("torch.optim.AdamW", {"lr": 0.1, "amsgrad": True}, [], 0))
    same = [{"lr": 0.1, "params": ["a"]}, {"lr": 0.1, "initial_lr": 0.2, "params": ["b"]}]
    assert adamw_hyperparameters(OptimizerMeta("torch.optim.AdamW", {"lr": 0.1}, [], 0, same))["learning_rate"] == 0.1
    differ = [{"lr": 0.1, "weight_decay": 0.1, "params": ["a"]}, {"lr": 0.1, "weight_decay": 0.0, "params": ["b"]}]
    with pytest.raises(ConfigError, match="param group 1 has weight_decay=0.0"):
        adamw_hyperparameters(OptimizerMeta("torch.optim.AdamW", {"lr": 0.1}, [], 0, differ))
    with pytest.raises(ConfigError, match="another step"):
        adamw_hyperparameters(OptimizerMeta("torch.optim.AdamW", {"lr": 0.1}, [], 2, None, {"a": 0}))
    chunks = {"chunk_0000": jnp.zeros(4)}
    meta = OptimizerMeta("torch.optim.AdamW", {"lr": 0.1}, ["exp_avg", "exp_avg_sq"], 2)
    with pytest.raises(ConfigError, match="no gradient for trainable chunk chunk_0000"):
        jb.adamw_step(chunks, {}, {"exp_avg": chunks, "exp_avg_sq": chunks}, meta)
    with pytest.raises(ConfigError, match="no 'exp_avg_sq'"):
        jb.adamw_step(chunks, chunks, {"exp_avg": chunks}, meta)
