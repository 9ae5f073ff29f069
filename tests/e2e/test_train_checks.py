"""Issue 32's input checks on both engines, as a new user meets them: a ``--resume`` with another data
stream refused before any worker starts (or, with ``--allow-change``, named and recorded), ``--out`` equal
to the ``--model`` directory, ``--resume-step``, ``--schedule keep`` after a run that ended in its warm-up,
a corrupted checkpoint found by a worker, and the JAX launcher's CPU-oversubscription check.

Every refusal leaves ``--out`` byte for byte as it was: the folder's listing, modes and bytes are hashed
before and after (:func:`tree_hash`). The in-process refusals replace each engine's launcher by one that
fails the test, so they are proven to come before any worker starts.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from chunkzero.train_config import TrainConfig, lr_at

from .helpers import SMALL, describe, make_corpus, read_metrics, refused_line, run_train, run_train_pooled
from .test_train_edges import tree_hash

BACKENDS = ["torch", "jax"]
LR = 3e-3  # SMALL's


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def checkpointed(corpus, tmp_path_factory) -> Path:
    """4 steps of gpt-tiny on 1 torch worker, checkpointed at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("checkpointed")
    out = tmp / "run"
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "4", "--save-interval", "2", "--eval-interval",
                            "4", "--sample-tokens", "0", "--nproc", "1", "--out", str(out), cwd=tmp)
    assert proc.returncode == 0, describe(proc)
    return out




def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _sessions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"session"' in line]


# =============================================================== --resume compares the data stream's settings

CHANGES = {  # extra arguments: what the one line must name
    "seed": (["--seed", "7"], ["--seed 7 (was 1337)"]),
    "batch size": (["--batch-size", "8"], ["--batch-size 8 (was 4)", "256 tokens per step (was 128)"]),
    "sequence length": (["--seq-len", "16"], ["--seq-len 16 (was 32)", "64 tokens per step (was 128)"]),
    "precision": (["--mixed-precision", "bf16"], ["--mixed-precision bf16 (was fp32)"]),
    "world size": (["--nproc", "2"], ["world size 2 (was 1)", "256 tokens per step (was 128)"]),
    "grad accumulation": (["--grad-accum", "2"], ["--grad-accum 2 (was 1)"]),
    "data": (["--data", "OTHER"], ["--data ", "(was "]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CHANGES))
def test_a_resume_that_changes_the_data_stream_is_refused_before_any_worker(case, backend, corpus, checkpointed,
                                                                            tmp_path, monkeypatch, capsys):
    extra, expected = CHANGES[case]
    if "OTHER" in extra:
        other = tmp_path / "other"
        other.mkdir()
        for f in sorted(corpus.iterdir())[:2]:
            shutil.copy(f, other / f.name)
        extra = ["--data", str(other)]
    before = tree_hash(checkpointed)
    line = refused_line(["--data", str(corpus), *SMALL, "--steps", "6", "--nproc", "1", "--resume", "--out",
                     str(checkpointed), *extra], backend, monkeypatch, capsys)
    for text in expected:
        assert text in line, line
    assert "differs from the checkpointed run (checkpoint 4)" in line and "--allow-change" in line, line
    assert tree_hash(checkpointed) == before


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_allow_change_continues_names_the_change_and_records_it(backend, corpus, checkpointed, tmp_path):
    out = _copy(checkpointed, tmp_path)
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "5", "--eval-interval", "5", "--sample-tokens",
                            "0", "--nproc", "1", "--batch-size", "8", "--resume", "--allow-change", "--backend",
                            backend, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    change = ["--batch-size 8 (was 4)", "256 tokens per step (was 128)"]
    named = [line for line in proc.stderr.splitlines() if "--allow-change" in line]
    assert named == [f"warning: --resume --allow-change: {', '.join(change)} (against checkpoint 4); the run "
                     "continues with these"], proc.stderr
    assert [(s["step"], s.get("changes")) for s in _sessions(out)] == [(0, None), (4, change)]
    config = json.loads((out / "config.json").read_text())
    assert config["batch_size"] == 8 and config["resume_changes"] == change
    train, _ = read_metrics(out)
    assert [r["tokens"] for r in train][3:] == [4 * 128, 4 * 128 + 256]
    assert (out / "loss.png").stat().st_size > 0


# ================================================================================ --out and --model

