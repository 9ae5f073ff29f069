"""``chunkzero train --backend jax`` end to end, against the torch engine on the same settings.

The JAX run (2 processes joined by jax.distributed) trains the same stream from the same weights with
the same optimizer as torch at the same world size, so their losses agree to fp32 noise; and one run
switches engine at its checkpoints: torch → JAX → torch through ``--resume --backend``. Every run keeps an
EMA of the weights (``--ema-decay``), evaluated as torch evaluates it and carried by the switch.
"""

from __future__ import annotations

import json
import shutil

import pytest

from .helpers import (
    SMALL,
    describe,
    make_corpus,
    normwise_rel_err,
    read_metrics,
    run_train,
    run_train_pooled,
    saved_tensors,
)

STEPS = ["--warmup", "2", "--eval-interval", "2", "--save-interval", "2", "--ema-decay", "0.9"]
NORM_RTOL = 1e-3
"""The logged gradient norm of the two fp32 engines (a norm after clipping would read --max-norm's 1.0)."""
GLOBAL_BATCH = 12
"""Sequences per step at every world size of the tests (2, 4 and 3): micro-batch *i* is the same global
batch whenever world size × --batch-size is, so a run that changes world size at a checkpoint trains the
uninterrupted run's stream."""
LOSS_TOL = 2e-3
"""nats/token: two fp32 engines (torch's and XLA's kernels sum in other orders) over 6 steps; an LR one
step off or a lost weight-decay group moves the loss by more."""
EMA_RTOL = 1e-4
"""The EMA weights of the switched run and of the torch-only run at the last step, normwise relative: two fp32
engines over 6 steps (3.9e-8 measured); an EMA the JAX engine restarts at the switch fails already on the EMA's
validation loss (0.099 nats/token off)."""


def _losses(out):
    train, val = read_metrics(out)
    return {r["step"]: r["loss"] for r in train}, {r["step"]: r["val_loss"] for r in val}


def _ema_losses(out):
    return {r["step"]: r["ema_val_loss"] for r in read_metrics(out)[1]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jax_train")
    corpus = make_corpus(tmp / "corpus")
    common = [*SMALL, *STEPS, "--data", str(corpus)]
    torch_out = tmp / "torch"
    p = run_train_pooled(*common, "--steps", "6", "--nproc", "2", "--batch-size", str(GLOBAL_BATCH // 2), "--out",
                         str(torch_out), cwd=tmp)
    assert p.returncode == 0, describe(p)
    jax_out = tmp / "jax"
    p = run_train(*common, "--steps", "6", "--backend", "jax", "--nproc", "2", "--batch-size", str(GLOBAL_BATCH // 2),
                  "--out", str(jax_out), cwd=tmp)
    assert p.returncode == 0, describe(p)
    return tmp, common, torch_out, jax_out, p


@pytest.mark.slow
def test_jax_run_prints_no_gloo_connection_lines(runs):
    """jaxlib's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks ..." on each process's stdout; the
    launcher leaves those lines out (and nothing else: the run's own lines are on stderr)."""
    p = runs[-1]
    assert "[Gloo]" not in p.stdout + p.stderr, describe(p)
    assert "chunkzero train --backend jax: done" in p.stderr, describe(p)


@pytest.mark.slow
def test_jax_run_matches_torch(runs):
    _, _, torch_out, jax_out, _ = runs
    (t_train, t_val), (j_train, j_val) = _losses(torch_out), _losses(jax_out)
    assert sorted(j_train) == list(range(1, 7)) and sorted(j_val) == [0, 2, 4, 6]
    for s in j_train:
        assert j_train[s] == pytest.approx(t_train[s], abs=LOSS_TOL), (s, j_train[s], t_train[s])
    for s in j_val:
        assert j_val[s] == pytest.approx(t_val[s], abs=LOSS_TOL), (s, j_val[s], t_val[s])
    t_ema, j_ema = _ema_losses(torch_out), _ema_losses(jax_out)  # the EMA's, evaluated as torch evaluates it
    assert sorted(j_ema) == [0, 2, 4, 6] and j_ema[0] == j_val[0] and j_ema[6] != j_val[6]
    for s in j_ema:
        assert j_ema[s] == pytest.approx(t_ema[s], abs=LOSS_TOL), (s, j_ema[s], t_ema[s])
    # the gradient norm before clipping, logged per step as torch logs it (fp32: summation order only)
    t_norm, j_norm = ({r["step"]: r["grad_norm"] for r in read_metrics(o)[0]} for o in (torch_out, jax_out))
    for s in j_train:
        assert j_norm[s] == pytest.approx(t_norm[s], rel=NORM_RTOL), (s, j_norm[s], t_norm[s])
    summary = json.loads((jax_out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"].startswith("jax")
    for name in ("loss.png", "sample.txt", "summary.txt", "train.log"):
        assert (jax_out / name).is_file(), name
    assert sorted(p.name for p in (jax_out / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4", "6"]


@pytest.mark.slow
def test_switch_torch_jax_torch(runs):
    """torch (W = 2) steps 1-2 → JAX (2 processes × 2 devices) steps 3-4 → torch (W = 3) steps 5-6, the
    same 12 sequences per step throughout: the losses and the EMA of the uninterrupted torch run (W = 2)."""
    tmp, common, torch_out, _, _ = runs
    out = tmp / "switch"
    shutil.copytree(torch_out, out)
    for step in ("4", "6"):
        shutil.rmtree(out / "checkpoints" / step)
    p = run_train(*common, "--steps", "6", "--backend", "jax", "--nproc", "2", "--devices-per-process", "2",
                  "--batch-size", str(GLOBAL_BATCH // 4), "--resume", "--out", str(out), cwd=tmp)
    assert p.returncode == 0, describe(p)
    shutil.rmtree(out / "checkpoints" / "6")  # torch resumes from JAX's checkpoint 4 (and trains 5-6 again)
    p = run_train_pooled(*common, "--steps", "6", "--nproc", "3", "--batch-size", str(GLOBAL_BATCH // 3), "--resume",
                         "--out", str(out), cwd=tmp)
    assert p.returncode == 0, describe(p)
    (t_train, t_val), (s_train, s_val) = _losses(torch_out), _losses(out)
    assert sorted(s_train) == list(range(1, 7))
    for s in range(3, 7):
        assert s_train[s] == pytest.approx(t_train[s], abs=LOSS_TOL), (s, s_train[s], t_train[s])
    assert s_val[6] == pytest.approx(t_val[6], abs=LOSS_TOL)
    assert _ema_losses(out)[6] == pytest.approx(_ema_losses(torch_out)[6], abs=LOSS_TOL)
    want = saved_tensors(torch_out / "checkpoints" / "6", "ema")
    err = normwise_rel_err(saved_tensors(out / "checkpoints" / "6", "ema"), want)
    print(f"EMA at step 6, switched run vs torch only: {err:.2e} (normwise relative)")
    assert err < EMA_RTOL
    live = saved_tensors(torch_out / "checkpoints" / "6")
    assert normwise_rel_err(live, want) > 10 * EMA_RTOL  # the test can fail: the EMA is not the weights
    assert json.loads((out / "summary.json").read_text())["world_size"] == 3


def test_bad_input_is_one_line(tmp_path):
    p = run_train("--backend", "jax", "--mixed-precision", "fp16", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert p.returncode == 2, describe(p)
    assert p.stderr.strip().splitlines() == [
        "chunkzero train: error: --mixed-precision fp16 is not supported by --backend jax (it trains in fp32 or bf16, "
        "without loss scaling)"]
    assert not (tmp_path / "o").exists()
