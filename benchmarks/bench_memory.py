"""Peak memory per rank of ZeroDDP, FSDP2 (``torch.distributed.fsdp.fully_shard``) and DDP, phase by
phase, on Llama-shaped models built under ``torch.device("meta")`` (``benchmarks/llama_shape.py``),
at 2 gloo ranks in fp32, with AdamW — as a new user would run them:

- ZeroDDP: ``ZeroDDP(model)`` (defaults: prefetch 1, the core's chunk size) + ``ZeroOptimizer`` AdamW;
- FSDP2: ``fully_shard`` on every block, then on the root; ``to_empty`` + ``reset_parameters``; AdamW;
- DDP: ``to_empty`` + ``reset_parameters``; ``DistributedDataParallel`` (defaults); AdamW.

Each run (engine × model × repeat) is its own process group (``start_new_session``): a launcher
process spawning the 2 ranks, killed as a group on its time limit or when the group's resident memory
passes ``--limit-gib`` (so a rung that runs out of memory ends cleanly). Each rank measures its
**peak RSS** (``VmHWM``, reset per phase through ``/proc/self/clear_refs``) for: ``interpreter`` (after
imports and the process group), ``wrap`` (building and wrapping the model), ``forward``,
``backward`` and ``step`` (each the largest over the steps). 2 × 16 tokens per rank per step.

For ZeroDDP the **bound** of the forward and backward is written out per model:
``interpreter + parameter shard + gradient shard + (prefetch + 3) × largest chunk + activations``
(fp32: 4 bytes per element of each shard; the activations estimated as ``4 B × tokens × (layers ×
(10 × hidden + 4 × intermediate) + 3 × vocab)``); the step adds AdamW's two state shards.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_memory.py --models 0.1B 0.5B
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_memory.py --models 0.5B --engines zero   # one row

``--ladder``: for each engine, the largest Llama shape (``--ladder-shape``, by default hidden 2048, 16
heads, intermediate 5632, vocab 32000; ``--ladder-layers`` layers) that trains 2 AdamW steps at W = 2
fp32, smallest rung first, stopping at the first rung that fails. Every rung is its own run (its own
process group, killed as a group past its limit or ``--timeout-s``, so a rung out of memory is a row
``over limit``, not a crash). A rung's limit is both ranks' RSS within 85% of ``MemAvailable`` read
as the rung starts (what the machine has then, other work included); ``--limit-gib`` overrides it.
``--ladder-max-params`` skips larger rungs, so a test can run it tiny; ``--jsonl`` writes one line per
rung and per engine. The real run needs up to ~20 GiB, so run nothing else memory-heavy beside it:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_memory.py --ladder --jsonl runs/memory_ladder.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from llama_shape import LLAMA_SIZES, LlamaShape, llama_numel  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))
from torch_backend.train.launch import WORKER_MALLOC_MMAP_THRESHOLD_BYTES  # noqa: E402 - no torch at import

GIB = 2**30
PHASES = ("interpreter", "wrap", "forward", "backward", "step")
ENGINES = ("zero", "fsdp2", "ddp")
BATCH, TOKENS, WORLD, PREFETCH = 2, 16, 2, 1


def _rss() -> tuple[int, int]:
    """(current, peak since the last reset) resident bytes of this process."""
    cur = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return cur, hwm


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def activation_bytes(s: LlamaShape, tokens: int) -> int:
    """The estimate of saved activations in the bound (fp32)."""
    return 4 * tokens * (s.layers * (10 * s.hidden + 4 * s.intermediate) + 3 * s.vocab)


# ============================================================================ one rank
def _init_params(model) -> None:
    import torch

    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def rank_main(rank: int, world: int, init_file: str, spec: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from llama_shape import LlamaShaped

    shape = LlamaShape(**spec["shape"])
    engine, steps = spec["engine"], spec["steps"]
    precision, checkpointing, ema = spec.get("precision", "fp32"), spec.get("checkpointing"), spec.get("ema")
    peaks: dict[str, int] = {}
    info: dict = {}

    def phase(name):
        peaks[name] = max(peaks.get(name, 0), _rss()[1])
        _reset_peak()

    import torch.nn.functional as F  # noqa: F401 - imported before the interpreter is measured

    if engine == "zero":
        from torch_backend import ZeroDDP, ZeroOptimizer
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from torch.nn.parallel import DistributedDataParallel
    _reset_peak()
    phase("interpreter")
    peaks["interpreter"] = _rss()[0]  # what the interpreter holds, not a transient
    with torch.device("meta"):
        module = LlamaShaped(shape)
    if checkpointing:
        from torch_backend.train.models import checkpoint_blocks

        checkpoint_blocks(module)
    if engine == "zero":
        model = ZeroDDP(module, prefetch=PREFETCH, mixed_precision=precision)
        optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, eps=1e-6)
        if ema:
            from torch_backend import ZeroEMA

            ZeroEMA(optim, 0.999)
        info["largest_chunk_bytes"] = max(c.size for c in model.chunks) * 4
        info["chunks"] = len(model.chunks)
    elif engine == "fsdp2":
        for blk in module.blocks:
            fully_shard(blk)
        fully_shard(module)
        module.to_empty(device="cpu")
        _init_params(module)
        model = module
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6)
    else:
        module.to_empty(device="cpu")
        _init_params(module)
        model = DistributedDataParallel(module)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6)
    phase("wrap")
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = torch.randint(0, shape.vocab, (BATCH, TOKENS), generator=gen)
        loss = model(ids)
        phase("forward")
        if engine == "zero":
            optim.backward(loss)
        else:
            loss.backward()
        phase("backward")
        optim.step()
        optim.zero_grad()
        phase("step")
    if engine == "zero" and hasattr(optim.memory_report(), "peak_allocated"):  # (versions before it: not counted)
        r = optim.memory_report()
        info["peak_allocated_bytes"] = r.allocated_total(peak=True)
        info["peak_allocated_by_kind"] = r.peak_allocated.get("cpu", {})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peaks": peaks, "info": info, "loss": float(loss)}, f)
    dist.barrier()
    dist.destroy_process_group()
    from chunkzero.process_exit import exit_without_finalization

    exit_without_finalization(0)  # gloo's threads outlive the group: a finalizing interpreter may abort under them


def launcher_main(spec: dict, out_dir: str) -> int:
    """The process-group leader of one run: spawns the ranks and waits for them; exit status 0 only if
    every rank ended well. It never imports torch (only the ranks do: one import fewer per run)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, WORLD, os.path.join(out_dir, "store"), spec, out_dir))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


