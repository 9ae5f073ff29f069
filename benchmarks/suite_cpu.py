"""Where the test suite's CPU goes: each test's CPU seconds, its own and its subprocesses', summed by file.

On a machine with fewer cores than pytest workers the suite is CPU-bound, so its wall time is its CPU time over
the cores, and the way to a shorter run is less CPU. This runs pytest (the arguments given, by default the
Makefile's: cores + 1 workers, ``--dist loadgroup``, ``tests``) with itself loaded as a plugin (``-p suite_cpu``).
In each pytest process it reads ``getrusage`` before and after every test:

- **self**: the pytest process's own CPU (the test's in-process work: single-process tests, the test side of a
  distributed one);
- **children**: the CPU of the subprocesses the test waited for, with their own waited-for descendants (a
  ``chunkzero train`` run: its launcher and workers; ranks spawned for one test). The ranks of
  ``run_distributed``'s pools are waited for only when a pool closes, so their CPU lands in whichever test closes
  them, or, at the end of the run, in no test: the ``unattributed`` row;
- **wall**: the test's duration, setup and teardown included.

The last table compares the tests' CPU with the whole run's (``getrusage(RUSAGE_CHILDREN)`` of this script:
pytest and every process it waited for, the pools' ranks included).

    PYTHONPATH=. .venv/bin/python benchmarks/suite_cpu.py                  # the whole suite (~15 min on 2 cores)
    PYTHONPATH=. .venv/bin/python benchmarks/suite_cpu.py -- -n 3 tests/e2e/test_train.py
    PYTHONPATH=. .venv/bin/python benchmarks/suite_cpu.py --top 40 --json cpu.jsonl

Prints markdown tables; ``--json`` also keeps one JSON record per test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

OUT_ENV = "CHUNKZERO_SUITE_CPU_OUT"
CORES = len(os.sched_getaffinity(0))
DEFAULT_PYTEST_ARGS = ["-n", str(CORES + 1), "--dist", "loadgroup", "--no-loadscope-reorder", "-q", "-p",
                       "no:cacheprovider", "tests"]


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


# --- the plugin: pytest loads this module with ``-p suite_cpu`` ---------------------------------------------------

_started: dict[str, tuple[float, float, float]] = {}
_runs_tests = False


def pytest_configure(config):
    """Only a process that runs tests measures them: an xdist worker, or pytest without xdist (xdist's controller
    sees its workers' tests start and end, but runs none)."""
    global _runs_tests
    _runs_tests = bool(os.environ.get(OUT_ENV)) and (
        hasattr(config, "workerinput") or not config.getoption("numprocesses", None))


def pytest_runtest_logstart(nodeid, location):
    if _runs_tests:
        _started[nodeid] = (time.monotonic(), _cpu_s(resource.RUSAGE_SELF), _cpu_s(resource.RUSAGE_CHILDREN))


def pytest_runtest_logfinish(nodeid, location):
    if not _runs_tests or nodeid not in _started:
        return
    wall0, self0, children0 = _started.pop(nodeid)
    record = {"test": nodeid, "wall_s": time.monotonic() - wall0, "self_cpu_s": _cpu_s(resource.RUSAGE_SELF) - self0,
              "children_cpu_s": _cpu_s(resource.RUSAGE_CHILDREN) - children0}
    with open(os.environ[OUT_ENV], "a") as f:
        f.write(json.dumps(record) + "\n")


# --- the report ---------------------------------------------------------------------------------------------------

def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def summarize(records: list[dict], run_cpu_s: float, run_wall_s: float, top: int) -> str:
    """Markdown: the ``top`` files by CPU, the folders, and the run's totals."""
    by_file: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for r in records:
        row = by_file[_file_of(r["test"])]
        row[0] += 1
        row[1] += r["wall_s"]
        row[2] += r["self_cpu_s"]
        row[3] += r["children_cpu_s"]
    by_dir: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for name, row in by_file.items():
        parts = Path(name).parts
        folder = "/".join(parts[:2]) if len(parts) > 2 else name
        by_dir[folder] = [a + b for a, b in zip(by_dir[folder], row)]

    def table(title: str, rows: dict[str, list[float]], limit: int | None) -> list[str]:
        lines = [f"### {title}", "", "| where | tests | wall s | self CPU s | children CPU s | CPU s |",
                 "|---|---:|---:|---:|---:|---:|"]
        ranked = sorted(rows.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))
        for name, (n, wall, own, kids) in ranked[:limit]:
            lines.append(f"| `{name}` | {n} | {wall:.0f} | {own:.0f} | {kids:.0f} | {own + kids:.0f} |")
        return [*lines, ""]

    tests_cpu = sum(r["self_cpu_s"] + r["children_cpu_s"] for r in records)
    lines = [*table(f"The {top} files with the most CPU", by_file, top), *table("By folder", by_dir, None),
             "### The run", "", "| | s |", "|---|---:|",
             f"| wall | {run_wall_s:.0f} |",
             f"| CPU of pytest and every process it waited for | {run_cpu_s:.0f} |",
             f"| of which in the tests (self + children above) | {tests_cpu:.0f} |",
             f"| unattributed (collection, start-up, pools' ranks closed at the end) | {run_cpu_s - tests_cpu:.0f} |",
             f"| CPU / ({CORES} cores x wall) | {run_cpu_s / (CORES * run_wall_s):.2f} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=25, help="files in the first table (default 25)")
    parser.add_argument("--json", type=Path, help="also keep each test's record here (JSON lines)")
    parser.add_argument("pytest_args", nargs="*", help=f"pytest's arguments after `--` (default: "
                                                       f"{' '.join(DEFAULT_PYTEST_ARGS)})")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="chunkzero-suite-cpu-") as tmp:
        out = Path(tmp) / "tests.jsonl"
        env = {**os.environ, OUT_ENV: str(out),
               "PYTHONPATH": os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH")) if p)}
        cpu0, wall0 = _cpu_s(resource.RUSAGE_CHILDREN), time.monotonic()
        code = subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_cpu",
                               *(args.pytest_args or DEFAULT_PYTEST_ARGS)], env=env).returncode
        run_cpu_s, run_wall_s = _cpu_s(resource.RUSAGE_CHILDREN) - cpu0, time.monotonic() - wall0
        records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        if args.json:
            args.json.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"\n## Where the suite's CPU goes ({time.strftime('%Y-%m-%d %H:%M')}, {CORES} cores, pytest "
          f"exit {code}, load average at the end {os.getloadavg()[0]:.1f})\n")
    print(summarize(records, run_cpu_s, run_wall_s, args.top))
    return code


if __name__ == "__main__":
    sys.exit(main())
