"""The two engines of ``chunkzero train`` side by side: the default job's model at W = 2 on this machine.

Each repeat runs ``chunkzero train`` once per engine, in an order that alternates from repeat to repeat
(so a shared machine's drifting load hits both alike), on the same settings: the CPU default model
(``gpt-mini``), ``--seq-len`` and ``--batch-size`` at their defaults, fp32, W = 2 — torch as 2 gloo workers
(``--nproc 2``, each with cores / 2 intra-op threads, as ``chunkzero train`` sets them), JAX as 2 JAX
processes of 1 CPU device each (``--backend jax --nproc 2``; XLA:CPU's threads bound to cores / 2 in each
process as torch's, ``CHUNKZERO_CPU_THREADS``), twice: ``jax cold`` with an empty persistent compilation
cache (``CHUNKZERO_JAX_CACHE``, a new directory per run: a first start) and ``jax warm`` with the cache a
previous run filled (a restart; one run fills it before the repeats); ``jax-1proc``, one JAX process of
2 CPU devices (``--nproc 1 --devices-per-process 2``: the same W = 2, its collectives inside one
process), warm; ``jax-xla-threads``: ``jax-warm`` with XLA:CPU's own thread count (every core in each
process, ``CHUNKZERO_CPU_THREADS=0``: the JAX engine before issue 28's bound); ``jax-remat``: ``jax-warm``
with ``--activation-checkpointing`` (each stage recomputed in backward: the JAX step before issue 28). No
evaluation beyond the one at step 0, no checkpoint, no sample.

Each engine's **no-communication floor** (``torch-floor``, ``jax-floor``): the same two workers' compute with
nothing between them — two ``--nproc 1`` runs of that engine at once, each on its own half of the cores
(its affinity mask, so each runs cores / 2 threads as a worker of the W = 2 run does), each its own W = 1
(torch: no process group beyond itself; JAX: one device, no collective). Their tokens/s is the two runs'
sum, their first step and start-up the slower run's, their peak RSS one per run. ``jax-floor`` runs warm.

Per engine, over the repeats (min / median / max):

- **tokens/s**: tokens per step / the median step time of steps 2 … ``--steps`` (``metrics.jsonl``'s
  training seconds);
- **first step s**: step 1's time, which for JAX includes tracing and compiling the step (torch's first
  step allocates its buffers);
- **to first step s**: the command's wall time less its steps after the first: start-up, joining the
  processes, data, model, the step-0 evaluation, step 1, and the outputs at the end;
- **peak RSS per process** (MiB, ``ru_maxrss``, the whole process, every library it imported).

JAX processes import no torch (the data stream, the initial weights and the report are the framework-free
job core's, ``chunkzero.job``).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_backends.py [--repeats 5] [--steps 32] [--engines jax-cold,jax-warm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_runs import make_corpus, train_env  # noqa: E402

JAX = ["--backend", "jax", "--nproc", "2", "--devices-per-process", "1"]
ENGINES = {"torch": ["--nproc", "2"], "jax-cold": JAX, "jax-warm": JAX,
           "jax-1proc": ["--backend", "jax", "--nproc", "1", "--devices-per-process", "2"],
           "jax-xla-threads": JAX, "jax-remat": [*JAX, "--activation-checkpointing"],
           "torch-floor": ["--nproc", "1"],
           "jax-floor": ["--backend", "jax", "--nproc", "1", "--devices-per-process", "1"]}
FLOORS = ("torch-floor", "jax-floor")
"""Two ``--nproc 1`` runs at once, one per half of the cores (the module docstring)."""
ENGINE_ENV = {"jax-xla-threads": {"CHUNKZERO_CPU_THREADS": "0"}}
"""Environment set for an engine: ``jax-xla-threads`` leaves XLA:CPU's threads at its default (every core, in
each process) instead of ``chunkzero train``'s cores / processes."""
WARM = ("jax-warm", "jax-1proc", "jax-xla-threads", "jax-remat", "jax-floor")
"""The engines that start with the warm cache (each fills it once before the repeats)."""


