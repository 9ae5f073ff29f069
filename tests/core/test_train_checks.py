"""``chunkzero train``'s input checks that need no worker (issue 32): every numeric option's bounds named by
its flag, ``--out`` apart from the ``--model`` directory, ``--resume``'s comparison of the settings that
shape the data stream, ``--schedule keep`` after a run that ended in its warm-up, ``--resume-step``'s later
steps set aside, and the CPU-oversubscription check both engines share."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from chunkzero.errors import ConfigError
from chunkzero.resume_check import check_resume_changes, resume_changes, run_settings, sampler_position
from chunkzero.run_dir import check_out_dir
from chunkzero.train_config import (
    TrainConfig,
    lr_at,
    option_fields,
    option_kind,
    resumed_schedule_steps,
    warn_schedule_change,
)
from chunkzero.workers import MAX_WORKERS_PER_CORE, check_cpu_workers

# ============================================================================================== bounds

BAD_VALUES = [  # (field, value, flag, the reason's text)
    ("min_lr_ratio", -1.0, "--min-lr-ratio", "must be >= 0"),
    ("min_lr_ratio", 1.5, "--min-lr-ratio", "must be <= 1"),
    ("weight_decay", -0.1, "--weight-decay", "must be >= 0"),
    ("max_norm", -1.0, "--max-norm", "must be >= 0"),
    ("seed", -1, "--seed", "must be >= 0"),
    ("seed", 2**64, "--seed", "must be <= 9223372036854775807"),
    ("timeout_s", 0.0, "--timeout", "must be > 0"),
    ("val_fraction", 0.0, "--val-fraction", "must be > 0"),
    ("val_fraction", 1.0, "--val-fraction", "must be < 1"),
    ("ema_decay", 1.0, "--ema-decay", "must be < 1"),
    ("resume_step", 0, "--resume-step", "must be >= 1"),
]


@pytest.mark.parametrize("name,value,flag,why", BAD_VALUES, ids=[f"{b[2]} {b[1]}" for b in BAD_VALUES])
def test_each_bound_is_refused_naming_its_flag(name, value, flag, why):
    with pytest.raises(ConfigError, match=f"^{flag} {why}, got "):
        TrainConfig(**{name: value, "resume": name == "resume_step"}).check()


@pytest.mark.parametrize("name,value,flag,why", BAD_VALUES, ids=[f"{b[2]} {b[1]}" for b in BAD_VALUES])
def test_the_cli_refuses_each_bound_in_one_line_before_anything_runs(name, value, flag, why, capsys, tmp_path,
                                                                      monkeypatch):
    from chunkzero.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["train", flag, str(value)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert f"argument {flag}: {why}, got" in err, err
    assert list(tmp_path.iterdir()) == []  # not even runs/


def _below(opt) -> float | None:
    """A value just outside the lower bound of an option, or ``None`` when it has none."""
    if opt.minimum is not None:
        return opt.minimum - 1
    if opt.above is not None:
        return opt.above
    return None


def test_every_numeric_option_has_a_lower_bound_that_check_refuses():
    """The review of issue 32's item 6, kept true: no number of ``chunkzero train`` is unbounded below."""
    for f, opt in option_fields():
        if option_kind(f) not in (int, float):
            continue
        bad = _below(opt)
        assert bad is not None, f"{f.name} has no lower bound"
        extra = {"resume": True} if f.name == "resume_step" else {}
        with pytest.raises(ConfigError, match=f"^{opt.flag or '--' + f.name.replace('_', '-')} must be"):
            TrainConfig(**{f.name: bad, **extra}).check()


def test_resume_options_need_resume():
    for kwargs, flag in (({"resume_step": 3}, "--resume-step"), ({"allow_change": True}, "--allow-change")):
        with pytest.raises(ConfigError, match=f"^{flag} needs --resume"):
            TrainConfig(**kwargs).check()
    TrainConfig(resume=True, resume_step=3, allow_change=True).check()


# ================================================================================ --out and --model

