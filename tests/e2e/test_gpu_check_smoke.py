"""``benchmarks/gpu_check.sh --smoke``: the whole GPU check on the CPU (gloo, tiny models). Every part
must leave its rows in the JSON-lines file and its section in the markdown table, and the prefetch
comparison must be exact on every placement (on the CPU the kernels of both runs are the same)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_streams  # noqa: E402

PARTS = ("streams", "gpt2-124M", "placement", "gpt2-355M", "largest", "plan")


def _run_smoke(out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and every part it started
        stdout, _ = proc.communicate()
        raise AssertionError(f"gpu_check.sh --smoke ran past 400 s:\n{stdout[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")


def test_gpu_check_smoke_writes_every_part(tmp_path):
    res = _run_smoke(tmp_path)
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n--- log ---\n{log[-4000:]}"
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]

    assert [r for r in rows if r["kind"] == "env"], "no env row"
    status = {r["part"]: r for r in rows if r["kind"] == "part"}
    for part in PARTS:
        assert status[part]["status"] == "done", (part, status.get(part), log[-3000:])
        data = [r for r in rows if r["part"] == part and r["kind"] not in ("part", "note")]
        assert data, f"part {part} wrote no rows"
        assert not [r for r in data if r.get("error")], [r for r in data if r.get("error")]
    assert status["total"]["status"] == "finished"

    streams = [r for r in rows if r["kind"] == "streams"]
    assert {r["config"] for r in streams} == set(gpu_streams.CONFIGS)
    for r in streams:  # prefetch=1 vs prefetch=0 and the control, every placement: bitwise
        assert r["losses_equal"] and r["params_equal"] and r["max_abs_diff"] == 0.0 and r["verdict"] == "exact", r
    assert [r for r in streams if r["config"] == "auto50" and r["prefetch"] == 1][0]["moved_mib"] > 0

    for r in rows:
        if r["kind"] == "engine":
            assert r["tokens_per_s"] > 0 and r["timed_steps"] >= 1, r
    assert [r for r in rows if r["kind"] == "placement"][0]["moved_mib_per_step"] > 0
    assert [r["result"] for r in rows if r["kind"] == "rung"][-1] == "trains"
    plan = [r for r in rows if r["kind"] == "plan"]
    assert len(plan) == 1 and plan[0]["measured_mib"] > 0 and 0.5 < plan[0]["planned_over_measured"] < 2, plan

    md = (tmp_path / "gpu_check.md").read_text()
    for part in PARTS:
        assert f"### {part}\n" in md, part
    assert "| streams | done |" in md and "| total | finished |" in md
