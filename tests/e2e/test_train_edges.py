"""``chunkzero train``'s edges as a new user meets them: a resume with nothing to train, a resume with
another model, an empty or unusable ``--out``, a resume that trains longer (the LR schedule kept or
stretched), and ``chunkzero layout`` speaking ``train``'s model names.

A refused run must change nothing in ``--out``: each refusal hashes the folder (paths, bytes, modes)
before and after, and the launcher is replaced by one that fails the test, so the refusal is proven to
come before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from chunkzero.train_config import TrainConfig, lr_at

from .helpers import SMALL, describe, read_metrics, refused_line, run_train_pooled

STEPS = 4
WARMUP, LR = 2, 3e-3  # SMALL's


def tree_hash(root: Path) -> str:
    """A hash of every entry under ``root``: relative path, kind, mode and the bytes of each file."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)}\0{st.st_mode}\0".encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def checkpointed(corpus, tmp_path_factory) -> Path:
    """A finished run of ``STEPS`` steps on 1 worker with its checkpoint at step ``STEPS``."""
    tmp = tmp_path_factory.mktemp("checkpointed")
    out = tmp / "run"
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", str(STEPS), "--save-interval", str(STEPS),
                            "--eval-interval", str(STEPS), "--nproc", "1", "--out", str(out), cwd=tmp)
    assert proc.returncode == 0, describe(proc)
    return out


RESUME_REFUSALS = {
    "steps at the checkpoint": (["--steps", str(STEPS)],
                                [f"is at step {STEPS}, and --steps {STEPS} is the run's total",
                                 f"pass --steps above {STEPS}"]),
    "steps below the checkpoint": (["--steps", "2"], [f"is at step {STEPS}, and --steps 2 is the run's total"]),
    "another model": (["--steps", "8", "--model", "gpt-mini"],
                      ["--model gpt-mini does not fit the checkpoint", f"(step {STEPS}, trained with --model gpt-tiny)",
                       "shape mismatch for 'transformer.wte.weight': expected (256, 256), got (256, 64)"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUME_REFUSALS))
def test_refused_resume_changes_nothing_and_starts_no_worker(case, corpus, checkpointed, monkeypatch, capsys):
    extra, expected = RESUME_REFUSALS[case]
    before = tree_hash(checkpointed)
    line = refused_line(["--data", str(corpus), *SMALL, "--nproc", "1", "--resume", "--out", str(checkpointed), *extra],
                        "torch", monkeypatch, capsys)
    for text in expected:
        assert text in line, line
    assert str(checkpointed / "checkpoints") in line
    assert tree_hash(checkpointed) == before


def test_empty_or_unusable_out_is_refused(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a directory\n")
    cases = [("", "--out is empty"), ("   ", "--out is empty"),
             (str(tmp_path / "a-file" / "run"), f"cannot be created: {tmp_path / 'a-file'} is not a directory")]
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        cases.append((str(locked / "run"), f"cannot be written: no write permission on {locked}"))
    for out, expected in cases:
        before = tree_hash(tmp_path)
        line = refused_line(["--data", str(corpus), *SMALL, "--steps", "2", "--out", out], "torch", monkeypatch, capsys)
        assert expected in line, (out, line)
        assert tree_hash(tmp_path) == before, out  # nothing written, in the working directory either


def _lrs(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(out)[0]}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["keep", "stretch"])
def test_resume_to_more_steps_keeps_or_stretches_the_schedule(schedule, corpus, checkpointed, tmp_path):
    """``--steps`` grown at ``--resume``: ``keep`` (the default) goes on with the saved schedule, which has
    reached its final LR (lr × 0.1), so the LR does not jump; ``stretch`` re-stretches the cosine to the new
    total and says the LR jumps. Either way the message names the choice."""
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    saved = _lrs(out)
    choice = [] if schedule == "keep" else ["--schedule", "stretch"]
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "6", "--eval-interval", "6", "--nproc", "1",
                            "--resume", "--out", str(out), *choice, cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    lrs = _lrs(out)
    assert [lrs[s] for s in range(1, STEPS + 1)] == [saved[s] for s in range(1, STEPS + 1)]
    original = TrainConfig(steps=STEPS, warmup=WARMUP, lr=LR)
    if schedule == "keep":
        assert lrs[5] == lrs[6] == pytest.approx(lr_at(STEPS - 1, original)) == pytest.approx(LR * 0.1)
        assert "--schedule keep: the LR follows the saved warm-up + cosine decay over 4 steps" in proc.stderr
        assert "warning:" not in proc.stderr
    else:
        stretched = TrainConfig(steps=6, warmup=WARMUP, lr=LR)
        assert lrs[5] == pytest.approx(lr_at(4, stretched)) and lrs[5] > 2 * lr_at(STEPS - 1, original)
        assert "warning: --resume with --steps 6 (was 4)" in proc.stderr and "--schedule stretch" in proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["schedule"] == schedule and config["schedule_steps"] == (STEPS if schedule == "keep" else 6)
    sessions = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"session"' in line]
    assert [(s["step"], s["world_size"]) for s in sessions] == [(0, 1), (STEPS, 1)]  # loss.png marks the resume


def test_layout_speaks_trains_model_names(capsys):
    """Every ``train --model`` name means the same model in ``layout`` (gpt-mini: train's 8 chunks of 136,960 at
    2 workers); Hugging Face GPT-2 is ``hf-gpt2``, another model than the byte-level ``gpt2``."""
    from chunkzero.cli import build_parser, main
    from chunkzero.configs import GPT_CONFIGS

    def layout(model: str, world: int) -> dict:
        assert main(["layout", "--model", model, "--world-size", str(world), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    mini = layout("gpt-mini", 2)
    assert (mini["num_chunks"], mini["chunk_size"]) == (8, 136_960)
    byte_gpt2, hf_gpt2 = layout("gpt2", 8), layout("hf-gpt2", 8)
    assert byte_gpt2["chunk_size"] != hf_gpt2["chunk_size"] or byte_gpt2["num_chunks"] != hf_gpt2["num_chunks"]
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = "".join(sub.choices["layout"].format_help().split())
    for name in (*GPT_CONFIGS, "hf-gpt2", "hf-gpt2-medium", "llama-1b"):
        assert name in text, name
