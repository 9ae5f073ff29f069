"""``chunkzero train`` end to end: real processes, real gloo workers, a small real corpus.

Each test runs the command as a user would: ``python -m chunkzero.cli train ...``, a launcher forked from one
that imported it (``run_train``), or, where only what the run computes and writes is tested, the command in the
test's process with its workers on the rank pools (``run_train_pooled``). Nothing is asserted about wall-clock
speed except the bound on stopping after a worker dies (60 s, the issue's).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tiny_models import HF_GPT2_FOR_TRAIN, hf_gpt2_config

from .exit_probe import clean_exits, markers
from .helpers import SMALL, chunkzero_cmd, clean_env, describe, free_port, read_metrics, run_train, run_train_pooled

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HOOKED_TRAIN = Path(__file__).with_name("hooked_train.py")


@pytest.fixture
def held_run(tmp_path) -> Path:
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    (out / "loss.png").write_bytes(PNG_MAGIC + b"earlier")
    return out


def _check_run(out: Path, steps: int, world_size: int) -> tuple[list[dict], list[dict]]:
    train, val = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert val[0]["step"] == 0 and val[-1]["step"] == steps
    for r in train:
        assert {"loss", "lr", "loss_scale", "tokens", "tokens_per_s"} <= set(r)
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.5, f"validation loss did not fall: {val}"
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "sample.txt").read_text().strip()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == world_size and summary["steps"] == steps
    assert len(summary["peak_memory"]) == world_size
    assert "val loss" in (out / "summary.txt").read_text()
    assert sorted(p.name for p in (out / "pids").iterdir()) == [f"rank{r}.pid" for r in range(world_size)]
    return train, val


@pytest.mark.slow
def test_train_two_gloo_workers(corpus, tmp_path, held_run):
    """The main path's results (its workers on pooled ranks; the launch itself is the subprocess tests'):
    ``--out`` holds an earlier run, which ``--overwrite`` replaces."""
    out = held_run
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "24", "--eval-interval", "12", "--nproc", "2",
                            "--out", str(out), "--overwrite", cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    _check_run(out, steps=24, world_size=2)
    assert (out / "loss.png").read_bytes() != PNG_MAGIC + b"earlier"
    config = json.loads((out / "config.json").read_text())
    assert config["engine"] == "zero" and config["world_size"] == 2
    assert "summary" in proc.stderr and "tokens/s" in proc.stderr


@pytest.mark.slow
def test_same_seed_same_world_size_same_losses(corpus, tmp_path):
    args = ["--data", str(corpus), *SMALL, "--steps", "8", "--eval-interval", "4", "--sample-tokens", "0",
            "--seed", "7"]
    losses = []
    for name, run in (("a", run_train), ("b", run_train_pooled)):  # a launched run, and one on pooled ranks
        proc = run(*args, "--out", str(tmp_path / name), cwd=tmp_path)
        assert proc.returncode == 0, describe(proc)
        train, val = read_metrics(tmp_path / name)
        losses.append(([r["loss"] for r in train], [r["val_loss"] for r in val]))
    assert losses[0] == losses[1]
    assert len(set(losses[0][0])) > 1


def _process_state(rank: int, world_size: int) -> dict:
    """What a pooled run sets for its process and must put back: logging, the stop signals' handlers and state."""
    import logging
    import signal

    import chunkzero.workers as workers

    root = logging.getLogger()
    return {"pid": os.getpid(), "handlers": [type(h).__name__ for h in root.handlers], "level": root.level,
            "signals": [repr(signal.getsignal(s)) for s in workers.STOP_SIGNALS],
            "stop": repr((workers._stop_signals_owned, workers._outlived))}


def test_a_pooled_run_leaves_its_ranks_as_it_found_them(corpus, tmp_path):
    """The ranks of ``run_train_pooled`` are the pool's (the same processes before and after, a save included)
    and come back with their logging and stop-signal handling as they were, for the pool's next caller."""
    from torch_backend._testing import run_distributed

    before = run_distributed(_process_state, 2)
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--steps", "2", "--sample-tokens", "0", "--nproc", "2",
                            "--save-interval", "2", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert "step 2: train loss" in proc.stderr
    assert run_distributed(_process_state, 2) == before


