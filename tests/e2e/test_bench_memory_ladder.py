"""``benchmarks/bench_memory.py --ladder`` on tiny rungs: a row per system, rungs above the cap not
tried, and a rung killed on its memory limit reported as such (the run itself ends well)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_memory.py"
TINY = ["--ladder-shape", "32:2:64:128"]  # 1 layer: 18,528 parameters; 64 layers: 667,680


def _ladder(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    jsonl = tmp_path / "ladder.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--ladder", *TINY, "--timeout-s", "240", "--jsonl", str(jsonl),
                          *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    return res, rows


@pytest.mark.slow
def test_ladder_gives_a_row_per_system_and_skips_rungs_above_the_cap(tmp_path):
    res, rows = _ladder(tmp_path, "--ladder-layers", "1", "64", "--ladder-max-params", "1e5")
    assert res.returncode == 0, res.stderr[-3000:]
    for engine in ("zero", "fsdp2", "ddp"):
        rungs = {r["layers"]: r for r in rows if r["kind"] == "rung" and r["engine"] == engine}
        assert rungs[1]["status"] == "ok", (rungs[1]["status"], rungs[1].get("error"))  # the rank's traceback tail
        assert rungs[1]["n_params"] == 18_528
        assert 0 < rungs[1]["group_peak_rss_bytes"] <= rungs[1]["limit_bytes"]
        # no --limit-gib: the limit is a share of MemAvailable as the rung started
        assert rungs[1]["limit_gib"] < rungs[1]["mem_available_gib"]
        assert rungs[64]["status"] == "not tried: above --ladder-max-params"
        (largest,) = [r for r in rows if r["kind"] == "largest" and r["engine"] == engine]
        assert largest["layers"] == 1 and largest["first_failing"] is None
        assert f"| {engine} | 1 | " in res.stdout, res.stdout


def test_ladder_rung_over_its_memory_limit_is_reported_not_a_crash(tmp_path):
    # 0.1 GiB for both ranks: the interpreters alone pass it, so the first rung is killed on its limit
    res, rows = _ladder(tmp_path, "--engines", "ddp", "--ladder-layers", "1", "2", "--limit-gib", "0.1")
    assert res.returncode == 0, res.stderr[-3000:]
    rungs = [r for r in rows if r["kind"] == "rung"]
    # stops there
    assert [(r["layers"], r["status"]) for r in rungs] == [(1, "over limit")], (rungs, res.stderr[-3000:])
    assert rungs[0]["limit_bytes"] == int(0.1 * 2**30) < rungs[0]["group_peak_rss_bytes"]
    (largest,) = [r for r in rows if r["kind"] == "largest"]
    assert largest["layers"] is None and largest["first_failing"] == "1 (over limit)"
    assert "| ddp | none |" in res.stdout and "1 (over limit)" in res.stdout, res.stdout
