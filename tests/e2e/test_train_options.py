"""``chunkzero train`` options and reports, in-process (no workers): ``--backend jax`` refusing hybrid
sharding, ``--ema-warmup``, the summary's chunk rows in flat / S = 1 / hybrid terms, a stale EMA loss
never reported as the final one, ``--sample-tokens 0`` drawing and writing no sample, ``chunkzero
inspect`` of a hybrid checkpoint, and a safetensors export loading strictly into the byte-level GPT."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chunkzero.errors import ConfigError
from chunkzero.train_config import TrainConfig


def test_jax_backend_refuses_a_hybrid_shard_group_size():
    with pytest.raises(ConfigError, match=r"--shard-group-size 2 \(hybrid sharding\) is for --backend torch.*all 4 "
                                          r"devices.*--shard-group-size 4"):
        TrainConfig(backend="jax", nproc=4, shard_group_size=2).check()
    with pytest.raises(ConfigError, match="--shard-group-size 1 .*all 2 devices"):  # the JAX launcher's 2 processes
        TrainConfig(backend="jax", shard_group_size=1).check()
    TrainConfig(backend="jax", nproc=2, devices_per_process=2, shard_group_size=4).check()  # S = W: flat, allowed
    TrainConfig(backend="torch", nproc=4, shard_group_size=2).check()


def test_ema_warmup_needs_an_ema_and_reaches_zero_ema():
    with pytest.raises(ConfigError, match="--ema-warmup needs --ema-decay"):
        TrainConfig(ema_warmup=True).check()
    cfg = TrainConfig(ema_decay=0.9, ema_warmup=True, model="gpt-tiny", mixed_precision="fp32", lr=1e-3)
    cfg.check()
    assert cfg.to_dict()["ema_warmup"] is True  # what config.json records
    from torch_backend.train.adapter import TorchAdapter
    from torch_backend.train.models import build_module

    engine = TorchAdapter(build_module(cfg), cfg, torch.device("cpu"))
    assert engine.ema.warmup and engine.ema.decay == 0.9 and engine.ema.current_decay() == pytest.approx(0.1)


def _chunk(s, r, intra=3 * 2**20, inter=2**20):
    return {"chunks": 2, "chunk_size": 100, "sharded_chunks": 2, "shard_bytes": 2**20, "param_bytes": 2**22,
            "model_state_bytes": 2**21, "peak_gathered_chunks": 1, "shard_group_size": s, "replicas": r,
            "intra_sent_bytes": intra, "inter_sent_bytes": inter}


def test_summary_names_s_and_r_only_when_hybrid():
    from chunkzero.job.report import chunk_rows

    flat = dict(chunk_rows({"chunks": [_chunk(3, 1, inter=0)] * 3, "world_size": 3, "mixed_precision": "fp32"}))
    assert "2 sharded over 3 rank(s)" in flat["chunks"], flat
    assert "S =" not in flat["collectives"] and "replica" not in flat["collectives"], flat
    assert "3.00 MiB" in flat["collectives"] and "this session" in flat["collectives"], flat

    ddp = dict(chunk_rows({"chunks": [_chunk(1, 2, intra=0)] * 2, "world_size": 2, "mixed_precision": "fp32"}))
    assert "replicated on each of the 2 rank(s)" in ddp["chunks"] and "DDP with chunked buckets" in ddp["chunks"], ddp
    assert "sharded over" not in ddp["chunks"] and "S =" not in ddp["collectives"], ddp
    assert "1.00 MiB" in ddp["collectives"], ddp

    hybrid = dict(chunk_rows({"chunks": [_chunk(2, 2)] * 4, "world_size": 4, "mixed_precision": "fp32"}))
    assert "S = 2 rank(s) per shard group, replicated R = 2 times (hybrid, W = 4)" in hybrid["chunks"], hybrid
    assert hybrid["collectives"].startswith("S = 2, R = 2: each rank sent 3.00 MiB") and "this session" in \
        hybrid["collectives"] and "1.00 MiB across the replicas" in hybrid["collectives"], hybrid
    assert "whole run" not in " ".join(flat.values()) + " ".join(hybrid.values())


def _report(tmp_path, history, **cfg_kwargs):
    """A rank-1 Report (it writes nothing) whose metrics hold ``history``, and a summary call."""
    from chunkzero.job.report import Report

    cfg = TrainConfig(out=str(tmp_path), steps=6, model="gpt-tiny", mixed_precision="fp32", **cfg_kwargs)
    report = Report(cfg, rank=1, world_size=1, device_type="cpu", backend="none", start=5,
                    tokens_per_step=8)
    for r in history:
        report.metrics.write(r)
    engine = SimpleNamespace(skipped_steps=0, memory_report=lambda: None)
    corpus = SimpleNamespace(summary=lambda: {"source": "x", "train_tokens": 1, "val_tokens": 1})
    return report, lambda **kw: report.summary(params=1, corpus=corpus, adapter=engine, val_loss=1.0, memory=[{}],
                                               chunks=[None], wall_time_s=1.0, **kw)


def test_a_dropped_ema_reports_no_final_ema_loss(tmp_path):
    """An earlier session's EMA loss (step 4) is not the final one of a resume to step 6 that keeps no EMA."""
    from chunkzero.job.report import summary_table

    history = [{"kind": "val", "step": 0, "val_loss": 5.0, "ema_val_loss": 5.0},
               {"kind": "val", "step": 4, "val_loss": 3.0, "ema_val_loss": 3.5},
               {"kind": "val", "step": 6, "val_loss": 2.5}]
    _, summary = _report(tmp_path, history)
    s = summary(prompt="def ", sample="def x")
    assert s["val_loss_final"] == 2.5 and s["ema_val_loss_final"] is None
    assert "EMA val loss" not in summary_table(s)
    _, summary = _report(tmp_path, history[:-1] + [{"kind": "val", "step": 6, "val_loss": 2.5, "ema_val_loss": 2.7}])
    assert summary(prompt="def ", sample="def x")["ema_val_loss_final"] == 2.7