@pytest.mark.parametrize("backend", BACKENDS)
def test_out_equal_to_the_model_directory_is_refused_and_the_model_kept(backend, corpus, tmp_path, monkeypatch,
                                                                        capsys):
    import torch
    import transformers

    torch.manual_seed(0)
    model = tmp_path / "hf"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2, embd_pdrop=0.0, attn_pdrop=0.0,
        resid_pdrop=0.0)).save_pretrained(model)
    before = tree_hash(tmp_path)
    for out in (model, model / "run"):
        line = refused_line(["--data", str(corpus), *SMALL, "--model", str(model), "--steps", "2", "--out", str(out),
                         "--overwrite"], backend, monkeypatch, capsys)
        assert f"--out {out} is{' inside' if out != model else ''} the --model directory {model}" in line, line
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_directory_without_weights_is_refused_before_any_worker(backend, corpus, tmp_path, monkeypatch,
                                                                         capsys):
    """A Hugging Face directory with a config.json and no weights: one line naming it, not a worker's late
    failure (the JAX engine reads safetensors only, so a pytorch_model.bin alone is refused there too)."""
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64,
                                                   "n_embd": 32, "n_layer": 1, "n_head": 2}))
    (model / "pytorch_model.bin.txt").write_text("not weights")
    args = ["--data", str(corpus), *SMALL, "--model", str(model), "--steps", "2", "--out", str(tmp_path / "run")]
    line = refused_line(args, backend, monkeypatch, capsys)
    assert f"--model directory {model} holds no weights (*.safetensors" in line, line
    (model / "pytorch_model.bin").write_bytes(b"")
    if backend == "jax":
        assert "holds no weights (*.safetensors)" in refused_line(args, backend, monkeypatch, capsys)
    assert not (tmp_path / "run").exists()


# ================================================================================ --resume-step