@pytest.mark.parametrize("where", ["is", "is inside", "contains"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_out_apart_from_the_model_directory(where, overwrite, tmp_path):
    model = tmp_path / "models" / "hf"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    out = {"is": model, "is inside": model / "run", "contains": tmp_path / "models"}[where]
    with pytest.raises(ConfigError, match=f"^--out {out} {where} the --model directory {model}: "):
        check_out_dir(TrainConfig(out=str(out), model=str(model), overwrite=overwrite))
    relative = Path("..") / model.parent.name / "hf"  # the same directory spelled another way
    with pytest.raises(ConfigError, match="the --model directory"):
        check_out_dir(TrainConfig(out=str(model / "." / "x" / ".."), model=str(model.parent / relative)))
    check_out_dir(TrainConfig(out=str(tmp_path / "elsewhere"), model=str(model)))
    check_out_dir(TrainConfig(out=str(tmp_path / "models-run"), model=str(model)))  # a sibling sharing a prefix
    check_out_dir(TrainConfig(out=str(model), model="gpt-tiny", overwrite=True))  # a model name, not a directory


# ================================================================================ --resume's comparison

DATA = {"source": "a/", "files": 6, "tokenizer": "bytes", "vocab_size": 256, "train_tokens": 1000,
        "val_tokens": 100, "notes": []}


def _cfg(**kw) -> TrainConfig:
    base = dict(seed=1337, seq_len=32, batch_size=4, grad_accum=1, mixed_precision="fp32", world_size=2, steps=8,
                schedule_steps=8, lr=3e-3, warmup=2, model="gpt-tiny", resume=True)
    return TrainConfig(**{**base, **kw})


def _saved(**kw) -> dict:
    return {**run_settings(_cfg(), 2, DATA), "counters": {}, **kw}


def test_the_same_settings_change_nothing():
    assert resume_changes(_cfg(), _saved(), DATA) == []
    assert resume_changes(_cfg(world_size=4, batch_size=2), _saved(), DATA) == []  # the same global batch
    assert resume_changes(_cfg(world_size=1, batch_size=8), _saved(), DATA) == []
    assert resume_changes(_cfg(steps=20, lr=1e-3), _saved(), DATA) == []  # the schedule's: warn_schedule_change's


@pytest.mark.parametrize("kw,expected", [
    ({"seed": 7}, ["--seed 7 (was 1337)"]),
    ({"seq_len": 16}, ["--seq-len 16 (was 32)", "128 tokens per step (was 256)"]),
    ({"grad_accum": 2}, ["--grad-accum 2 (was 1)", "512 tokens per step (was 256)"]),
    ({"mixed_precision": "bf16"}, ["--mixed-precision bf16 (was fp32)"]),
    ({"val_fraction": 0.1}, ["--val-fraction 0.1 (was 0.05)"]),
    ({"batch_size": 8}, ["--batch-size 8 (was 4)", "512 tokens per step (was 256)"]),
    ({"world_size": 1}, ["world size 1 (was 2)", "128 tokens per step (was 256)"]),
    ({"world_size": 4, "batch_size": 1}, ["--batch-size 1 (was 4)", "world size 4 (was 2)",
                                          "128 tokens per step (was 256)"]),
])
def test_each_change_is_named_with_both_values(kw, expected):
    assert resume_changes(_cfg(**kw), _saved(), DATA) == expected


def test_another_corpus_is_named_by_its_source_and_size():
    other = {**DATA, "source": "b/", "train_tokens": 2000, "files": 3}
    assert resume_changes(_cfg(), _saved(), other) == ["--data b/: 2000 train tokens in 3 file(s) (was a/: 1000 in 6)"]
    assert resume_changes(_cfg(), _saved(), {**DATA, "source": "./a", "notes": ["x"]}) == []  # moved, same corpus
    # an older checkpoint without the data: the run's config.json has its summary
    assert resume_changes(_cfg(), {**_saved(data=None), "data_summary": DATA}, other)[0].startswith("--data b/")


def test_a_setting_the_checkpoint_does_not_record_is_not_compared():
    assert resume_changes(_cfg(seed=7, batch_size=8), {"steps": 8, "world_size": 2}, DATA) == []


def test_a_change_is_refused_in_one_line_or_accepted_and_named(caplog):
    cfg = _cfg(seed=7, seq_len=16)
    with pytest.raises(ConfigError) as e:
        check_resume_changes(cfg, _saved(), "checkpoint 4", DATA)
    assert str(e.value) == ("--resume: --seed 7 (was 1337), --seq-len 16 (was 32), 128 tokens per step (was 256): "
                            "differs from the checkpointed run (checkpoint 4), which changes its data stream or "
                            "numbers; pass the checkpointed run's values, or --allow-change to continue with these")
    cfg.allow_change = True
    with caplog.at_level(logging.INFO, logger="chunkzero.train"):
        assert check_resume_changes(cfg, _saved(), "checkpoint 4", DATA) == [
            "--seed 7 (was 1337)", "--seq-len 16 (was 32)", "128 tokens per step (was 256)"]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert caplog.records[0].getMessage().startswith("warning: --resume --allow-change: --seed 7 (was 1337), ")
    assert check_resume_changes(_cfg(), None, "config.json", DATA) == []  # nothing recorded: nothing to compare


def test_the_validation_set_is_fixed_at_the_first_session():
    from chunkzero.resume_check import validation_sequences

    cfg = _cfg(eval_batches=2, batch_size=4, world_size=3)
    assert validation_sequences(cfg) == 24  # a fresh run: --eval-batches × --batch-size × workers
    assert validation_sequences(cfg, _saved(val_sequences=8)) == 8  # a resume keeps the checkpointed run's
    assert validation_sequences(cfg, {"eval_batches": 2, "batch_size": 4, "world_size": 1}) == 8  # older ones
    assert run_settings(_cfg(val_sequences=8), 2, DATA)["val_sequences"] == 8


def test_an_accepted_seed_change_continues_the_data_position_in_the_new_stream():
    meta = SimpleNamespace(data_position={"sampler": {"seed": 1337, "index": 12}})
    assert sampler_position(meta, _cfg(seed=7)) == {"seed": 1337, "index": 12}  # refused by the sampler
    assert sampler_position(meta, _cfg(seed=7, allow_change=True)) == {"seed": 7, "index": 12}


# ============================================================================== the schedule at --resume

def test_keep_after_a_run_that_ended_in_its_warmup_goes_on_to_the_peak():
    """A first run of 4 steps with a 30-step warm-up, resumed to 100 steps: keep froze the LR at 5/31 of
    the peak forever; now it reaches the peak at step 31 and decays over the 100 steps."""
    first = {"steps": 4, "schedule_steps": 4, "warmup": 30, "lr": 3e-3, "min_lr_ratio": 0.1}
    cfg = TrainConfig(steps=100, warmup=30, lr=3e-3, resume=True, schedule="keep")
    cfg.schedule_steps = resumed_schedule_steps(cfg, first)
    assert cfg.schedule_steps == 100
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[30] == max(lrs) == pytest.approx(3e-3) and lrs[99] == pytest.approx(3e-4)
    # a schedule that did decay is kept as before
    kept = TrainConfig(steps=100, warmup=2, lr=3e-3, resume=True)
    assert resumed_schedule_steps(kept, {**first, "warmup": 2}) == 4


def _schedule_log(caplog, previous: dict, cfg: TrainConfig, step: int) -> list[logging.LogRecord]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chunkzero.train"):
        warn_schedule_change(previous, "checkpoint", cfg, step)
    return caplog.records


def test_schedule_notices_warn_only_when_the_lr_leaves_the_saved_schedule(caplog):
    first = {"steps": 4, "schedule_steps": 4, "warmup": 30, "lr": 3e-3, "min_lr_ratio": 0.1}
    keep = TrainConfig(steps=100, warmup=30, lr=3e-3, resume=True, schedule="keep")
    keep.schedule_steps = resumed_schedule_steps(keep, first)
    [r] = _schedule_log(caplog, first, keep, 4)
    assert r.levelno == logging.WARNING and "ends inside its 30-step warm-up, so the warm-up goes on to the peak " \
                                                 "0.003 and the cosine decay spans the new 100 steps" in r.getMessage()
    # a run stopped in warm-up and resumed to more steps: stretching moves no LR in warm-up, so no warning
    crashed = {"steps": 20, "schedule_steps": 20, "warmup": 10, "lr": 3e-3, "min_lr_ratio": 0.1}
    stretch = TrainConfig(steps=40, warmup=10, lr=3e-3, resume=True, schedule="stretch", schedule_steps=40)
    [r] = _schedule_log(caplog, crashed, stretch, 5)
    assert r.levelno == logging.INFO and "warning" not in r.getMessage(), r.getMessage()
    # ... but after the warm-up it does move the LR
    [r] = _schedule_log(caplog, crashed, stretch, 15)
    assert r.levelno == logging.WARNING and r.getMessage().startswith("warning: --resume with --steps 40 (was 20)")


# ================================================================================ --resume-step

def _steps(root: Path, *steps: int) -> Path:
    for s in steps:
        for item in ("meta", "state"):
            (root / str(s) / item).mkdir(parents=True)
    return root


def test_later_steps_are_set_aside_not_deleted(tmp_path):
    from chunkzero.checkpoint import list_steps
    from chunkzero.run_dir import set_aside_later_steps

    root = _steps(tmp_path / "checkpoints", 2, 4, 6)
    assert set_aside_later_steps(root, 6) is None
    assert set_aside_later_steps(root, 2) == root / "after-2"
    assert list_steps(root) == [2] and list_steps(root / "after-2") == [4, 6]
    _steps(root, 4)  # the resumed run saved its own step 4; resumed from 2 again:
    assert set_aside_later_steps(root, 2) == root / "after-2-2" and list_steps(root / "after-2-2") == [4]


# ================================================================================ CPU workers per core

def test_more_cpu_workers_than_cores_warn_and_beyond_the_limit_are_refused(caplog):
    with caplog.at_level(logging.INFO, logger="chunkzero.train"):
        check_cpu_workers(2, "--nproc 2", cores=2)
        assert caplog.records == []
        check_cpu_workers(3, "--nproc 3", cores=2, threads_each=1)
        check_cpu_workers(4, "--nproc 2 × --devices-per-process 2 (4 devices)", cores=2)
    assert [r.getMessage() for r in caplog.records] == [
        "warning: --nproc 3 on 2 CPU core(s): the workers run oversubscribed, 1 thread each, and share the cores "
        "(slower per step, same results)",
        "warning: --nproc 2 × --devices-per-process 2 (4 devices) on 2 CPU core(s): the workers run oversubscribed "
        "and share the cores (slower per step, same results)"]
    with pytest.raises(ConfigError, match=rf"^--nproc 9 × --devices-per-process 4 \(36 devices\) is more than this "
                                          rf"machine allows: at most {2 * MAX_WORKERS_PER_CORE} CPU workers"):
        check_cpu_workers(36, "--nproc 9 × --devices-per-process 4 (36 devices)", cores=2)


def test_an_unreadable_latest_checkpoint_names_the_older_step_to_resume_from(tmp_path):
    """``--resume`` whose latest step's metadata is not readable (here: an empty metadata file) is refused
    before any worker, naming that step and the older one to pass as ``--resume-step``."""
    from chunkzero.run_dir import check_resume

    root = _steps(tmp_path / "checkpoints", 6, 9)
    (root / "9" / "meta" / "metadata").write_text("")
    with pytest.raises(ConfigError) as e:
        check_resume(TrainConfig(out=str(tmp_path), resume=True, steps=12))
    msg = str(e.value)
    assert msg.startswith("--resume: step 9 cannot be loaded: ") and "pass --resume-step 6" in msg, msg
