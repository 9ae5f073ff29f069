"""``chunkzero train --backend jax --ema-decay``: the JAX engine's EMA reported as torch's (``ema_val_loss``
at each evaluation, the final one in the summary), saved in the checkpoint's ``ema`` item, and carried by
the engine switch both ways — loaded, not restarted: right after the load the EMA is the saved one, bit for
bit, and the next step's EMA is ``d · saved EMA + (1 − d) · that step's weights`` (a restarted EMA would
start from the weights instead)."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from .helpers import SMALL, describe, read_metrics, run_train, run_train_pooled, saved_tensors

ARGS = [*SMALL, "--sample-tokens", "0", "--eval-interval", "2", "--save-interval", "2"]
EMA_ATOL = 1e-6
"""One fp32 lerp of weights of magnitude below ~2 (the saved arrays are read back exactly)."""


def _check_next_ema_kept(root, step: int, decay: float) -> float:
    """The EMA of checkpoint ``step + 1`` is ``decay · EMA(step) + (1 − decay) · weights(step + 1)``; returns how
    far a restarted EMA (``decay · weights(step) + …``) would be, for the caller to check it is far."""
    ema0, w0 = saved_tensors(root / str(step), "ema"), saved_tensors(root / str(step), "params")
    ema1, w1 = saved_tensors(root / str(step + 1), "ema"), saved_tensors(root / str(step + 1), "params")
    for k in ema1:
        np.testing.assert_allclose(ema1[k], decay * ema0[k] + (1 - decay) * w1[k], rtol=0, atol=EMA_ATOL, err_msg=k)
    return max(float(np.abs(ema1[k] - (decay * w0[k] + (1 - decay) * w1[k])).max()) for k in ema1)


@pytest.fixture(scope="module")
def jax_run(corpus, tmp_path_factory):
    """2 steps of gpt-tiny on the JAX engine (1 process × 2 devices) with --ema-decay 0.9, saved at step 2."""
    tmp = tmp_path_factory.mktemp("jax_ema")
    out = tmp / "run"
    p = run_train("--data", str(corpus), *ARGS, "--steps", "2", "--ema-decay", "0.9", "--backend", "jax",
                  "--nproc", "1", "--devices-per-process", "2", "--out", str(out), cwd=tmp)
    assert p.returncode == 0, describe(p)
    return out


@pytest.mark.slow
def test_jax_reports_the_ema_and_torch_resumes_it(corpus, jax_run, tmp_path):
    import torch

    from chunkzero.checkpoint import read_meta
    from chunkzero.train_config import TrainConfig, with_device_defaults
    from torch_backend import load_checkpoint
    from torch_backend.train.adapter import TorchAdapter
    from torch_backend.train.models import build_module

    _, val = read_metrics(jax_run)
    assert [r["step"] for r in val] == [0, 2] and val[0]["ema_val_loss"] == val[0]["val_loss"]
    assert val[1]["ema_val_loss"] != val[1]["val_loss"]
    summary = json.loads((jax_run / "summary.json").read_text())
    assert summary["ema_val_loss_final"] == val[1]["ema_val_loss"] and summary["backend"].startswith("jax")
    assert "EMA val loss" in (jax_run / "summary.txt").read_text()
    root = jax_run / "checkpoints"
    assert read_meta(root / "2").ema.to_dict() == {"decay": 0.9, "update_count": 2, "warmup": False}

    # the torch engine's loader, right after the load: the saved EMA, not the weights
    cfg = with_device_defaults(TrainConfig(model="gpt-tiny", ema_decay=0.5), "cpu")
    engine = TorchAdapter(build_module(cfg), cfg, torch.device("cpu"))
    load_checkpoint(root, engine.model, engine.optim, load_rng=False)
    assert (engine.ema.decay, engine.ema.update_count) == (0.9, 2)
    with engine.ema.ema_weights():
        loaded = {k: v.detach().numpy().copy() for k, v in engine.model.state_dict().items()}
    saved, weights = saved_tensors(root / "2", "ema"), saved_tensors(root / "2", "params")
    for name in saved:
        np.testing.assert_array_equal(loaded[name], saved[name], err_msg=name)
        assert not np.array_equal(saved[name], weights[name]), name

    out = tmp_path / "run"
    shutil.copytree(jax_run, out)
    p = run_train_pooled("--data", str(corpus), *ARGS, "--steps", "3", "--ema-decay", "0.9", "--nproc", "2", "--resume",
                         "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0, describe(p)
    assert read_meta(out / "checkpoints" / "3").ema.update_count == 3
    assert _check_next_ema_kept(out / "checkpoints", 2, 0.9) > 100 * EMA_ATOL
    assert "ema_val_loss" in read_metrics(out)[1][-1]


@pytest.mark.slow
def test_torch_ema_resumes_on_jax(corpus, tmp_path):
    """torch (2 workers) → JAX with --ema-warmup added: the JAX engine loads the EMA as saved, says that this
    run's warm-up is used from step 3 on, and warms the EMA up from the saved update count (decay
    min(0.9, 3/12) at step 3)."""
    import jax_backend as jb
    from chunkzero.checkpoint import read_meta
    from chunkzero.train_config import TrainConfig, with_device_defaults
    from jax_backend.train.adapter import JaxAdapter

    out = tmp_path / "run"
    common = ["--data", str(corpus), *ARGS, "--ema-decay", "0.9", "--out", str(out)]
    p = run_train_pooled(*common, "--steps", "2", "--nproc", "2", cwd=tmp_path)
    assert p.returncode == 0, describe(p)
    root = out / "checkpoints"

    cfg = with_device_defaults(TrainConfig(model="gpt-tiny", backend="jax", ema_decay=0.9, ema_warmup=True,
                                           out=str(out), resume=True), "cpu")
    engine = JaxAdapter(cfg, jb.make_mesh(2), resume_from=root)
    assert engine.ema.update_count == 2 and engine.ema.current_decay() == pytest.approx(3 / 12)
    loaded = jb.unflatten(engine.ema.weights(engine.state), engine.layout, nested=False)
    for name, want in saved_tensors(root / "2", "ema").items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), want, err_msg=name)

    p = run_train(*common, "--steps", "3", "--ema-warmup", "--backend", "jax", "--nproc", "1",
                  "--devices-per-process", "2", "--resume", cwd=tmp_path)
    assert p.returncode == 0, describe(p)
    assert "--ema-warmup on (the checkpoint's: off): this run's setting is used from step 3 on" in p.stderr, p.stderr
    assert read_meta(root / "3").ema.to_dict() == {"decay": 0.9, "update_count": 3, "warmup": True}
    assert _check_next_ema_kept(root, 2, 3 / 12) > 100 * EMA_ATOL
    assert "ema_val_loss" in read_metrics(out)[1][-1]


def test_jax_resume_says_what_it_does_with_the_ema(caplog, tmp_path):
    """One line on each case: the EMA dropped without --ema-decay, this run's other decay / warm-up used on,
    the EMA carried on with the same settings, and restarted from a checkpoint without one."""
    from chunkzero.checkpoint import EmaMeta
    from chunkzero.train_config import TrainConfig
    from jax_backend.train.loop import _say_resumed_ema

    class Meta:
        step, ema = 4, EmaMeta(decay=0.5, update_count=4, warmup=True)

    caplog.set_level(logging.INFO, logger="chunkzero.train")
    _say_resumed_ema(Meta, tmp_path / "4", TrainConfig())
    _say_resumed_ema(Meta, tmp_path / "4", TrainConfig(ema_decay=0.9))
    _say_resumed_ema(Meta, tmp_path / "4", TrainConfig(ema_decay=0.5, ema_warmup=True))
    Meta.ema = None
    _say_resumed_ema(Meta, tmp_path / "4", TrainConfig(ema_decay=0.5))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert "holds an EMA of the weights (decay 0.5, 4 updates) and this run keeps none: the EMA is dropped" in lines[0]
    assert lines[1] == ("--resume: --ema-decay 0.9 (the checkpoint's: 0.5), --ema-warmup off (the checkpoint's: on): "
                        "this run's setting is used from step 5 on (the EMA's weights and its 4 updates are kept)")
    assert lines[2] == "--resume: the checkpoint's EMA of the weights carries on (decay 0.5, 4 updates)"
    assert "holds no EMA: this run's EMA (--ema-decay) starts at the loaded weights (update count 0)" in lines[3]


def test_a_skipped_step_leaves_the_ema(monkeypatch):
    """A step skipped for a non-finite gradient norm changes no EMA (nor its count), as torch's ZeroEMA skips
    an fp16 step skipped for an overflow; an applied one updates it."""
    import jax.numpy as jnp

    import jax_backend as jb
    from chunkzero.train_config import TrainConfig, with_device_defaults
    from jax_backend.train.adapter import JaxAdapter

    cfg = with_device_defaults(TrainConfig(model="gpt-tiny", backend="jax", ema_decay=0.5), "cpu")
    engine = JaxAdapter(cfg, jb.make_mesh(2))
    norm = {"value": float("nan")}
    fake = lambda state, batch: (state, jnp.zeros((2,)), jnp.asarray(norm["value"]))  # noqa: E731
    monkeypatch.setattr(type(engine.trainer), "step_fn", property(lambda self: fake))
    before = {k: np.asarray(v) for k, v in engine.ema.chunks.items()}
    assert engine.step(1, {}) == (0.0, False)
    assert engine.ema.update_count == 0
    assert all(np.array_equal(np.asarray(engine.ema.chunks[k]), v) for k, v in before.items())
    norm["value"] = 1.0
    assert engine.step(2, {}) == (0.0, True) and engine.ema.update_count == 1
