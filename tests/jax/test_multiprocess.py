"""Multi-process JAX on CPU: 2 processes × 2 devices joined with jax.distributed (gloo collectives),
started by chunkzero.workers.launch_processes; the reduce-scatter every JAX step uses
(jax_backend.collectives.reduce_scatter_sum) checked against psum + a slice."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from chunkzero.workers import WorkerFailure, launch_processes

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process sets its own device count
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


KIB, MIB = 1 << 10, 1 << 20


def test_reduce_scatter_matches_psum_across_processes(tmp_path):
    """The method a multi-process CPU run uses is all_to_all + a local sum, and it equals psum plus a slice at
    every size; gloo's psum_scatter is only reported (jax-ml/jax#40830: wrong on some starts, right on others)."""
    sizes = [16 * KIB, 1 * MIB, 4 * MIB, 16 * MIB]
    results = launch_processes([sys.executable, str(HERE / "mp_reduce_scatter.py"), ",".join(map(str, sizes))], 2,
                               tmp_path, env=_env())
    for r in results:
        assert r["status"] == "ok", r
        assert (r["devices"], r["processes"], r["method"]) == (4, 2, "all_to_all")
        cases = {(x["dtype"], x["block_bytes"]) for x in r["records"]}
        assert cases == {(d, s) for d in ("float32", "float64") for s in sizes}
        for x in r["records"]:
            assert x["all_to_all_ok"], x


def test_a_failing_process_is_named(tmp_path):
    """A process that dies stops the run: WorkerFailure names it and its last error line."""
    code = ("import os, sys, time\n"
            "from chunkzero.workers import write_result\n"
            "i = int(os.environ['JAX_PROCESS_ID'])\n"
            "if i == 1:\n"
            "    write_result({'status': 'error', 'message': 'Traceback...\\nValueError: boom'}); sys.exit(1)\n"
            "time.sleep(60)\n")
    with pytest.raises(WorkerFailure) as e:
        launch_processes([sys.executable, "-c", code], 3, tmp_path, env=_env(), grace_s=2)
    assert e.value.rank == 1 and e.value.exitcode == 1
    assert "process 1" in str(e.value) and "ValueError: boom" in str(e.value)
    assert "then process(es) 0, 2 stopped" in str(e.value)


def test_checkpoint_checksums_at_two_processes(tmp_path):
    """A checkpoint saved by 2 processes × 2 devices records the checksums a single process computes from
    the whole arrays (each process checksums the shards it writes; JSON gathered), and a restore verifies
    them on every process: at 4 and 3 devices it loads, and after one flipped byte in an optimizer-state
    array every process refuses with the same error naming that array."""
    results = launch_processes([sys.executable, str(HERE / "mp_checksums.py"), str(tmp_path / "ckpt")], 2,
                               tmp_path, env=_env())
    for r in results:
        assert r["status"] == "ok", r
        assert r["record_is_reference"]
        assert r["restored"] == {"4": 4, "3": 3}
        assert r["refused"] and "array 'optim.exp_avg_sq.chunk_0000'" in r["refused"] and "/1/state" in r["refused"] \
            and "is corrupted" in r["refused"], r
    assert results[0]["refused"] == results[1]["refused"]
