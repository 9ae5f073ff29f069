"""The pieces of ``chunkzero train`` in-process (no workers): data, schedule, CLI, failure messages."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from chunkzero.errors import DataError


def test_cli_imports_no_framework_and_help_works():
    code = ("import sys, chunkzero.cli as c\n"
            "p = c.build_parser(); p.parse_args(['train'])\n"
            "import chunkzero.train_config, chunkzero.run_dir\n"
            "print(','.join(m for m in ('torch', 'jax', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    h = subprocess.run([sys.executable, "-m", "chunkzero.cli", "train", "--help"], capture_output=True, text=True)
    assert h.returncode == 0
    for flag in ("--data", "--model", "--nproc", "--steps", "--batch-size", "--seq-len", "--lr", "--mixed-precision",
                 "--chunk-size", "--out", "--seed", "--eval-interval", "--grad-accum", "--warmup"):
        assert flag in h.stdout


def _train_parser():
    import argparse

    from chunkzero.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _squeeze(text: str) -> str:
    return "".join(text.split())  # argparse re-wraps help text, at spaces and hyphens


def test_every_config_field_is_a_train_option_with_its_default_help_and_choices():
    """The options of ``chunkzero train`` are generated from TrainConfig: one per option field (and
    none else), with the field's flag, default, choices and help; ``--help`` shows help and default."""
    from chunkzero.train_config import TrainConfig, default_text, flag_of, option_fields

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    options = {f.name: (f, opt) for f, opt in option_fields()}
    resolved = {f.name for f in dataclasses.fields(TrainConfig) if "resolved" in f.metadata}
    assert options and resolved and set(options) | resolved == fields and not set(options) & resolved

    actions = {a.dest: a for a in _train_parser()._actions if a.dest != "help"}
    assert set(actions) == set(options)
    help_text = _squeeze(subprocess.run([sys.executable, "-m", "chunkzero.cli", "train", "--help"],
                                        capture_output=True, text=True, check=True).stdout)
    defaults = vars(_train_parser().parse_args([]))
    for name, (f, opt) in options.items():
        action = actions[name]
        assert action.option_strings == [flag_of(f)], name
        assert defaults[name] == f.default == getattr(TrainConfig(), name), name
        assert tuple(action.choices or ()) == tuple(opt.choices or ()), name
        assert _squeeze(opt.help) in _squeeze(action.help), name
        shown = default_text(f)
        expected = _squeeze(opt.help + (f" (default: {shown})" if shown else ""))
        assert expected in help_text, f"{flag_of(f)}: --help does not show {expected!r}"


def test_option_bounds_are_the_config_bounds():
    """A number below a field's bound is refused by the parser (one line, exit 2) and by
    ``TrainConfig.check`` (a ConfigError naming the flag); the bound itself (or just above) passes."""
    from chunkzero.errors import ConfigError
    from chunkzero.train_config import TrainConfig, flag_of, option_fields, option_kind

    bounded = [(f, opt) for f, opt in option_fields() if opt.minimum is not None or opt.above is not None]
    assert {f.name for f, _ in bounded} >= {"steps", "lr", "warmup", "timeout_s", "chunk_size", "save_interval"}
    parser = _train_parser()
    for f, opt in bounded:
        lowest = opt.minimum if opt.minimum is not None else opt.above
        bad = lowest - 1 if opt.minimum is not None else lowest
        good = lowest if opt.minimum is not None else lowest + 0.5
        kind = option_kind(f)
        with pytest.raises(SystemExit) as e:
            parser.parse_args([flag_of(f), str(kind(bad))])
        assert e.value.code == 2, f.name
        assert getattr(parser.parse_args([flag_of(f), str(kind(good))]), f.name) == kind(good)
        needs = {"resume": True} if f.name == "resume_step" else {}
        with pytest.raises(ConfigError, match=f"^{flag_of(f)} must be"):
            TrainConfig(**{f.name: kind(bad)}, **needs).check()
        TrainConfig(**{f.name: kind(good)}, **needs).check()
    for f, opt in option_fields():
        if opt.choices:
            with pytest.raises(ConfigError, match=f"^{flag_of(f)} must be one of"):
                TrainConfig(**{f.name: "nonsense"}).check()
    with pytest.raises(ConfigError, match="^--steps must be a whole number, got '5'"):
        TrainConfig(steps="5").check()
    with pytest.raises(ConfigError, match="--engine ddp .* fp32 only"):
        TrainConfig(engine="ddp", mixed_precision="bf16").check()
    with pytest.raises(ConfigError, match="cannot be combined with --overwrite"):
        TrainConfig(resume=True, overwrite=True).check()
    TrainConfig().check()


