"""``chunkzero plan`` against what ``chunkzero train`` measures, and ``train`` refusing a run the plan says
does not fit, before any worker starts and with ``--out`` untouched."""

from __future__ import annotations

import json

import pytest

from chunkzero.memory_plan import MemoryPlan

from .helpers import clean_env, describe, refused_line, run_train
from .launcher_fork import run_forked

GPT2_RUN = ["--model", "gpt2", "--nproc", "2", "--batch-size", "2", "--seq-len", "256"]
"""The byte-level GPT-2 shape (86 M parameters) at W = 2, 2 x 256 tokens per rank, fp32 on CPU: half the
tokens of docs/memory_plan.md's table (its activations still weigh over 10% of the peak, so the mutant below
still fails), to keep the test's two ranks' compute to about a third of that run's."""
TOLERANCE = 0.10


def within(predicted: int, measured: int) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


def plan_json(args: list[str], cwd) -> dict:
    proc = run_forked(["plan", *args, "--json"], "torch", cwd, clean_env(), 300)  # as `chunkzero plan` runs
    assert proc.returncode == 0, describe(proc)
    return json.loads(proc.stdout)


def measured_peaks(args: list[str], tmp_path) -> tuple[list[int], dict]:
    out = tmp_path / "run"
    proc = run_train(*args, "--steps", "2", "--eval-batches", "1", "--sample-tokens", "0", "--out", str(out),
                     cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, describe(proc)
    summary = json.loads((out / "summary.json").read_text())
    return [int(m["peak_rss_mib"] * 2**20) for m in summary["peak_memory"]], summary


def _plan_of(doc: dict) -> MemoryPlan:
    from chunkzero.memory_plan import PlanSettings

    return MemoryPlan(PlanSettings(**doc["settings"]), doc["host"], doc["device"], doc["host_phase"],
                      doc["device_phase"], doc["num_chunks"], doc["chunk_size"], doc["param_numel"])


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "forgotten"), [
    ([], "activations"),                                # gpt2, 2 x 256, default chunks (43)
    (["--chunk-size", "45000000"], "gathered_chunks"),  # 2 chunks of 43 M elements: the gathered chunks weigh
], ids=["gpt2", "gpt2-two-chunks"])
def test_plan_within_ten_percent_of_measured_peak_rss(tmp_path, extra, forgotten):
    """Each rank's measured peak RSS of a 2-step run (torch's AdamW allocates its states in the first
    step, so the second is the first forward and backward beside them) is within 10% of ``chunkzero plan --json``'s
    ``peak_bytes_per_rank``; summary.json records the same figure; and the plan without the term that weighs
    most in this setting misses by more than 10% (a plan that forgot it would fail here)."""
    doc = plan_json(GPT2_RUN + extra, tmp_path)
    peaks, summary = measured_peaks(GPT2_RUN + extra, tmp_path)
    assert summary["planned_peak_bytes_per_rank"] == doc["peak_bytes_per_rank"]
    for rank, measured in enumerate(peaks):
        assert within(doc["peak_bytes_per_rank"], measured), (rank, doc["peak_bytes_per_rank"], measured, doc["host"])
        mutant = _plan_of(doc).without(forgotten)
        assert not within(mutant.peak_bytes_per_rank, measured), (forgotten, mutant.peak_bytes_per_rank, measured)


@pytest.mark.slow
def test_plan_of_a_saving_run_holds_its_peak(tmp_path):
    """A save after each step: Orbax's libraries, and the shards' staged copy, which the asynchronous save holds
    into the next step's peak or not, as its write is slow or fast (1,617 MiB measured on an idle machine, 1,774
    and 1,951 under two test runs' loads, against 1,894 planned). The plan takes the overlap: at most 5% under
    the measured peak (the RSS noise of a loaded machine), at most 25% over; a plan without the checkpoint term is
    under it (it said 1,237 MiB, 35% under a new user's saving run)."""
    args = GPT2_RUN + ["--save-interval", "1"]
    doc = plan_json(args, tmp_path)
    assert doc["host_phase"] == "save"
    peaks, _ = measured_peaks(args, tmp_path)
    for rank, measured in enumerate(peaks):
        planned = doc["peak_bytes_per_rank"]
        assert measured <= 1.05 * planned and planned <= 1.25 * measured, (rank, planned, measured)  # 5%: RSS noise
        assert _plan_of(doc).without("checkpoint_io").peak_bytes_per_rank < measured


@pytest.mark.slow
def test_train_refuses_a_run_that_does_not_fit_before_any_worker(tmp_path, monkeypatch, capsys):
    """The issue's run: gpt2-medium, 2 ranks of 512 x 1024 tokens (hundreds of GiB of activations): exit 2,
    one line with the predicted peak, what is available and the settings that fit; no worker started and
    ``--out`` untouched."""
    out = tmp_path / "out"
    line = refused_line(["--model", "gpt2-medium", "--nproc", "2", "--batch-size", "512", "--seq-len", "1024",
                         "--out", str(out)], "torch", monkeypatch, capsys)
    assert "predicted peak" in line and "available on this machine" in line, line
    assert "--batch-size" in line and "--grad-accum" in line and "--force" in line, line
    assert not out.exists()


def _fake_machine(monkeypatch, available: int):
    import torch_backend.plan

    monkeypatch.setattr(torch_backend.plan, "available_bytes", lambda device: (available, "available (test)"))


def test_refusal_leaves_an_existing_out_as_it_was(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    _fake_machine(monkeypatch, 2**20)  # 1 MiB: nothing fits
    line = refused_line(["--model", "gpt-tiny", "--nproc", "2", "--seq-len", "32", "--out", str(out)], "torch",
                        monkeypatch, capsys)
    assert "1.00 MiB" not in line and "0.00 GiB available (test)" in line and "no setting tried fits" in line
    assert list(out.iterdir()) == []


def test_force_starts_the_run_with_the_plan_in_its_config(tmp_path, monkeypatch):
    import torch_backend.train.launch
    from chunkzero.cli import main

    _fake_machine(monkeypatch, 2**20)
    started = []
    monkeypatch.setattr(torch_backend.train.launch, "launch",
                        lambda fn, args, nproc, timeout_s: started.append(args[0]) or {0: {"status": "ok"}})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    code = main(["train", "--model", "gpt-tiny", "--nproc", "2", "--seq-len", "32", "--force",
                 "--out", str(tmp_path / "out")])
    assert code == 0 and len(started) == 1
    assert started[0].planned_peak_bytes > 2**20  # the workers get the plan's figure, for summary.json
