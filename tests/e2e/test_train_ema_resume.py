"""``chunkzero train --resume`` of an EMA run, as a user meets it: another ``--ema-decay`` (this run's
wins, said in one line, and config.json is true), no ``--ema-decay`` (the EMA dropped with one warning,
not one per rank, and no stale EMA loss in the summary), ``--sample-tokens 0`` (no sample drawn, an
earlier sample.txt kept) and a resume without ``--save-interval`` (one line: it saves nothing)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .helpers import SMALL, describe, read_metrics, run_train_pooled


@pytest.fixture(scope="module")
def ema_run(corpus, tmp_path_factory) -> Path:
    """2 steps on 1 worker with a warmed-up EMA of decay 0.5, checkpointed at step 2, with a sample."""
    tmp = tmp_path_factory.mktemp("ema_run")
    out = tmp / "run"
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "2", "--save-interval", "2", "--eval-interval",
                            "2", "--ema-decay", "0.5", "--ema-warmup", "--nproc", "1", "--out", str(out), cwd=tmp)
    assert proc.returncode == 0, describe(proc)
    return out


@pytest.mark.slow
def test_resume_with_another_ema_decay_uses_this_runs(corpus, ema_run, tmp_path):
    from chunkzero.checkpoint import read_meta

    out = tmp_path / "run"
    shutil.copytree(ema_run, out)
    assert read_meta(out / "checkpoints" / "2").ema.to_dict() == {"decay": 0.5, "update_count": 2, "warmup": True}
    assert json.loads((out / "config.json").read_text())["ema_warmup"] is True
    sample = (out / "sample.txt").read_text()
    assert sample.strip()
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "3", "--save-interval", "3", "--eval-interval",
                            "3", "--ema-decay", "0.9", "--sample-tokens", "0", "--nproc", "1", "--resume", "--out",
                            str(out), cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert read_meta(out / "checkpoints" / "3").ema.to_dict() == {"decay": 0.9, "update_count": 3, "warmup": False}
    assert "--ema-decay 0.9 (the checkpoint's: 0.5), --ema-warmup off (the checkpoint's: on): this run's setting " \
           "is used from step 3 on" in proc.stderr, proc.stderr
    assert "replaces the ZeroEMA's" not in proc.stderr  # one line, not the library's too
    config = json.loads((out / "config.json").read_text())
    assert config["ema_decay"] == 0.9 and config["ema_warmup"] is False
    # --sample-tokens 0: no sample drawn or printed, the earlier one kept
    assert "sample (prompt" not in proc.stderr and (out / "sample.txt").read_text() == sample
    assert json.loads((out / "summary.json").read_text())["sample"] is None
    assert "saves no checkpoint" not in proc.stderr


@pytest.mark.slow
def test_resume_without_ema_decay_drops_the_ema_once_and_reports_no_stale_ema_loss(corpus, ema_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(ema_run, out)
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "3", "--eval-interval", "3", "--sample-tokens",
                            "0", "--nproc", "2", "--resume", "--allow-change", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    dropped = [line for line in proc.stderr.splitlines() if "the EMA is dropped" in line]
    assert len(dropped) == 1 and "holds an EMA of the weights (decay 0.5, 2 updates)" in dropped[0], proc.stderr
    _, val = read_metrics(out)
    assert [r["step"] for r in val] == [0, 2, 3] and "ema_val_loss" in val[1] and "ema_val_loss" not in val[2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ema_val_loss_final"] is None and summary["val_loss_final_step"] == 3
    assert "EMA val loss" not in (out / "summary.txt").read_text()
    saying = [line for line in proc.stderr.splitlines() if "saves no checkpoint" in line]
    assert saying == ["--resume without --save-interval: this session saves no checkpoint (the latest stays step 2); "
                      "pass --save-interval N to keep saving"], proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]


@pytest.mark.slow
def test_jax_resume_drops_the_ema_with_one_warning(corpus, ema_run, tmp_path):
    """Resuming an EMA checkpoint on the JAX engine without --ema-decay drops the EMA with one warning, as torch
    does, and says how to keep it."""
    out = tmp_path / "run"
    shutil.copytree(ema_run, out)
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "3", "--eval-interval", "3", "--sample-tokens",
                            "0", "--backend", "jax", "--nproc", "1", "--resume", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    dropped = [line for line in proc.stderr.splitlines() if "the EMA is dropped" in line]
    assert len(dropped) == 1 and "holds an EMA of the weights (decay 0.5, 2 updates)" in dropped[0], proc.stderr
    assert "this run keeps none" in dropped[0] and "(to keep it, pass --ema-decay)" in dropped[0], dropped
