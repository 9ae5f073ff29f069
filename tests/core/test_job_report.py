"""The job's report (:mod:`chunkzero.job.report`) with non-finite losses: ``metrics.jsonl`` stays strict
JSON and ``loss.png`` marks the steps instead of dropping them."""

from __future__ import annotations

import json
import math

import numpy as np

from chunkzero.job.report import Metrics, loss_figure, plot_loss


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"bare {name}")

    return json.loads(line, parse_constant=refuse)


def _metrics(path):
    m = Metrics(path)
    m.write({"kind": "session", "step": 0, "world_size": 2})
    m.write({"kind": "val", "step": 0, "val_loss": 5.5})
    for step, loss in enumerate([5.4, 5.0, float("nan"), float("inf"), 4.8], start=1):
        m.write({"kind": "train", "step": step, "loss": loss, "grad_norm": loss, "skipped": not math.isfinite(loss)})
    m.write({"kind": "val", "step": 5, "val_loss": float("nan")})
    m.close()
    return m


def test_metrics_jsonl_is_strict_json_with_a_flag(tmp_path):
    _metrics(tmp_path / "metrics.jsonl")
    records = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert train[3]["loss"] is None and train[3]["grad_norm"] is None and train[3]["non_finite"] is True
    assert train[4]["loss"] is None and train[4]["non_finite"] is True
    assert train[5]["loss"] == 4.8 and "non_finite" not in train[5]
    assert records[-1] == {"kind": "val", "step": 5, "val_loss": None, "non_finite": True}
    # a resume reads them back (null as nan) and rewrites them strict
    again = Metrics(
        tmp_path / "metrics.jsonl", [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    )
    again.close()
    assert [s for s, v in again.train if math.isnan(v)] == [3, 4]
    assert all(_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_loss_png_marks_non_finite_steps(tmp_path):
    m = _metrics(tmp_path / "metrics.jsonl")
    fig = loss_figure(m, "t")
    ax = fig.axes[0]
    handles, labels = ax.get_legend_handles_labels()
    assert "non-finite loss (3 steps)" in labels  # train steps 3 and 4, validation at 5
    marks = handles[labels.index("non-finite loss (3 steps)")]
    assert np.asarray(marks.get_offsets())[:, 0].tolist() == [3, 4, 5]
    per_step = next(line for line in ax.get_lines() if line.get_label() == "train (per step)")
    assert list(per_step.get_xdata()) == [1, 2, 5]
    plot_loss(tmp_path / "loss.png", m, "t")
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_a_long_resume_label_stays_inside_the_plot_and_no_mean_of_one(tmp_path):
    """A new user's resume label (its world size and the changed settings) ran off the foot of loss.png, and a
    short run's legend offered 'train (mean of 1)', the per-step curve again."""
    m = Metrics(tmp_path / "metrics.jsonl")
    m.write({"kind": "session", "step": 0, "world_size": 2})
    for step in range(1, 31):
        m.write({"kind": "train", "step": step, "loss": 5.0 - step / 10})
    m.write({"kind": "session", "step": 30, "world_size": 3,
             "changes": ["world size 3 (was 2)", "6144 tokens per step (was 4096)", "--batch-size 16 (was 8)"]})
    for step in range(31, 41):
        m.write({"kind": "train", "step": step, "loss": 2.0})
    m.close()
    fig = loss_figure(m, "t")
    ax = fig.axes[0]
    assert not any(label.startswith("train (mean of") for label in ax.get_legend_handles_labels()[1])
    fig.canvas.draw()
    box = ax.get_window_extent()
    resume = next(t for t in ax.texts if t.get_text().startswith("resume at 30"))
    assert "6144 tokens" in resume.get_text().replace("\n", " ")
    assert resume.get_window_extent().y0 >= box.y0 - 1  # its foot inside the axes
