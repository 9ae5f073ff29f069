"""The memory plan in ``benchmarks/gpu_check.sh``: ``chunkzero plan --json``'s predicted peak per rank beside
what a 3-step ``chunkzero train`` with the same options measures — ``torch.cuda.max_memory_allocated`` on a
GPU (gpt2, bf16, 8 × 1024 tokens, one worker), the peak RSS with ``--smoke`` (gpt-tiny on the CPU) — as one
``plan`` row of the check's JSONL (``planned_mib``, ``measured_mib``, ``planned_over_measured``).

    python benchmarks/gpu_plan.py ROWS.jsonl WORK_DIR [--smoke]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gpu_rows

GPU = ["--device", "cuda", "--model", "gpt2", "--mixed-precision", "bf16", "--batch-size", "8", "--seq-len", "1024"]
SMOKE = ["--device", "cpu", "--model", "gpt-tiny", "--batch-size", "4", "--seq-len", "64"]


def main(argv: list[str]) -> int:
    rows, work, smoke = argv[0], Path(argv[1]), "--smoke" in argv[2:]
    options = [*(SMOKE if smoke else GPU), "--nproc", "1"]
    cli = [sys.executable, "-m", "chunkzero.cli"]
    planned = json.loads(subprocess.run([*cli, "plan", *options, "--json"], check=True, capture_output=True,
                                        text=True).stdout)["peak_bytes_per_rank"] / 2**20
    run = work / "plan-run"
    subprocess.run([*cli, "train", *options, "--steps", "3", "--eval-batches", "1", "--sample-tokens", "0",
                    "--save-interval", "0", "--out", str(run), "--overwrite"], check=True)
    peak = json.loads((run / "summary.json").read_text())["peak_memory"][0]
    measure = "peak_rss_mib" if smoke else "peak_cuda_allocated_mib"
    measured = float(peak[measure])
    gpu_rows.add(rows, {"part": "plan", "kind": "plan", "options": " ".join(options), "measured_as": measure,
                        "planned_mib": round(planned, 1), "measured_mib": measured,
                        "planned_over_measured": round(planned / measured, 3)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
