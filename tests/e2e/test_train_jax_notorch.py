"""The JAX path without torch: with a ``torch`` package that raises ImportError first on ``PYTHONPATH``,
``chunkzero train --backend jax --nproc 2`` trains, checkpoints and reports, ``chunkzero inspect`` and
``chunkzero layout`` run, and ``jax_backend.restore_chunks`` reads the checkpoint; then the torch engine
(torch importable again) continues that JAX run at another world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .helpers import SMALL, chunkzero_cmd, clean_env, describe, make_corpus, read_metrics, run_train, run_train_pooled

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """``(env, tmp)``: an environment in which ``import torch`` raises ImportError."""
    tmp = tmp_path_factory.mktemp("notorch")
    blocker = tmp / "blocker" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("torch is blocked for this test")\n')
    env = clean_env(CHUNKZERO_JAX_CACHE=str(tmp / "jax-cache"))
    env["PYTHONPATH"] = str(blocker.parent) + os.pathsep + env["PYTHONPATH"]
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr  # the blocker works
    return env, tmp


def test_jax_job_runs_without_torch_and_torch_continues_it(no_torch):
    env, tmp = no_torch
    corpus = make_corpus(tmp / "corpus")
    out = tmp / "run"
    common = [*SMALL, "--data", str(corpus), "--eval-interval", "2", "--save-interval", "2"]
    p = run_train(*common, "--backend", "jax", "--nproc", "2", "--steps", "4", "--batch-size", "6", "--out", str(out),
                  cwd=tmp, env=env)
    assert p.returncode == 0, describe(p)
    for name in ("metrics.jsonl", "loss.png", "summary.json", "sample.txt"):
        assert (out / name).is_file(), name
    assert sorted(d.name for d in (out / "checkpoints").iterdir() if d.name.isdigit()) == ["2", "4"]
    assert (out / "sample.txt").read_text().startswith("def ")
    assert [r["step"] for r in read_metrics(out)[0]] == [1, 2, 3, 4]
    # the compiled step, for the next start, from each process: their cache keys differ (each hashes its own
    # view of the devices), so an entry from process 0 alone would leave process 1 compiling on every restart;
    # in the directory of this CPU kind (Note [a cache per CPU])
    from jax_backend.processes import host_cpu_id

    assert len(list((tmp / "jax-cache" / host_cpu_id()).glob("jit_local_step-*"))) == 2

    for args in (["inspect", str(out / "checkpoints")], ["layout", "--model", "gpt-tiny", "--world-size", "2"]):
        p = subprocess.run(chunkzero_cmd(*args), cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, describe(p)
    code = ("import sys, jax_backend as jb\n"
            f"chunks, layout = jb.restore_chunks({str(out / 'checkpoints')!r}, jb.make_mesh(1))\n"
            "print(len(chunks), layout.world_size, 'torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, describe(p)
    assert p.stdout.split()[-2:] == ["1", "False"]

    p = run_train_pooled(*common, "--backend", "torch", "--nproc", "3", "--steps", "6", "--batch-size", "4", "--resume",
                         "--out", str(out), cwd=tmp)
    assert p.returncode == 0, describe(p)
    train, _ = read_metrics(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert train[4]["loss"] < train[0]["loss"]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 3


def test_the_torch_commands_without_torch_are_one_line_errors(no_torch):
    """``chunkzero train --backend torch`` and ``chunkzero plan`` need torch: without it, one line naming it
    and what runs without it (exit 2), not a traceback."""
    env, tmp = no_torch
    for args in (["plan", "--model", "gpt-tiny"], ["train", "--model", "gpt-tiny", "--out", str(tmp / "t")]):
        p = subprocess.run(chunkzero_cmd(*args), cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2, describe(p)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "needs torch" in lines[0] and "torch is blocked" in lines[0], p.stderr
        assert "--backend jax" in lines[0]


def test_compilation_cache_directory():
    from pathlib import Path

    from jax_backend.processes import compilation_cache_dir, host_cpu_id

    cpu = host_cpu_id()
    assert compilation_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/chunkzero/jax") / cpu
    assert compilation_cache_dir({}) == Path.home() / ".cache" / "chunkzero" / "jax" / cpu
    assert compilation_cache_dir({"CHUNKZERO_JAX_CACHE": "/c", "XDG_CACHE_HOME": "/x"}) == Path("/c") / cpu
    assert compilation_cache_dir({"CHUNKZERO_JAX_CACHE": "off"}) is None


def test_compilation_cache_is_per_cpu_kind():
    """A CPU with other instruction-set features gets another directory (Note [a cache per CPU]): executables
    compiled with AVX-512 or AMX must not be loaded where those instructions do not exist."""
    from jax_backend.processes import host_cpu_id

    xeon = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse4_2 avx2 avx512f amx_tile\n"
    epyc = "processor\t: 0\nmodel name\t: EPYC\nflags\t\t: fpu sse4_2 avx2 sse4a\n"
    assert host_cpu_id(xeon) != host_cpu_id(epyc)
    assert host_cpu_id(xeon) == host_cpu_id(xeon.replace("avx2 avx512f", "avx512f avx2"))  # the set, not the order
    assert host_cpu_id(xeon) == host_cpu_id(xeon.replace("model name\t: Xeon", "model name\t: Xeon 2"))
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\n"
    assert host_cpu_id(arm) != host_cpu_id(arm.replace(" sve", ""))