def test_lr_schedule_warmup_then_cosine():
    from chunkzero.train_config import TrainConfig, lr_at

    cfg = TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # rising during warm-up
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then decaying
    assert lrs[-1] == pytest.approx(1e-4)


@pytest.mark.parametrize("warmup", [5, 30])
def test_kept_schedule_stays_at_its_last_lr(warmup):
    """A run resumed with --schedule keep past its saved schedule (20 steps) stays at the LR of the
    schedule's last step, no climb to the peak, no drop to the floor; unless the warm-up (30 steps) was
    still going on there (issue 32: the LR froze below its peak): then keep continues the warm-up to the
    peak and decays over the new --steps."""
    import dataclasses

    from chunkzero.train_config import TrainConfig, lr_at, resumed_schedule_steps

    first = TrainConfig(steps=20, warmup=warmup, lr=3e-3, min_lr_ratio=0.1)
    span = resumed_schedule_steps(dataclasses.replace(first, steps=34, resume=True), first.to_dict())
    resumed = dataclasses.replace(first, steps=34, schedule_steps=span)
    last = lr_at(19, first)
    assert [lr_at(s, resumed) for s in range(20)] == [lr_at(s, first) for s in range(20)]
    if warmup < 20:
        assert span == 20 and [lr_at(s, resumed) for s in range(20, 34)] == [last] * 14
        assert last == pytest.approx(3e-4)
    else:
        assert span == 34 and lr_at(20, resumed) > last and lr_at(30, resumed) == pytest.approx(3e-3)
        assert lr_at(33, resumed) == pytest.approx(3e-4)  # then the cosine decay over steps 31-34


def test_defaults_follow_the_device(monkeypatch, tmp_path):
    """Left unset, --model, --mixed-precision and --lr take the device's defaults: gpt-mini in fp32 on CPU,
    the GPT-2 124M shape in bf16 on a GPU (fp16 before compute capability 8.0, fp32 for --engine ddp);
    values the user gives are kept. ``validate`` on a (pretend) GPU machine picks them by itself."""
    import torch

    from chunkzero.train_config import TrainConfig, with_device_defaults
    from torch_backend.train import resolve

    from .helpers import make_corpus

    def picked(cfg):
        return cfg.model, cfg.mixed_precision, cfg.lr

    assert picked(TrainConfig()) == (None, None, None)
    assert picked(with_device_defaults(TrainConfig(), "cpu")) == ("gpt-mini", "fp32", 3e-3)
    assert picked(with_device_defaults(TrainConfig(), "cuda")) == ("gpt2", "bf16", 6e-4)
    assert picked(with_device_defaults(TrainConfig(), "cuda", bf16_supported=False)) == ("gpt2", "fp16", 6e-4)
    assert with_device_defaults(TrainConfig(engine="ddp"), "cuda").mixed_precision == "fp32"
    given = TrainConfig(model="gpt-tiny", mixed_precision="fp16", lr=1e-3)
    assert picked(with_device_defaults(given, "cuda")) == ("gpt-tiny", "fp16", 1e-3)

    corpus = make_corpus(tmp_path / "corpus")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for capability, precision in (((9, 0), "bf16"), ((7, 0), "fp16")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=0, c=capability: c)
        cfg, _ = resolve.validate(TrainConfig(data=[str(corpus)], out=str(tmp_path / "run")))
        assert (cfg.device, cfg.world_size, *picked(cfg)) == ("cuda", 1, "gpt2", precision, 6e-4)
        assert cfg.block_size == 1024


# ------------------------------------------------------------------------------------------ data

def _write(tmp_path, files: dict[str, bytes]):
    for rel, data in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def test_text_corpus_split_by_file_is_deterministic(tmp_path):
    from chunkzero.job.data import is_val_file, load_corpus

    files = {f"d/m{i}.py": (f"# module {i}\n" * 40).encode() for i in range(60)}
    files["d/.hidden"] = b"secret" * 100
    files["d/blob.bin.dat"] = b"\0\1\2" * 100  # binary: skipped
    _write(tmp_path, files)
    a = load_corpus([str(tmp_path / "d")], seq_len=16, val_fraction=0.2)
    b = load_corpus([str(tmp_path / "d")], seq_len=16, val_fraction=0.2)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    n_val = sum(is_val_file(f"d/m{i}.py", 0.2) for i in range(60))
    assert 0 < n_val < 60
    assert a.val.size == sum(len(files[f"d/m{i}.py"]) for i in range(60) if is_val_file(f"d/m{i}.py", 0.2))
    assert a.train.size + a.val.size == sum(len(files[f"d/m{i}.py"]) for i in range(60))
    assert a.train.dtype == np.uint8 and a.vocab_size == 256
    assert a.notes == [f"split by file: {n_val} of 60 files in validation"]  # near --val-fraction: nothing more


