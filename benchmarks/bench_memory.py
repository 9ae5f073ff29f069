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
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_memory.py --ladder --limit-gib 21

``--ladder``: for each engine, the largest Llama shape (hidden 2048, 16 heads, intermediate 5632,
vocab 32000, ``--ladder-layers`` layers) that trains 2 AdamW steps within ``--limit-gib`` (both ranks
together), smallest rung first, stopping at the first rung that fails.
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
    if engine == "zero":
        model = ZeroDDP(module, prefetch=PREFETCH)
        optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, eps=1e-6)
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


def launcher_main(spec: dict, out_dir: str) -> None:
    """The process-group leader of one run: spawns the ranks and waits for them."""
    import torch.multiprocessing as mp

    mp.start_processes(rank_main, args=(WORLD, os.path.join(out_dir, "store"), spec, out_dir), nprocs=WORLD,
                       start_method="spawn")


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


def run_one(engine: str, shape: LlamaShape, steps: int, *, timeout_s: float, limit_bytes: int) -> dict:
    """One run in its own process group; ``{"status": "ok" | "over limit" | "timeout" | "failed", "ranks": [...]}``."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as out_dir:
        spec = {"engine": engine, "shape": shape.__dict__, "steps": steps}
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_launch", json.dumps(spec), out_dir],
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def _fmt(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def table(models: list[str], engines: list[str], repeats: int, steps: int, timeout_s: float, limit_bytes: int,
          log) -> str:
    lines = [f"Peak RSS per rank (GiB; max over the {WORLD} ranks; median (min–max) over {repeats} repeat(s)), "
             f"W={WORLD} gloo, fp32, {steps} AdamW steps, {BATCH}×{TOKENS} tokens per rank:", "",
             "| model | parameters | engine | " + " | ".join(PHASES) + " | ZeroDDP bound fwd+bwd / step | engine's peak allocated |",
             "|---" * (len(PHASES) + 5) + "|"]
    for name in models:
        shape = LLAMA_SIZES[name]
        for engine in engines:
            per_phase: dict[str, list[float]] = {p: [] for p in PHASES}
            bounds, alloc, status = [], [], "ok"
            for _ in range(repeats):
                res = run_one(engine, shape, steps, timeout_s=timeout_s, limit_bytes=limit_bytes)
                log(f"{name} {engine}: {res['status']} {[r['peaks'] for r in res['ranks']]} {res['error'][-400:]}")
                if res["status"] != "ok":
                    status = res["status"]
                    continue
                for p in PHASES:
                    per_phase[p].append(max(r["peaks"][p] for r in res["ranks"]) / GIB)
                if engine == "zero":
                    b = [bound_bytes(shape, r["peaks"]["interpreter"], r["info"]["largest_chunk_bytes"]) for r in res["ranks"]]
                    bounds.append((max(x["forward_backward"] for x in b) / GIB, max(x["step"] for x in b) / GIB))
                    if all("peak_allocated_bytes" in r["info"] for r in res["ranks"]):
                        alloc.append(max(r["info"]["peak_allocated_bytes"] for r in res["ranks"]) / GIB)
            cells = [_fmt(per_phase[p]) for p in PHASES]
            if status != "ok" and not per_phase["step"]:
                cells = [status] * len(PHASES)
            bound = f"{bounds[0][0]:.2f} / {bounds[0][1]:.2f}" if bounds else ""
            lines.append(f"| {name} | {llama_numel(shape) / 1e6:.0f}M | {engine} | " + " | ".join(cells)
                         + f" | {bound} | {_fmt(alloc) if alloc else ''} |")
    return "\n".join(lines)


def ladder(engines: list[str], layers: list[int], timeout_s: float, limit_bytes: int, log) -> str:
    lines = [f"Largest Llama shape (hidden 2048, 16 heads, intermediate 5632, vocab 32000) training 2 AdamW steps at "
             f"W={WORLD} gloo fp32 within {limit_bytes / GIB:.0f} GiB for both ranks:", "",
             "| engine | largest rung (layers) | parameters | both ranks' peak RSS (GiB) | first failing rung |",
             "|---|---|---|---|---|"]
    for engine in engines:
        best, fail = None, ""
        for n in layers:
            shape = LlamaShape(hidden=2048, layers=n, heads=16, intermediate=5632)
            res = run_one(engine, shape, 2, timeout_s=timeout_s, limit_bytes=limit_bytes)
            log(f"ladder {engine} {n} layers: {res['status']} {res['group_peak_rss'] / GIB:.2f} GiB {res['error'][-300:]}")
            if res["status"] != "ok":
                fail = f"{n} ({res['status']})"
                break
            best = (n, llama_numel(shape), res["group_peak_rss"])
        if best is None:
            lines.append(f"| {engine} | none | | | {fail} |")
        else:
            lines.append(f"| {engine} | {best[0]} | {best[1] / 1e9:.2f}B | {best[2] / GIB:.1f} | {fail or 'none'} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--_launch":
        launcher_main(json.loads(sys.argv[2]), sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["0.1B", "0.5B"], choices=sorted(LLAMA_SIZES))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--limit-gib", type=float, default=21.0, help="both ranks' resident memory, per run")
    ap.add_argument("--ladder", action="store_true")
    ap.add_argument("--ladder-layers", type=int, nargs="+", default=[8, 16, 24, 32, 40, 48, 56, 64])
    args = ap.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    limit = int(args.limit_gib * GIB)
    print(f"{datetime.date.today()} · {platform.processor() or platform.machine()} · {os.cpu_count()} cores · "
          f"`{' '.join(['bench_memory.py', *sys.argv[1:]])}`\n")
    if args.ladder:
        print(ladder(args.engines, args.ladder_layers, args.timeout_s, limit, log))
    else:
        print(table(args.models, args.engines, args.repeats, args.steps, args.timeout_s, limit, log))


if __name__ == "__main__":
    main()