def test_the_summarys_outputs_line_names_every_file_and_the_checkpoints(tmp_path):
    """A new user's run folder held summary.json, config.json and checkpoints/ that the outputs line left out."""
    from chunkzero.job.report import summary_table

    _, summary = _report(tmp_path, [{"kind": "val", "step": 6, "val_loss": 2.5}])
    line = next(x for x in summary_table(summary(prompt=None, sample=None)).splitlines() if x.startswith("outputs"))
    assert "summary.json" in line and "config.json" in line and "checkpoints/" not in line
    for step in (2, 4, 6, 8, 10):
        (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
    line = next(x for x in summary_table(summary(prompt=None, sample=None)).splitlines() if x.startswith("outputs"))
    assert line.endswith("checkpoints/ (steps 2 … 10, 5 in all))")


def test_sample_tokens_zero_writes_and_logs_no_sample(tmp_path, caplog):
    (tmp_path / "sample.txt").write_text("an earlier session's sample\n")
    report, summary = _report(tmp_path, [{"kind": "val", "step": 6, "val_loss": 2.5}], sample_tokens=0)
    s = summary(prompt=None, sample=None)
    assert s["sample"] is None
    report.is_main = True  # rank 0's outputs
    with caplog.at_level("INFO", logger="chunkzero.train"):
        report.finish(s)
    assert (tmp_path / "sample.txt").read_text() == "an earlier session's sample\n"  # kept, not replaced
    assert "sample (prompt" not in caplog.text and "sample.txt" not in (tmp_path / "summary.txt").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["sample"] is None


def test_the_sample_names_the_prompt_it_was_given(tmp_path):
    """With a sample, the summary's prompt is --prompt (decoded from the byte tokens), not ''."""
    from chunkzero.job.models import load_run_corpus
    from torch_backend.train.adapter import TorchAdapter
    from torch_backend.train.models import build_module, sample_text

    (tmp_path / "a.py").write_text("def f(x):\n    return x\n" * 400)
    cfg = TrainConfig(model="gpt-tiny", mixed_precision="fp32", lr=1e-3, data=[str(tmp_path / "a.py")], seq_len=16,
                      sample_tokens=4, block_size=64)
    engine = TorchAdapter(build_module(cfg), cfg, torch.device("cpu"))
    prompt, text = sample_text(engine.model, load_run_corpus(cfg), cfg, torch.device("cpu"))
    assert prompt == "def " and text.startswith("def ")


def test_cli_refuses_jax_hybrid_in_one_line(tmp_path):
    from .helpers import describe, run_train

    p = run_train("--backend", "jax", "--shard-group-size", "1", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert p.returncode == 2, describe(p)
    assert p.stderr.strip().splitlines() == [
        "chunkzero train: error: --shard-group-size 1 (hybrid sharding) is for --backend torch: --backend jax trains "
        "flat ZeRO-3 over all 2 devices (jax_backend.hybrid is not wired into chunkzero train); drop the option or "
        "pass --shard-group-size 2"]
    assert not (tmp_path / "o").exists()


def test_a_resume_takes_this_sessions_clipping_and_weight_decay(tmp_path):
    """``--resume --max-norm 0 --weight-decay 0.5`` clips nothing and decays at 0.5 from the resumed step on,
    although the checkpoint's optimizer settings (clipping at 1, decay 0.1) come back with its state."""
    from chunkzero.checkpoint.orbax_store import wait_until_finished
    from chunkzero.job import data as data_mod
    from chunkzero.run_dir import CHECKPOINT_DIR
    from torch_backend.train.adapter import TorchAdapter
    from torch_backend.train.loop import resume, save_step
    from torch_backend.train.models import build_module

    (tmp_path / "a.py").write_text("def f(x):\n    return x\n" * 400)
    from chunkzero.train_config import with_device_defaults

    first = with_device_defaults(TrainConfig(model="gpt-tiny", mixed_precision="fp32", data=[str(tmp_path / "a.py")],
                                             seq_len=16, out=str(tmp_path / "run"), max_norm=1.0, weight_decay=0.1),
                                 "cpu")
    adapter = TorchAdapter(build_module(first), first, torch.device("cpu"))
    sampler = data_mod.BatchSampler(np.arange(4096, dtype=np.uint16) % 256, seq_len=16, batch_size=2, rank=0,
                                    world_size=1, seed=0)
    save_step(1, adapter, sampler, first, {"tokens": 0, "train_time_s": 0.0}, {})
    wait_until_finished(tmp_path / "run" / CHECKPOINT_DIR)
    again = dataclasses.replace(first, max_norm=0.0, weight_decay=0.5, resume=True)
    resumed = TorchAdapter(build_module(again), again, torch.device("cpu"))
    assert resume(resumed, sampler, again, 0)[0] == 2
    assert resumed.optim.max_norm is None
    assert [g["weight_decay"] for g in resumed.optim.param_groups] == [0.5, 0.0]


def _resumed_report(tmp_path, lines: list[str], start: int):
    """A rank-0 Report resuming at ``start`` over a ``metrics.jsonl`` of ``lines``; the file after it."""
    from chunkzero.job.report import Report

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    cfg = TrainConfig(out=str(tmp_path), steps=10, model="gpt-tiny", mixed_precision="fp32", resume=True)
    report = Report(cfg, rank=0, world_size=1, device_type="cpu", backend="none", start=start, tokens_per_step=8)
    report.metrics.f.close()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resume_over_a_damaged_metrics_history_says_so_and_keeps_the_file(tmp_path, caplog):
    """Records missing or unreadable before the resumed step: a warning naming them, and the file as it was kept
    beside the rewritten one; a last line cut short by a kill is expected, and says nothing."""
    import logging

    train = [json.dumps({"kind": "train", "step": s, "loss": 1.0}) for s in range(1, 9)]
    whole = train[:5] + ['{"kind": "tr']  # cut short at the end (a kill): steps 1-5, resuming at 6
    with caplog.at_level(logging.WARNING, logger="chunkzero.train"):
        records = _resumed_report(tmp_path, whole, start=6)
    assert not caplog.records and not list(tmp_path.glob("metrics.jsonl.*"))
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5]

    damaged = train[:5] + ['{"kind": "tr', train[5], '{"kind": "tr']  # steps 7-8 lost, a bad line inside
    with caplog.at_level(logging.WARNING, logger="chunkzero.train"):
        records = _resumed_report(tmp_path, damaged, start=9)
    (warning,) = caplog.records
    assert "line(s) 6 cannot be read; step(s) 7-8 have no record" in warning.getMessage(), warning.getMessage()
    kept = tmp_path / "metrics.jsonl.before-resume-8"
    assert kept.read_text() == "".join(line + "\n" for line in damaged)  # the file as it was
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_a_validation_set_larger_than_the_held_out_split_is_warned_of(caplog):
    """``--eval-batches`` asking for more validation windows than the held-out split has distinct ones (a new
    user's 100,000 looked like a hung run): a warning naming the sizes and an --eval-batches that fits; none when
    the set fits."""
    import logging

    from chunkzero.job.checks import warn_oversized_validation

    cfg = TrainConfig(seq_len=32, batch_size=4, eval_batches=100_000)
    cfg.world_size, cfg.val_sequences = 2, 800_000
    fits = dataclasses.replace(cfg, eval_batches=8)
    fits.world_size, fits.val_sequences = 2, 64
    with caplog.at_level(logging.WARNING, logger="chunkzero.train"):
        warn_oversized_validation(fits, {"val_tokens": 2_416})
        assert not caplog.records
        warn_oversized_validation(cfg, {"val_tokens": 2_416})
    (warning,) = caplog.records
    text = warning.getMessage()
    assert "--eval-batches 100000 asks for 800,000 validation sequences of 32 tokens" in text, text
    assert "the 2,384 distinct ones of the held-out split (2,416 tokens)" in text and "--eval-batches 298" in text


def test_train_log_starts_with_what_rank_0_logged_before_out_opened(tmp_path):
    """What rank 0 logs before ``--out`` may be written (the data line, what a resume loaded: a torch resume's
    "resumed from step N" came before it) is in ``train.log`` once it opens, in order; other ranks keep none."""
    import logging

    from chunkzero.job.report import setup_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    log = logging.getLogger("chunkzero.train")
    try:
        setup_logging(1, None)
        log.warning("rank 1's, never in train.log")
        setup_logging(0, None)
        log.info("resumed from step 4")
        setup_logging(0, tmp_path)
        log.info("step 5")
        for h in root.handlers:
            h.flush()
        lines = (tmp_path / "train.log").read_text().splitlines()
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            if h not in saved[0]:
                h.close()
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    assert [line.split(": ", 1)[1] for line in lines] == ["resumed from step 4", "step 5"], lines