def test_a_coarse_split_by_file_names_its_share_of_the_tokens(tmp_path):
    """Three files, one of which hashes into validation: a third of the tokens against --val-fraction 0.05,
    which the note says, with what to do."""
    from chunkzero.job.data import is_val_file, load_corpus

    names = ["f6.txt", "f0.txt", "f1.txt"]
    assert [is_val_file(f"d/{n}", 0.05) for n in names] == [True, False, False]
    _write(tmp_path, {f"d/{n}": b"x = 1\n" * 100 for n in names})
    c = load_corpus([str(tmp_path / "d")], seq_len=16, val_fraction=0.05)
    assert c.val.size * 3 == c.train.size + c.val.size
    [note] = c.notes
    assert note.startswith("split by file: 1 of 3 files in validation, 33% of the tokens against --val-fraction "
                           "0.05 (with few files"), note


def test_small_corpus_falls_back_to_a_positional_split(tmp_path):
    from chunkzero.job.data import load_corpus

    _write(tmp_path, {"one.txt": b"x" * 1000})
    c = load_corpus([str(tmp_path / "one.txt")], seq_len=16, val_fraction=0.1)
    assert c.train.size == 900 and c.val.size == 100
    with pytest.raises(DataError, match="shorter than one sequence"):
        load_corpus([str(tmp_path / "one.txt")], seq_len=1000)


def test_a_binary_file_named_directly_is_refused(tmp_path):
    from chunkzero.job.data import load_corpus

    _write(tmp_path, {"weights.safetensors": b"\0\1\2" * 1000})
    with pytest.raises(DataError, match="binary.*weights.safetensors"):
        load_corpus([str(tmp_path / "weights.safetensors")], seq_len=16)


def test_default_corpus_is_the_standard_library():
    from chunkzero.job.data import find_text_files

    files = find_text_files(None)
    assert len(files) > 300
    assert all(f.rel.endswith(".py") for f in files)
    assert not any(part in ("site-packages", "test") for f in files for part in f.rel.split("/")[:-1])
    assert 5e6 < sum(f.size_bytes for f in files) < 40e6


def test_batches_are_deterministic_and_differ_per_rank():
    from chunkzero.job.data import BatchSampler, val_batches

    tokens = np.arange(10_000, dtype=np.uint16) % 251
    make = lambda rank: BatchSampler(tokens, seq_len=8, batch_size=3, rank=rank, world_size=2, seed=5)  # noqa: E731
    r0, r0b, r1 = make(0), make(0), make(1)
    x0, y0 = r0.next()
    x0b, _ = r0b.next()
    x1, _ = r1.next()
    assert x0.shape == (3, 8) and x0.dtype == np.int64 and isinstance(x0, np.ndarray)
    assert (x0 == x0b).all() and not (x0 == x1).all()
    assert (x0[:, 1:] == y0[:, :-1]).all()
    # resumable from a JSON-able position
    for _ in range(4):
        r0.next()
    state = json.loads(json.dumps(r0.state_dict()))
    expected = r0.next()
    resumed = make(0)
    resumed.load_state_dict(state)
    assert all((a == b).all() for a, b in zip(resumed.next(), expected))
    with pytest.raises(DataError, match="seed"):
        resumed.load_state_dict({"seed": 6, "index": 0})
    v1 = val_batches(tokens, seq_len=8, batch_size=2, rank=1, world_size=2, seed=5, n_sequences=6)
    v1b = val_batches(tokens, seq_len=8, batch_size=2, rank=1, world_size=2, seed=5, n_sequences=6)
    assert len(v1) == 2 and all((a[0] == b[0]).all() for a, b in zip(v1, v1b))  # 3 of the 6 rows: 2 + 1