@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_step_resumes_from_an_older_step(backend, corpus, checkpointed, tmp_path, monkeypatch, capsys):
    out = _copy(checkpointed, tmp_path)
    args = ["--data", str(corpus), *SMALL, "--steps", "4", "--eval-interval", "4", "--sample-tokens", "0",
            "--nproc", "1", "--resume", "--out", str(out)]
    before = tree_hash(out)
    line = refused_line([*args, "--resume-step", "3"], backend, monkeypatch, capsys)
    assert line.startswith("chunkzero train: error: --resume-step 3: ") and line.endswith(
        f"{out / 'checkpoints'} holds no checkpoint of that step (steps present: 2, 4)"
    ), line
    line = refused_line([*args, "--steps", "2", "--resume-step", "2"], backend, monkeypatch, capsys)
    assert "is at step 2, and --steps 2 is the run's total" in line, line
    assert tree_hash(out) == before
    proc = run_train_pooled(*args, "--resume-step", "2", "--save-interval", "2", "--backend", backend, cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert [s["step"] for s in _sessions(out)] == [0, 2]
    # the abandoned step 4 is kept aside, and this run saved its own step 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4", "after-2"]
    aside = out / "checkpoints" / "after-2"
    assert sorted(p.name for p in aside.iterdir()) == ["4", "metrics.jsonl"]
    assert (aside / "metrics.jsonl").read_bytes() == (checkpointed / "metrics.jsonl").read_bytes()  # steps 3, 4 kept
    assert "the later checkpoint steps (4) are kept in" in proc.stderr
    resumed = {r["step"]: r["loss"] for r in read_metrics(out)[0]}
    first = {r["step"]: r["loss"] for r in read_metrics(checkpointed)[0]}
    assert sorted(resumed) == [1, 2, 3, 4] and resumed[2] == first[2]
    assert resumed[3] == pytest.approx(first[3], abs=1e-4 if backend == "jax" else 0)  # step 3 again, from step 2


# ================================================================================ --schedule keep

@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_keep_after_a_first_run_that_ended_in_its_warmup_reaches_the_peak(backend, corpus, tmp_path):
    """The new user's case: a first run ended inside its warm-up (2 of 6 steps); keep froze every later LR
    at 3/7 of the peak. It now goes on warming up to the peak and decays over the new --steps, with a warning."""
    out = tmp_path / "run"
    args = ["--data", str(corpus), *SMALL, "--warmup", "6", "--eval-interval", "100", "--sample-tokens", "0",
            "--nproc", "1", "--backend", backend, "--out", str(out)]
    proc = run_train_pooled(*args, "--steps", "2", "--save-interval", "2", cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    proc = run_train_pooled(*args, "--steps", "10", "--resume", cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    lrs = {r["step"]: r["lr"] for r in read_metrics(out)[0]}
    cfg = TrainConfig(steps=10, warmup=6, lr=LR)
    assert [lrs[s] for s in range(1, 11)] == pytest.approx([lr_at(s, cfg) for s in range(10)])
    assert lrs[7] == pytest.approx(LR) and lrs[10] == pytest.approx(LR * 0.1)
    [line] = [line for line in proc.stderr.splitlines() if "--schedule keep" in line]
    assert line.startswith("warning: --resume with --steps 10 (was 2)") and "ends inside its 6-step warm-up" in line


# ============================================================== a refusal found by a worker changes nothing

def _flip_a_byte(step_dir: Path) -> None:
    data = max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    b = bytearray(data.read_bytes())
    b[len(b) // 2] ^= 0x01
    data.write_bytes(bytes(b))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_corrupted_checkpoint_found_by_a_worker_leaves_out_unchanged(backend, corpus, checkpointed, tmp_path):
    """The checksum error comes from the workers' load; ``config.json``, ``metrics.jsonl``, ``train.log``
    and ``pids/`` were rewritten before it. Torch on 2 ranks (the ranks agree before anything is written);
    JAX on 1 process."""
    out = _copy(checkpointed, tmp_path)
    _flip_a_byte(out / "checkpoints" / "4")
    before = tree_hash(out)
    workers = ["--nproc", "2", "--batch-size", "2"] if backend == "torch" else ["--nproc", "1"]  # 4 rows per step
    proc = run_train("--data", str(corpus), *SMALL, "--steps", "6", "--sample-tokens", "0", *workers,
                     "--resume", "--backend", backend, "--out", str(out), cwd=tmp_path)
    assert proc.returncode != 0, describe(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert "corrupted" in last and "--resume-step 2" in last, describe(proc)
    assert tree_hash(out) == before


# ============================================================== the JAX launcher's CPU workers

def test_jax_warns_of_oversubscribed_cores_and_refuses_beyond_the_limit(corpus, tmp_path, monkeypatch, capsys,
                                                                        caplog):
    import jax_backend.train.checks as checks
    import jax_backend.train.run as run

    monkeypatch.setattr(checks, "available_cpu_cores", lambda: 2)
    args = ["--data", str(corpus), *SMALL, "--steps", "2", "--out", str(tmp_path / "run")]
    line = refused_line([*args, "--nproc", "9", "--devices-per-process", "4"], "jax", monkeypatch, capsys)
    assert line == ("chunkzero train: error: --nproc 9 × --devices-per-process 4 (36 devices) is more than this "
                    "machine allows: at most 16 CPU workers allowed (8 per available core)")

    class Launched(Exception):
        pass

    def launched(*a, **k):
        raise Launched

    monkeypatch.setattr(run, "launch_processes", launched)
    with caplog.at_level(logging.WARNING, logger="chunkzero.train"), pytest.raises(Launched):
        run.main(TrainConfig(backend="jax", data=[str(corpus)], model="gpt-tiny", seq_len=32, nproc=3,
                             devices_per_process=2, out=str(tmp_path / "run")))
    assert [r.getMessage() for r in caplog.records] == [
        "warning: --nproc 3 × --devices-per-process 2 (6 devices) on 2 CPU core(s): the workers run oversubscribed "
        "and share the cores (slower per step, same results)"]
    assert not (tmp_path / "run").exists()


# ============================================================== the validation set, whatever the world size

def _val_at_resumed_step_2(checkpointed: Path, corpus: Path, tmp_path: Path, *workers: str) -> float:
    """The validation loss a resume from ``checkpointed``'s step 2 (not evaluated there before) logs at step 2."""
    out = _copy(checkpointed, tmp_path)
    proc = run_train("--data", str(corpus), *SMALL, "--steps", "3", "--eval-interval", "100", "--sample-tokens", "0",
                     "--resume", "--resume-step", "2", "--allow-change", *workers, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    return {r["step"]: r["val_loss"] for r in read_metrics(out)[1]}[2]


@pytest.fixture(scope="module")
def val_on_one_worker(checkpointed, corpus, tmp_path_factory) -> float:
    return _val_at_resumed_step_2(checkpointed, corpus, tmp_path_factory.mktemp("val1"), "--nproc", "1")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_validation_loss_is_the_same_at_another_world_size(backend, corpus, checkpointed, val_on_one_worker,
                                                                tmp_path):
    """The validation set grew with the world size (a fixed number of micro-batches per worker): a resume on
    3 workers evaluated 3 times the sequences of the 1-worker run. Now the run's first session fixes the set
    (8 sequences here), and a resume on 3 workers splits it 3 + 3 + 2 (one padding row of weight 0): the
    same loss of the same weights."""
    workers = ["--nproc", "3"] if backend == "torch" else ["--nproc", "1", "--devices-per-process", "3"]
    val = _val_at_resumed_step_2(checkpointed, corpus, tmp_path, *workers, "--backend", backend)
    assert val == pytest.approx(val_on_one_worker, rel=1e-5)