@pytest.mark.slow
def test_torchrun_two_nodes_on_a_bin_token_file(corpus, tmp_path):
    """Two torchrun "nodes" on this machine (static rendezvous on localhost), one worker each, reading a
    nanoGPT-format train.bin with its val.bin."""
    import numpy as np

    data = b"".join(p.read_bytes() for p in sorted(corpus.iterdir()))
    np.frombuffer(data, dtype=np.uint8).astype(np.uint16).tofile(tmp_path / "train.bin")
    np.frombuffer(data[:20_000], dtype=np.uint8).astype(np.uint16).tofile(tmp_path / "val.bin")
    out = tmp_path / "run"
    port = str(free_port())
    procs = []
    for node_rank in ("1", "0"):
        cmd = [chunkzero_cmd()[0], "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", node_rank,
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
               "-m", "chunkzero.cli", "train", "--data", str(tmp_path / "train.bin"), *SMALL, "--steps", "16",
               "--eval-interval", "8", "--out", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, p, (stdout, stderr) in zip(("1", "0"), procs, results):
        trace = stderr[stderr.find("Traceback"):][:4000] if "Traceback" in stderr else stderr[-5000:]
        assert p.returncode == 0, f"node {node}: exit {p.returncode}\n{stdout[-2000:]}\n{trace}"
    _check_run(out, steps=16, world_size=2)
    assert json.loads((out / "summary.json").read_text())["data"]["val_tokens"] == 20_000


@pytest.mark.slow
def test_hugging_face_model_directory(corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = hf_gpt2_config(HF_GPT2_FOR_TRAIN)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf-model")
    assert (tmp_path / "hf-model" / "model.safetensors").is_file()
    out = tmp_path / "run"
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--model", str(tmp_path / "hf-model"), "--steps", "16",
                            "--eval-interval", "8", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    _check_run(out, steps=16, world_size=2)


def _chunks_logged(stderr: str) -> int:
    m = re.search(r"engine zero: (\d+) chunk\(s\) of", stderr)
    assert m, stderr[-3000:]
    return int(m.group(1))


@pytest.mark.slow
def test_default_run_shows_chunked_zero3(tmp_path):
    """The default model at the searched chunk size spans at least 4 chunks on the default 2 workers; the
    summary gives the chunk count, each rank's shard (half of the parameters) and the peak gathered."""
    out = tmp_path / "run"
    proc = run_train_pooled("--steps", "2", "--eval-batches", "1", "--sample-tokens", "0", "--out", str(out),
                            cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert _chunks_logged(proc.stderr) >= 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "gpt-mini" and summary["mixed_precision"] == "fp32" and summary["world_size"] == 2
    chunks = summary["chunks"]
    assert len(chunks) == 2 and chunks[0]["chunks"] == _chunks_logged(proc.stderr)
    assert sum(c["shard_bytes"] for c in chunks) == chunks[0]["param_bytes"]  # each rank holds half
    assert chunks[0]["param_bytes"] >= 4 * summary["params"]  # fp32, every parameter in a chunk
    assert all(1 <= c["peak_gathered_chunks"] < c["sharded_chunks"] for c in chunks)
    table = (out / "summary.txt").read_text()
    assert f"{chunks[0]['chunks']}, chunk size {chunks[0]['chunk_size']:,} elements (searched" in table
    assert "shard per rank" in table and "peak gathered" in table


@pytest.mark.slow
def test_more_workers_than_cores_run_oversubscribed(corpus, tmp_path):
    """``--nproc 3`` on 2 cores (the child is pinned to 2 of this machine's cores): a one-line warning,
    then 3 workers of 1 thread each train."""
    out = tmp_path / "run"
    cores = sorted(os.sched_getaffinity(0))[:2]
    python, *cli = chunkzero_cmd("train", "--data", str(corpus), *SMALL, "--nproc", "3", "--steps", "2",
                                 "--sample-tokens", "0", "--out", str(out))
    pin = (
        f"import os, sys; os.sched_setaffinity(0, {cores!r}); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    proc = subprocess.run([python, "-c", pin, *cli], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=600, check=False)  # pinned by exec, not preexec_fn: no fork of a threaded pytest
    assert proc.returncode == 0, describe(proc)
    warnings = [ln for ln in proc.stderr.splitlines() if "oversubscribed" in ln]
    assert len(warnings) == 1 and f"--nproc 3 on {len(cores)} CPU core(s)" in warnings[0], proc.stderr[-3000:]
    assert "1 thread each" in warnings[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 3 and len(summary["peak_memory"]) == 3


@pytest.mark.slow
def test_fp16_that_cannot_make_progress_stops_the_run(corpus, tmp_path):
    """A model whose fp16 forward overflows (embeddings of 1e6 > the fp16 maximum): every step is skipped,
    the loss scale halves from 2**16 to its minimum 1 by step 17, and the 10th skip at scale 1 (step 27)
    stops the run with one line naming the step and the scale, exit code 1."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = hf_gpt2_config(HF_GPT2_FOR_TRAIN)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.wte.weight.fill_(1e6)  # finite in fp32, inf once cast to fp16
    model.save_pretrained(tmp_path / "overflow")
    out = tmp_path / "run"
    proc = run_train_pooled("--data", str(corpus), *SMALL, "--model", str(tmp_path / "overflow"),
                            "--mixed-precision", "fp16", "--steps", "200", "--eval-interval", "1000",
                            "--sample-tokens", "0", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 1, describe(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("chunkzero train: error: step 27: 10 steps in a row were skipped"), proc.stderr[-3000:]
    assert "minimum loss scale 1," in last and "--max-skipped-steps 10" in last
    train, _ = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, 27)) and all(r["skipped"] for r in train)
    assert [r["loss_scale"] for r in train][15:18] == [2.0, 1.0, 1.0]


@pytest.mark.slow
def test_cumulative_counters_continue_across_resumes_at_other_world_sizes(corpus, tmp_path):
    """Steps 1-2 on 2 workers, a resume from step 2 on 1 worker (steps 3-4), then from step 4 on 2 workers
    (steps 5-6): ``tokens`` adds each session's own tokens per step, ``time_s`` keeps growing."""
    import shutil

    out = tmp_path / "run"
    args = ["--data", str(corpus), *SMALL, "--steps", "6", "--eval-interval", "6", "--sample-tokens", "0",
            "--save-interval", "2", "--out", str(out)]
    per_worker = 4 * 32  # --batch-size 4 × --seq-len 32, one micro-batch
    resume = ("--resume", "--allow-change")  # the tokens per step change with the world size
    for nproc, flags, dropped in (("2", (), ("4", "6")), ("1", resume, ("6",)), ("2", resume, ())):
        proc = run_train_pooled(*args, "--nproc", nproc, *flags, cwd=tmp_path)
        assert proc.returncode == 0, describe(proc)
        for step in dropped:  # as if the session had died after the checkpoint before
            shutil.rmtree(out / "checkpoints" / step)
    train, _ = read_metrics(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    sessions = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"session"' in line]
    assert [s.get("changes") for s in sessions] == [None, ["world size 1 (was 2)", "128 tokens per step (was 256)"],
                                                    ["world size 2 (was 1)", "256 tokens per step (was 128)"]]
    workers = [2, 2, 1, 1, 2, 2]
    assert [r["tokens"] for r in train] == [per_worker * sum(workers[:i + 1]) for i in range(6)]
    times = [r["time_s"] for r in train]
    assert times == sorted(set(times)), times  # strictly increasing
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == train[-1]["tokens"] and summary["world_size"] == 2
    steps_row = next(line for line in (out / "summary.txt").read_text().splitlines() if line.startswith("steps"))
    assert steps_row.split()[1:] == ["6", f"({2 * per_worker:,}", "tokens", "per", "step", "at", "this", "run's",
                                     "world", "size)"], steps_row  # not 6 × 256: the sessions' sizes differed


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["chunkzero", "torchrun"])
def test_workers_end_without_interpreter_finalization(launcher, corpus, tmp_path):
    """Each worker runs its exit hooks (``threading``'s, ``atexit``'s) and then leaves without finalizing the
    interpreter, where gloo's threads could abort it (``torch_backend.train.process_exit``): launched by
    ``chunkzero train`` and under torchrun alike. The probe is installed by an ``on_step_end`` hook."""
    probe = tmp_path / "markers"
    probe.mkdir()
    script = [str(HOOKED_TRAIN), f"exit-probe:{probe}", "train", "--data", str(corpus), *SMALL, "--steps", "2",
              "--eval-interval", "100", "--sample-tokens", "0", "--out", str(tmp_path / "run")]
    if launcher == "torchrun":
        script = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
    proc = subprocess.run([chunkzero_cmd()[0], *script], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert markers(probe) == clean_exits(["0", "1"])


# ------------------------------------------------------------------------------------------ a dying worker

@pytest.mark.slow
def test_killed_worker_stops_the_run_naming_the_rank(corpus, tmp_path):
    out = tmp_path / "run"
    bound_s = 60.0
    proc = subprocess.Popen(chunkzero_cmd("train", "--data", str(corpus), *SMALL, "--steps", "100000",
                                          "--eval-interval", "100000", "--sample-tokens", "0", "--out", str(out)),
                            cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and (out / "pids" / "rank1.pid").exists():
                if sum(1 for _ in open(out / "metrics.jsonl")) >= 4:
                    break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before the worker could be killed:\n" + proc.stderr.read()
        pid = int((out / "pids" / "rank1.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        stdout, stderr = proc.communicate(timeout=bound_s + 30)
        stopped_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert stopped_after < bound_s, f"the run took {stopped_after:.0f} s to stop"
    assert proc.returncode not in (0, 2), stderr
    last = [ln for ln in stderr.splitlines() if "error" in ln][-1]
    assert "worker rank 1" in last and "SIGKILL" in last, stderr[-3000:]
    assert f"pid {pid}" in last


@pytest.mark.slow
def test_killed_worker_under_torchrun(corpus, tmp_path):
    """Under torchrun the same death ends the run (torchrun's agent reports the rank), within the bound.
    Rank 1 kills itself after step 3 through an ``on_step_end`` hook (``hooked_train.py``)."""
    out = tmp_path / "run"
    cmd = [chunkzero_cmd()[0], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HOOKED_TRAIN), "kill:1:3", "train", "--data", str(corpus), *SMALL, "--steps", "100000",
           "--eval-interval", "100000", "--sample-tokens", "0", "--out", str(out)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    train, _ = read_metrics(out)
    assert len(train) <= 4  # it stopped right after rank 1 died at step 3
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause) and "SIGKILL" in root_cause, proc.stderr[-3000:]
    assert time.monotonic() - start < 240


# ------------------------------------------------------------------------------------------ bad input

BAD_INPUTS = {
    "missing path": (["--data", "{tmp}/nope"], "does not exist: {tmp}/nope"),
    "empty directory": (["--data", "{tmp}/empty"], "holds no text files: {tmp}/empty"),
    "corpus shorter than one sequence": (["--data", "{tmp}/short.txt"], "shorter than one sequence"),
    "too many workers": (["--nproc", "4096"], "--nproc 4096 is more than this machine allows: at most"),
    "unknown model": (["--model", "gpt-enormous"], "unknown model 'gpt-enormous'"),
    "fp16 where it cannot run": (["--mixed-precision", "fp16"], "--mixed-precision fp16 cannot run on cpu"),
    "out holds another run": (["--out", "{tmp}/earlier"], "holds another run (metrics.jsonl)"),
    "seq len beyond block size": (["--seq-len", "4096"], "--seq-len 4096 exceeds the block size 256 of model gpt-mini"),
    "bad number": (["--steps", "0"], "--steps: must be >= 1"),
    "missing model directory": (["--model", "./no-such-model"], "--model directory ./no-such-model does not exist"),
    "bin ids beyond vocabulary": (["--data", "{tmp}/wide.bin"], "token id 300 is not below"),
    "a file as --model": (["--model", "{tmp}/short.txt"], "--model {tmp}/short.txt is a file"),
    "a file named twice": (["--data", "{tmp}/texts", "{tmp}/texts/a.txt"], "names the file {tmp}/texts/a.txt more "
                           "than once (as texts/a.txt and a.txt)"),
    "out inside data": (["--data", "{tmp}/texts", "--out", "{tmp}/texts/run"],
                        "--out {tmp}/texts/run is inside the --data directory {tmp}/texts"),
    "out where no directory can be made": (["--out", "/proc/chunkzero-run"], "--out /proc/chunkzero-run cannot be"),
    "schedule without resume": (["--schedule", "stretch"], "--schedule stretch needs --resume"),
}


def _bad_input_files(tmp_path: Path) -> None:
    import numpy as np

    (tmp_path / "empty").mkdir()
    (tmp_path / "short.txt").write_text("print(1)\n")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("print('a line of text')\n" * 400)
    np.array([1, 2, 300] * 100, dtype=np.uint16).tofile(tmp_path / "wide.bin")


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_one_line_exit_2(case, tmp_path, held_run, monkeypatch, capsys):
    """In-process (the checks run in the launcher, before any worker): message, exit code, nothing touched."""
    from chunkzero.cli import main

    _bad_input_files(tmp_path)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    if "fp16" in case:  # the CPU kernels run fp16 here; make the precision probe say they do not
        import torch_backend.train.resolve

        monkeypatch.setattr(torch_backend.train.resolve, "precision_unsupported",
                            lambda precision, device: "float16 kernels unavailable" if precision == "fp16" else None)
    monkeypatch.chdir(tmp_path)
    args, expected = BAD_INPUTS[case]
    args = [a.format(tmp=tmp_path) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "fresh")]
    if "--steps" not in args:
        args += ["--steps", "2"]
    before = {p.name: p.read_bytes() for p in held_run.iterdir()}
    try:
        code = main(["train", *args])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("chunkzero train: error: ")
    assert expected.format(tmp=tmp_path) in lines[0]
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "runs").exists()  # nothing created
    assert sorted(p.name for p in (tmp_path / "texts").iterdir()) == ["a.txt"]
    assert {p.name: p.read_bytes() for p in held_run.iterdir()} == before  # nothing overwritten


def test_bad_input_from_the_command_line(tmp_path, held_run):
    """The same through a real process: one line on stderr, exit code 2, no traceback."""
    before = {p.name: p.read_bytes() for p in held_run.iterdir()}
    proc = run_train("--out", str(held_run), "--steps", "2", cwd=tmp_path)
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip() == (f"chunkzero train: error: --out {held_run} holds another run (metrics.jsonl); "
                                   "choose another --out, pass --resume to continue it, or --overwrite to replace it")
    assert proc.stdout == ""
    assert {p.name: p.read_bytes() for p in held_run.iterdir()} == before


def test_bad_input_under_torchrun(tmp_path):
    """Under torchrun the workers validate themselves: rank 0 prints the one line, all exit 2."""
    cmd = [chunkzero_cmd()[0], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "chunkzero.cli", "train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count(f"chunkzero train: error: --data path does not exist: {tmp_path}/nope") == 1
    assert "exitcode  : 2" in proc.stderr or "exitcode: 2" in proc.stderr
    assert not (tmp_path / "run").exists()