@pytest.mark.parametrize("world", [2, 3, 4, 7, 9])
def test_the_validation_set_is_the_same_at_every_world_size(world):
    """Issue 32: the validation set grew with the world size (a fixed number of batches per worker). Now it
    is ``n_sequences`` in all (the run's first session fixes it): the rows of weight 1 over every rank are exactly the
    single worker's, each once; every rank runs the same micro-batch shapes (padding rows weigh 0)."""
    from collections import Counter

    from chunkzero.job.data import val_batches

    tokens = np.arange(1000, dtype=np.uint16)
    kw = dict(seq_len=8, batch_size=4, seed=5, n_sequences=12)
    [(x1, y1, w1), *more] = [b for b in val_batches(tokens, rank=0, world_size=1, **kw)]
    single = Counter(tuple(r) for x, _, w in [(x1, y1, w1), *more] for r, wr in zip(x, w) if wr == 1)
    assert sum(single.values()) == 12
    shares = [val_batches(tokens, rank=r, world_size=world, **kw) for r in range(world)]
    assert len({tuple(x.shape for x, _, _ in share) for share in shares}) == 1  # the same shapes on every rank
    assert all(x.shape[0] <= 4 and (y[:, :-1] == x[:, 1:]).all() for share in shares for x, y, _ in share)
    kept = Counter(tuple(r) for share in shares for x, _, w in share for r, wr in zip(x, w) if wr == 1)
    assert kept == single


# ------------------------------------------------------------------------------------------ failures

def test_failure_message_names_the_killed_rank_not_the_consequence():
    from torch_backend.train.launch import EXIT_PEER_LOST, describe_failure

    f = lambda rank, code, ts: SimpleNamespace(local_rank=rank, pid=100 + rank, exitcode=code, timestamp=ts,  # noqa: E731
                                               message="")
    err = describe_failure({0: f(0, EXIT_PEER_LOST, 10), 1: f(1, -signal.SIGKILL, 11)})
    assert err.rank == 1
    assert str(err).startswith("worker rank 1 (local rank 1, pid 101) was killed by SIGKILL")
    err = describe_failure({2: f(2, 1, 12), 3: f(3, 1, 11)})
    assert err.rank == 3 and "exited with code 1" in str(err)


# ------------------------------------------------------------------------------------------ run collectives

def _exchange(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from torch_backend.zero.collectives import all_gather_json, all_mean, barrier, world_group

    def refuse(*args, **kwargs):
        raise AssertionError("all_gather_object unpickles peer data")

    dist.all_gather_object = refuse
    group = world_group()
    obj = [None if rank == 1 else f"rank {rank} ✓ " * (rank + 1), {"out": f"/runs/{rank}", "peak": rank * 1.5}]
    gathered = all_gather_json(obj, group)
    barrier(group)
    return {"gathered": gathered, "mean": all_mean(float(rank + 1) / 3, group)}


def test_run_collectives_gather_json_and_mean_on_three_ranks():
    """Objects of different lengths reach every rank in rank order through tensors (all_gather_object
    is disabled in the ranks); the mean is the mean over the ranks; one process needs no group."""
    from torch_backend._testing import run_distributed
    from torch_backend.zero.collectives import all_gather_json, all_mean

    world = 3
    results = run_distributed(_exchange, world, timeout=120)
    expected = [[None if r == 1 else f"rank {r} ✓ " * (r + 1), {"out": f"/runs/{r}", "peak": r * 1.5}]
                for r in range(world)]
    for r in results:
        assert r["gathered"] == expected
        assert r["mean"] == pytest.approx(sum((k + 1) / 3 for k in range(world)) / world, rel=1e-12)
    assert all_gather_json({"a": 1}, None) == [{"a": 1}]
    assert all_mean(2.5, None) == 2.5


def test_checkpoint_saves_wait_at_most_timeout(monkeypatch, tmp_path):
    """``--timeout`` bounds every wait of a training run's checkpoint save for the other ranks."""
    import torch_backend
    from chunkzero.train_config import TrainConfig
    from torch_backend.train.loop import save_step

    calls = []
    monkeypatch.setattr(torch_backend, "save_checkpoint", lambda *a, **kw: calls.append(kw))
    sampler = SimpleNamespace(state_dict=lambda: {"position": 3})
    counters = {"tokens": 2048, "train_time_s": 1.5}
    cfg = TrainConfig(out=str(tmp_path), timeout_s=7.5)
    save_step(5, SimpleNamespace(model=None, optim=None), sampler, cfg, counters, {"seed": 1337})
    assert [(c["step"], c["timeout_s"], c["data_position"]) for c in calls] == [(5, 7.5, {"sampler": {"position": 3}})]
    from chunkzero.checkpoint.orbax_store import FINITE_KEY

    assert calls[0]["extra"] == {"seed": 1337, "counters": counters, FINITE_KEY: True}
