"""What the end-to-end tests' forked launchers (``tests/e2e/launcher_fork.py``) save per ``chunkzero train`` run.

The same gpt-tiny run at W = 2 (4 steps, ~200 KB of standard-library text), started as ``python -m
chunkzero.cli train`` (``spawned``) and as a launcher forked from a server that imported it once (``forked``),
alternated ``--repeats`` times. Prints each run's wall time (min / median / max), and each way's CPU over all its
runs (``getrusage(RUSAGE_CHILDREN)``: the forked runs' CPU is the server's children's, counted when the server
ends, so the server's own start is in the forked total).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_launcher_fork.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e import launcher_fork  # noqa: E402
from tests.e2e.helpers import SMALL, clean_env, make_corpus, run_train  # noqa: E402


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each way, alternated (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-launcher-fork-") as d:
        work = Path(d)
        corpus = make_corpus(work / "corpus")
        run_args = ["--data", str(corpus), *SMALL, "--nproc", "2", "--steps", "4", "--sample-tokens", "0"]
        walls: dict[str, list[float]] = {"spawned": [], "forked": []}
        cpus = dict.fromkeys(walls, 0.0)
        for i in range(args.repeats):
            for way in walls:
                out = work / f"run-{way}-{i}"
                cpu0, t0 = _children_cpu_s(), time.perf_counter()
                proc = run_train(*run_args, "--out", str(out), cwd=work, env=None if way == "forked" else clean_env())
                walls[way].append(time.perf_counter() - t0)
                if way == "forked" and i == args.repeats - 1:
                    launcher_fork._close_servers()  # its children's CPU is counted once it has waited for them
                cpus[way] += _children_cpu_s() - cpu0
                if proc.returncode != 0:
                    sys.exit(f"{way} run {i} failed:\n{proc.stderr[-3000:]}")
                shutil.rmtree(out)
    print(f"gpt-tiny, W = 2, 4 steps; {args.repeats} runs each, alternated; load average {os.getloadavg()[0]:.1f}\n")
    print("| launcher | wall s per run: min | median | max | CPU s per run (all runs' / runs) |")
    print("|---|---:|---:|---:|---:|")
    for way, w in walls.items():
        print(f"| {way} | {min(w):.1f} | {statistics.median(w):.1f} | {max(w):.1f} | {cpus[way] / len(w):.1f} |")


if __name__ == "__main__":
    main()
