"""``chunkzero train --ema-decay``: the live and the EMA weights evaluated at each evaluation, both on
``loss.png``, the EMA checkpointed with its decay and update count and resumed."""

from __future__ import annotations

import json

import pytest

from .helpers import SMALL, describe, read_metrics, run_train_pooled


@pytest.mark.slow
def test_train_with_ema_evaluates_both_and_resumes(corpus, tmp_path):
    """Two gloo workers, 4 steps, then a resume to 6 on one worker: every evaluation logs the EMA's
    loss; at step 0 it is the live loss exactly (the EMA starts at the initial weights), later it
    differs; the checkpoints hold the EMA with update counts 4 and 6; memory_report counts it."""
    from chunkzero.checkpoint import read_meta

    out = tmp_path / "run"
    args = ["--data", str(corpus), *SMALL, "--eval-interval", "2", "--sample-tokens", "0", "--save-interval", "4",
            "--ema-decay", "0.5", "--out", str(out)]
    proc = run_train_pooled(*args, "--steps", "4", "--nproc", "2", cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert read_meta(out / "checkpoints" / "4").ema.to_dict() == {"decay": 0.5, "update_count": 4, "warmup": False}
    proc = run_train_pooled(*args, "--steps", "6", "--nproc", "1", "--resume", "--allow-change", cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert read_meta(out / "checkpoints" / "6").ema.update_count == 6
    _, val = read_metrics(out)
    assert [r["step"] for r in val] == [0, 2, 4, 6]
    assert all("ema_val_loss" in r for r in val), val
    assert val[0]["ema_val_loss"] == val[0]["val_loss"]
    assert all(r["ema_val_loss"] != r["val_loss"] for r in val[1:]), val
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ema_val_loss_final"] == val[-1]["ema_val_loss"]
    assert sum(per["ema"] for per in summary["memory_report"]["bytes"].values()) > 0
    assert "EMA val loss" in (out / "summary.txt").read_text()
    assert (out / "loss.png").stat().st_size > 0


def test_loss_plot_draws_the_ema_validation_curve(tmp_path, monkeypatch):
    """plot_loss labels the live and the EMA validation curves when the metrics hold EMA losses."""
    import matplotlib.axes

    from chunkzero.job.report import Metrics, plot_loss

    labels = []
    original = matplotlib.axes.Axes.plot

    def recording(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    m = Metrics(None, [{"kind": "train", "step": 1, "loss": 3.0},
                       {"kind": "val", "step": 0, "val_loss": 3.5, "ema_val_loss": 3.5},
                       {"kind": "val", "step": 1, "val_loss": 3.0, "ema_val_loss": 3.2}])
    assert m.ema_val == [(0, 3.5), (1, 3.2)]
    plot_loss(tmp_path / "loss.png", m, "t")
    assert "validation (live weights)" in labels and "validation (EMA weights)" in labels
    labels.clear()
    plot_loss(tmp_path / "plain.png", Metrics(None, [{"kind": "val", "step": 0, "val_loss": 3.5}]), "t")
    assert labels == ["validation"]