# ============================================================================ the launcher side
def _group_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def child_env(mmap_threshold_bytes: int | None) -> dict[str, str]:
    """The runs' environment: glibc's ``MALLOC_MMAP_THRESHOLD_`` as ``chunkzero train`` gives its workers
    (``None``: glibc's default, the variable removed)."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold_bytes is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold_bytes)
    return env


def run_one(engine: str, shape: LlamaShape, steps: int, *, timeout_s: float, limit_bytes: int,
            env: dict[str, str] | None = None, variant: dict | None = None) -> dict:
    """One run in its own process group; ``{"status": "ok" | "over limit" | "timeout" | "failed", "ranks": [...]}``.
    ``variant``: ZeroDDP's ``precision``, ``checkpointing`` (of every block) and ``ema`` (a ZeroEMA)."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as out_dir:
        spec = {"engine": engine, "shape": shape.__dict__, "steps": steps, **(variant or {})}
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_launch", json.dumps(spec), out_dir],
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        deadline, status, group_peak = time.monotonic() + timeout_s, None, 0
        while proc.poll() is None:
            used = _group_rss(proc.pid)
            group_peak = max(group_peak, used)
            if used > limit_bytes:
                status = "over limit"
            elif time.monotonic() > deadline:
                status = "timeout"
            if status:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        err = proc.communicate()[1].decode(errors="replace")
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        ranks = []
        for r in range(WORLD):
            path = os.path.join(out_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
        if status is None:
            status = "ok" if proc.returncode == 0 and len(ranks) == WORLD else "failed"
        return {"status": status, "ranks": ranks, "group_peak_rss": group_peak,
                "error": err[-2000:] if status == "failed" else ""}


def bound_bytes(shape: LlamaShape, interpreter: int, largest_chunk: int) -> dict[str, int]:
    """ZeroDDP's bound per rank at ``WORLD`` ranks, fp32: forward/backward, and the step."""
    shard = llama_numel(shape) * 4 // WORLD
    fb = interpreter + 2 * shard + (PREFETCH + 3) * largest_chunk + activation_bytes(shape, BATCH * TOKENS)
    return {"forward_backward": fb, "step": fb + 2 * shard}


def planned_bytes(shape: LlamaShape, variant: dict, baseline_bytes: int | None = None) -> int:
    """``chunkzero plan``'s peak per rank of this ZeroDDP run (``torch_backend.plan``: the module traced on fake
    tensors, the core's arithmetic): built on the meta device, so no whole copy at build. ``baseline_bytes``:
    the interpreter's (default: ``chunkzero train``'s worker's, which holds the job's modules and corpus too)."""
    import torch
    from llama_shape import LlamaShaped

    from chunkzero.memory_plan import PlanSettings, plan_memory
    from torch_backend.plan import module_layout, trace_module

    precision = variant.get("precision", "fp32")
    with torch.device("meta"):
        layout = module_layout(LlamaShaped(shape), precision, WORLD)
        module = LlamaShaped(shape)
    trace = trace_module(module, BATCH, TOKENS, precision, bool(variant.get("checkpointing")),
                         loss_of=lambda loss, ids: loss)
    settings = PlanSettings(world_size=WORLD, precision=precision, prefetch=PREFETCH, batch_size=BATCH, seq_len=TOKENS,
                            activation_checkpointing=bool(variant.get("checkpointing")), ema=bool(variant.get("ema")),
                            build_copies=0)
    return plan_memory(layout, trace, settings, baseline_bytes=baseline_bytes).peak_bytes_per_rank


def _fmt(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def table(models: list[str], engines: list[str], repeats: int, steps: int, timeout_s: float, limit_bytes: int,
          log, env: dict[str, str] | None = None, variant: dict | None = None) -> str:
    variant = variant or {}
    setting = ", ".join([variant.get("precision", "fp32")] + (["activation checkpointing"] if variant.get(
        "checkpointing") else []) + (["EMA"] if variant.get("ema") else []))
    lines = [
        f"Peak RSS per rank (GiB; max over the {WORLD} ranks; median (min–max) over {repeats} repeat(s)), "
        f"W={WORLD} gloo, {setting} (ZeroDDP; the others fp32), {steps} AdamW steps, {BATCH}×{TOKENS} tokens per rank; "
        "ZeroDDP's plan (`chunkzero plan`'s arithmetic, its baseline the measured interpreter) beside the measured "
        "peak of all phases:",
        "",
        "| model | parameters | engine | "
        + " | ".join(PHASES)
        + " | ZeroDDP bound fwd+bwd / step | engine's peak allocated | planned peak | planned / measured |",
        "|---" * (len(PHASES) + 7) + "|",
    ]
    for name in models:
        shape = LLAMA_SIZES[name]
        for engine in engines:
            per_phase: dict[str, list[float]] = {p: [] for p in PHASES}
            bounds, alloc, interpreters, status = [], [], [], "ok"
            for _ in range(repeats):
                res = run_one(engine, shape, steps, timeout_s=timeout_s, limit_bytes=limit_bytes, env=env,
                              variant=variant if engine == "zero" else None)
                log(f"{name} {engine}: {res['status']} {[r['peaks'] for r in res['ranks']]} {res['error'][-400:]}")
                if res["status"] != "ok":
                    status = res["status"]
                    continue
                for p in PHASES:
                    per_phase[p].append(max(r["peaks"][p] for r in res["ranks"]) / GIB)
                interpreters.append(max(r["peaks"]["interpreter"] for r in res["ranks"]))
                if engine == "zero":
                    b = [
                        bound_bytes(shape, r["peaks"]["interpreter"], r["info"]["largest_chunk_bytes"])
                        for r in res["ranks"]
                    ]
                    bounds.append((max(x["forward_backward"] for x in b) / GIB, max(x["step"] for x in b) / GIB))
                    if all("peak_allocated_bytes" in r["info"] for r in res["ranks"]):
                        alloc.append(max(r["info"]["peak_allocated_bytes"] for r in res["ranks"]) / GIB)
            cells = [_fmt(per_phase[p]) for p in PHASES]
            if status != "ok" and not per_phase["step"]:
                cells = [status] * len(PHASES)
            bound = f"{bounds[0][0]:.2f} / {bounds[0][1]:.2f}" if bounds else ""
            planned = ratio = ""
            if engine == "zero" and interpreters:
                p = planned_bytes(shape, variant, baseline_bytes=max(interpreters)) / GIB
                measured = max((max(per_phase[ph]) for ph in PHASES if per_phase[ph]), default=0)
                planned, ratio = f"{p:.2f}", (f"{p / measured:.3f}" if measured else "")
            lines.append(f"| {name} | {llama_numel(shape) / 1e6:.0f}M | {engine} | " + " | ".join(cells)
                         + f" | {bound} | {_fmt(alloc) if alloc else ''} | {planned} | {ratio} |")
    return "\n".join(lines)


LADDER_SHAPE = "2048:16:5632:32000"
"""The ladder's default width (``--ladder-shape`` hidden:heads:intermediate:vocab): TinyLlama's."""

LADDER_MEM_FRACTION = 0.85
"""Share of ``MemAvailable`` (read just before each rung starts) a rung's two ranks may hold together."""


def mem_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` now (bytes): what can be allocated without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def _ladder_shape(spec: str, layers: int) -> LlamaShape:
    hidden, heads, intermediate, vocab = (int(v) for v in spec.split(":"))
    return LlamaShape(hidden=hidden, layers=layers, heads=heads, intermediate=intermediate, vocab=vocab)


def ladder(engines: list[str], layers: list[int], timeout_s: float, limit_bytes: int | None, log, *,
           shape_spec: str = LADDER_SHAPE, max_params: int | None = None, steps: int = 2, jsonl: str | None = None,
           env: dict[str, str] | None = None) -> str:
    """For each engine, rungs of ``layers`` (smallest first) until one fails: each rung its own run
    (:func:`run_one`: its own process group, killed past its limit). A rung's limit is ``limit_bytes``
    when given, else ``LADDER_MEM_FRACTION`` × ``MemAvailable`` read as the rung starts; rungs above
    ``max_params`` parameters are not tried. One JSON line per rung and per engine (``kind``
    ``rung`` / ``largest``) is appended to ``jsonl`` as it is known."""

    def emit(row: dict) -> None:
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")

    probe = _ladder_shape(shape_spec, 1)
    limit_text = (f"within {limit_bytes / GIB:.1f} GiB (--limit-gib)" if limit_bytes is not None else
                  f"within {LADDER_MEM_FRACTION:.0%} of MemAvailable at each rung's start")
    lines = [
        f"Largest Llama shape (hidden {probe.hidden}, {probe.heads} heads, intermediate {probe.intermediate}, "
        f"vocab {probe.vocab}) training {steps} AdamW steps at W={WORLD} gloo fp32, both ranks {limit_text}:",
        "",
        "| engine | largest rung (layers) | parameters | both ranks' peak RSS (GiB) | its limit (GiB) | first failing "
        "rung |",
        "|---|---|---|---|---|---|",
    ]
    for engine in engines:
        best, fail = None, ""
        for n in sorted(layers):
            shape = _ladder_shape(shape_spec, n)
            numel = llama_numel(shape)
            row = {"kind": "rung", "engine": engine, "layers": n, "n_params": numel}
            if max_params is not None and numel > max_params:
                emit({**row, "status": "not tried: above --ladder-max-params"})
                continue
            available = mem_available_bytes()
            limit = limit_bytes if limit_bytes is not None else int(LADDER_MEM_FRACTION * available)
            t0 = time.monotonic()
            res = run_one(engine, shape, steps, timeout_s=timeout_s, limit_bytes=limit, env=env)
            log(
                f"ladder {engine} {n} layers: {res['status']} {res['group_peak_rss'] / GIB:.2f} GiB "
                f"{res['error'][-300:]}"
            )
            emit({**row, "status": res["status"], "group_peak_rss_bytes": res["group_peak_rss"], "limit_bytes": limit,
                  "group_peak_rss_gib": round(res["group_peak_rss"] / GIB, 3),
                  "limit_gib": round(limit / GIB, 3), "mem_available_gib": round(available / GIB, 3),
                  "seconds": round(time.monotonic() - t0, 1), "error": res["error"][-300:]})
            if res["status"] != "ok":
                fail = f"{n} ({res['status']})"
                break
            best = (n, numel, res["group_peak_rss"], limit)
        emit({"kind": "largest", "engine": engine, "layers": best[0] if best else None,
              "n_params": best[1] if best else None, "first_failing": fail or None})
        if best is None:
            lines.append(f"| {engine} | none | | | | {fail or 'none tried'} |")
        else:
            lines.append(f"| {engine} | {best[0]} | {best[1] / 1e9:.3f}B | {best[2] / GIB:.2f} | {best[3] / GIB:.1f} | "
                         f"{fail or 'none'} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--_launch":
        sys.exit(launcher_main(json.loads(sys.argv[2]), sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["0.1B", "0.5B"], choices=sorted(LLAMA_SIZES))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--limit-gib", type=float, default=None,
                    help="both ranks' resident memory per run, GiB (default: 21 for the table; for --ladder, "
                         f"{LADDER_MEM_FRACTION * 100:.0f}%% of MemAvailable read as each rung starts)")
    ap.add_argument("--ladder", action="store_true", help="the largest model each engine trains (see above)")
    ap.add_argument("--ladder-layers", type=int, nargs="+", default=[8, 12, 16, 20, 24, 28, 32, 40])
    ap.add_argument("--ladder-shape", default=LADDER_SHAPE, help="the rungs' width, hidden:heads:intermediate:vocab")
    ap.add_argument(
        "--ladder-max-params", type=float, default=None, help="rungs above this many parameters are not tried"
    )
    ap.add_argument("--jsonl", help="--ladder: append one JSON line per rung and per engine here")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="ZeroDDP's mixed precision (table)")
    ap.add_argument("--activation-checkpointing", action="store_true", help="ZeroDDP: checkpoint every block (table)")
    ap.add_argument("--ema", action="store_true", help="ZeroDDP: keep a ZeroEMA of the masters (table)")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=WORKER_MALLOC_MMAP_THRESHOLD_BYTES,
                    help="glibc's MALLOC_MMAP_THRESHOLD_ of the ranks, bytes (default: chunkzero train's, "
                         "%(default)s); 0: glibc's default (dynamic) threshold")
    args = ap.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.limit_gib is not None and args.limit_gib <= 0:
        ap.error("--limit-gib must be positive")
    try:
        _ladder_shape(args.ladder_shape, 1)
    except ValueError:
        ap.error(f"--ladder-shape {args.ladder_shape!r}: expected four integers hidden:heads:intermediate:vocab")
    limit = None if args.limit_gib is None else int(args.limit_gib * GIB)
    env = child_env(args.malloc_mmap_threshold or None)
    print(f"{datetime.date.today()} · {platform.processor() or platform.machine()} · {os.cpu_count()} cores · "
          f"`{' '.join(['bench_memory.py', *sys.argv[1:]])}` · MALLOC_MMAP_THRESHOLD_="
          f"{env.get('MALLOC_MMAP_THRESHOLD_', 'unset (glibc default)')}\n")
    if args.ladder:
        max_params = None if args.ladder_max_params is None else int(args.ladder_max_params)
        print(ladder(args.engines, args.ladder_layers, args.timeout_s, limit, log, shape_spec=args.ladder_shape,
                     max_params=max_params, steps=args.steps, jsonl=args.jsonl, env=env))
    else:
        variant = {"precision": args.precision, "checkpointing": args.activation_checkpointing, "ema": args.ema}
        print(table(args.models, args.engines, args.repeats, args.steps, args.timeout_s,
                    limit if limit is not None else int(21 * GIB), log, env=env, variant=variant))


if __name__ == "__main__":
    main()