def core_halves() -> list[set[int]]:
    """This process's cores split in two (the floors' affinity masks)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("the no-communication floors need at least 2 cores")
    return [set(cores[: len(cores) // 2]), set(cores[len(cores) // 2:])]


def run_once(engine: str, common: list[str], out: Path, cwd: Path, cache: Path | None = None) -> dict:
    env = {**train_env(), **ENGINE_ENV.get(engine, {})}
    if cache is not None:
        env["CHUNKZERO_JAX_CACHE"] = str(cache)
    command = [sys.executable, "-m", "chunkzero.cli", "train", *common, *ENGINES[engine], "--overwrite"]
    if engine not in FLOORS:
        t0 = time.perf_counter()
        p = subprocess.run([*command, "--out", str(out)], cwd=cwd, env=env, capture_output=True, text=True)
        return read_run(engine, p, out, time.perf_counter() - t0)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([*command, "--out", str(out / f"half{k}")], cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=lambda mask=mask: os.sched_setaffinity(0, mask))
             for k, mask in enumerate(core_halves())]
    runs = []
    for k, proc in enumerate(procs):
        stdout, stderr = proc.communicate()
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        runs.append(read_run(engine, done, out / f"half{k}", time.perf_counter() - t0))
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in runs),
            "first_step_s": max(r["first_step_s"] for r in runs),
            "to_first_step_s": max(r["to_first_step_s"] for r in runs),
            "peak_rss_mib": [m for r in runs for m in r["peak_rss_mib"]], "wall_s": max(r["wall_s"] for r in runs)}


def read_run(engine: str, p: subprocess.CompletedProcess, out: Path, wall: float) -> dict:
    """One finished run's numbers (module docstring) from its ``metrics.jsonl`` and ``summary.json``."""
    if p.returncode != 0:
        raise SystemExit(f"{engine} run failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    times = [train[0]["time_s"]] + [b["time_s"] - a["time_s"] for a, b in zip(train, train[1:])]
    summary = json.loads((out / "summary.json").read_text())
    tokens_per_step = train[0]["tokens"]
    later = statistics.median(times[1:])
    return {"tokens_per_s": tokens_per_step / later, "first_step_s": times[0],
            "to_first_step_s": wall - sum(times[1:]),
            "peak_rss_mib": [m["peak_rss_mib"] for m in summary["peak_memory"]], "wall_s": wall}


def own_floor(engine: str) -> str | None:
    """The floor an engine is set beside: ``torch-floor`` for torch, ``jax-floor`` for the JAX runs."""
    if engine in FLOORS:
        return None
    return "torch-floor" if engine == "torch" else "jax-floor"


def torch_peer(engine: str) -> str | None:
    """What a JAX engine is compared with: torch, or for ``jax-floor`` torch's floor; ``None`` for torch's own."""
    if engine.startswith("torch"):
        return None
    return "torch-floor" if engine == "jax-floor" else "torch"


def paired(rs: list[dict], others: list[dict] | None) -> str:
    """The median over repeats of this engine's tokens/s over ``others``' in the same repeat; "" without them."""
    if not others:
        return ""
    return f"{statistics.median(a['tokens_per_s'] / b['tokens_per_s'] for a, b in zip(rs, others)):.2f}"


def spread(values) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32,
                    help="steps per run (step 1 reported apart; both engines still speed up over the first ~8)")
    ap.add_argument("--json", type=Path, default=None, help="write every run's numbers here")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    args = ap.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",")]
    if not engines or any(e not in ENGINES for e in engines):
        ap.error(f"--engines: choose from {', '.join(ENGINES)}, got {args.engines!r}")
    load_before = os.getloadavg()
    rows: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        work = Path(tmp)
        corpus = make_corpus(work / "corpus")
        common = ["--steps", str(args.steps), "--warmup", "2", "--eval-interval", str(10 * args.steps),
                  "--eval-batches", "1", "--sample-tokens", "0", "--save-interval", "0", "--data", str(corpus),
                  "--device", "cpu"]
        warm = work / "cache-warm"
        for engine in WARM:
            if engine in engines:  # fill the cache once, as a first start would
                run_once(engine, common, work / f"prime-{engine}", work, warm)
        for i in range(args.repeats):
            order = engines if i % 2 == 0 else list(reversed(engines))
            for engine in order:
                cache = work / f"cache-cold-{i}" if engine == "jax-cold" else warm if engine in WARM else None
                r = run_once(engine, common, work / engine, work, cache)
                rows[engine].append(r)
                print(
                    f"repeat {i + 1} {engine}: {r['tokens_per_s']:.0f} tokens/s, first step {r['first_step_s']:.1f} s, "
                    f"to first step {r['to_first_step_s']:.1f} s, peak RSS {r['peak_rss_mib']} MiB",
                    flush=True,
                )
    load_after = os.getloadavg()
    cores = os.cpu_count()
    print()
    print(f"gpt-mini, fp32, W = 2, {args.steps} steps per run, {args.repeats} interleaved repeats; {cores} cores; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print()
    print("| engine | tokens/s min / median / max | × own floor, paired (median) | × torch (floor: torch's), paired "
          "| first step s | to first step s | peak RSS / process MiB (median) |")
    print("|---|---|---|---|---|---|---|")
    for engine, rs in rows.items():
        rss = [statistics.median(r["peak_rss_mib"][k] for r in rs) for k in range(len(rs[0]["peak_rss_mib"]))]
        floor = own_floor(engine)
        print(f"| {engine} ({' '.join(ENGINES[engine])}) | {spread([r['tokens_per_s'] for r in rs])} | "
              f"{paired(rs, rows.get(floor))} | {paired(rs, rows.get(torch_peer(engine)))} | "
              f"{spread([r['first_step_s'] for r in rs])} | {spread([r['to_first_step_s'] for r in rs])} | "
              f"{' / '.join(f'{m:.0f}' for m in rss)} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load": [load_before, load_after]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
