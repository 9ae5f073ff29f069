"""ZeroDDP against FSDP2, DDP and the no-communication floor: interleaved step times, memory, collectives.

Every system trains the same GPT with AdamW on the same per-rank batch. Each system runs in its own
``--world-size`` rank processes (its own process group), all spawned by this script (one process tree)
and kept alive for the whole run; the script steps one system at a time, all systems per repeat, in an
order that rotates from repeat to repeat, so slow drift of a shared machine's load hits every system
alike and no two systems ever compete for the cores. Each rank runs ``--threads`` torch threads
(default: cores / ranks, never oversubscribed).

Systems (``--systems``, comma-separated; options after ``:``, e.g. ``zero:prefetch=0``):

- ``floor`` — the plain module on each rank's batch, no collective at all: the same per-rank forward,
  backward and full AdamW step, nothing communicated. The lower bound for any data-parallel engine.
- ``exchanges:count=N:numel=M`` — the floor plus ``N`` all-to-alls of ``M`` elements a step (each rank
  sends ``M / W`` to every rank), issued asynchronously as the step starts and waited for as it ends: the
  collectives an engine issues (at W = 2 one chunk gather or reduction is one such exchange), with no
  engine around them and the most overlap any engine could have. What is left above it is the engine's.
- ``ddp`` — ``DistributedDataParallel`` (``gradient_as_bucket_view=True``).
- ``fsdp2`` — ``torch.distributed.fsdp.fully_shard`` on every transformer block, then the root; its
  default (implicit) prefetch.
- ``zero`` — chunkzero's ``ZeroDDP`` + ``ZeroOptimizer``; options are ``ZeroDDP`` keyword arguments
  (``prefetch``, ``offload_optim_frac``, ``chunk_size`` …). ``zero:prefetch=0`` is "no overlap".
  ``zero:oracle_votes=1`` (diagnosis) skips the vote all-reduce of its rounds (see ``engine_systems.oracle_votes``).
- ``autocast`` — the plain module in fp32 under ``torch.autocast(bfloat16)`` with
  ``AdamW(fused=True)``: the single-device PyTorch reference (world size 1, bf16 only).

Precisions (``--precisions``): ``fp32``, and ``bf16`` = compute in bf16 with fp32 master weights and
bf16 gradient reduction for every system: ``ZeroDDP(mixed_precision="bf16")``; FSDP2 with
``MixedPrecisionPolicy(param_dtype=bf16)`` (fp32 shards; its reduce dtype defaults to bf16); floor and
DDP hold a bf16 copy of the module and step fp32 masters (the same per-rank work as ZeroDDP's).

Step = forward + loss + backward + optimizer step + ``zero_grad`` after a barrier; the step time of a
step is its slowest rank's. Reported per system: min / median / max over all timed steps (``--repeats``
× ``--steps`` after ``--warmup``), the median ratio to ``floor`` and to ``fsdp2``, the median of each
phase (forward, backward, optimizer), peak RSS per rank (``ru_maxrss``, the whole process: torch
included; ``base`` = after importing torch and joining the group), model-state bytes per rank
(parameters, gradients, fp32 masters and optimizer states held right after ``step()``), and for
ZeroDDP the collectives per step (vote rounds, all-gathers, misses = gathers on demand, late gathers =
prefetched gathers issued only at their use) and the peak number of gathered chunks. CPU seconds per
step, each the largest over the ranks: the training loop's thread (``time.thread_time``, which does
not count the time it sleeps in a wait) and every other thread of the process (``process_time`` minus
it: gloo's threads, which move and sum the collectives' data). ``(base)`` after the peak RSS is the RSS
once torch is imported and the process group joined, before the model is built.
The ZeRO bound per rank is ``16 Ψ / W`` bytes: fp32 = 4 (parameter = master) + 4 (gradient) + 8 (Adam
``exp_avg``, ``exp_avg_sq``); bf16 mixed precision = 2 + 2 + 12 (fp32 master + Adam states) in ZeRO's
accounting (ZeroDDP keeps an fp32 gradient shard and casts the master at gather time instead of a bf16
shard: 4 + 4 + 8, the same 16); plus the gathered chunks, counted as the peak number gathered at once
times the largest chunk's bytes. The machine's load average is printed before and after the run.

    .venv/bin/python benchmarks/bench_engine.py --repeats 5                     # the issue-11 table (CPU, ~15 min)
    .venv/bin/python benchmarks/bench_engine.py --repeats 1 --warmup 1 --steps 1 --n-layer 1 --n-embd 64 \
        --n-head 2 --vocab 256 --seq 32 --batch 2                                # plumbing check, ~1 min
    python3 benchmarks/bench_engine.py --backend nccl --world-size 1 --precisions bf16 \
        --systems autocast,fsdp2,zero --model gpt --vocab 50257 --n-layer 12 --n-embd 768 --n-head 12 \
        --seq 1024 --batch 8 --json out.json                                     # one GPU (see gpu_check.sh)

Run it in its own process group with a timeout (``setsid timeout 3600 ...``); ``--timeout`` bounds
the whole run too (every rank process is killed past it). Within it the run stops early rather than be
killed: no system is built once less than ``REPORT_MARGIN_S`` is left, and no repeat starts that the
last one's duration says would not end before that margin; the rows then come from fewer repeats.
``--jsonl PATH`` appends one row per system (``kind: engine``, ``part: --part``) to a JSON-lines file
(``benchmarks/gpu_rows.py``) as soon as its block is done, failures included.
``--parts JSON`` runs several such runs (parts, each its own shape, systems and limit within
``--timeout``) in one invocation, their ranks forked from one forkserver that imported torch once
(``gpu_check.sh --smoke`` uses it; the GPU check keeps one invocation per part); each part appends a
``kind: part`` row with its status.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_rows  # noqa: E402
from engine_systems import ADAMW_KERNELS, BYTES_PER_PARAM_ZERO, EngineProfile, System, label, parse_system  # noqa: E402


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _send(conn, obj) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def rank_main(conn, spec: str, precision: str, rank: int, world: int, init_file: str, cfg: dict) -> None:
    """A rank process: build the system, then run the coordinator's commands (JSON over a pipe)."""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(cfg["threads"])
        device = torch.device("cpu")
        if cfg["backend"] == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(cfg["backend"], init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg["timeout"]))
        base_rss = _maxrss_mib()
        profile = EngineProfile() if cfg["profile"] and spec.startswith("zero") else None
        system = System(spec, precision, cfg, rank, world, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _send(conn, {"ready": True, "n_params": system.n_params, "base_rss_mib": base_rss,
                     "built_rss_mib": _maxrss_mib()})
        stats_before = None
        while True:
            msg = json.loads(conn.recv_bytes())
            if msg["op"] == "run":
                if msg.get("timed") and stats_before is None:
                    stats_before = system.zero_stats()
                    if profile is not None:
                        profile.reset()
                process_s, thread_s = time.process_time(), time.thread_time()
                steps = [
                    system.step(measure_state=msg.get("measure_state", False) and i == 0) for i in range(msg["steps"])
                ]
                thread_s = time.thread_time() - thread_s  # the training loop's thread; the rest: torch's own
                _send(conn, {"steps": steps, "cpu_s": [thread_s, time.process_time() - process_s - thread_s]})
            elif msg["op"] == "report":
                peak_cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
                _send(
                    conn,
                    {
                        "peak_rss_mib": _maxrss_mib(),
                        "state_bytes": system.state_bytes,
                        "peak_cuda_mib": peak_cuda,
                        "zero_before": stats_before,
                        "zero_after": system.zero_stats(),
                        "profile": None if profile is None else profile.totals,
                    },
                )
            else:
                break
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the coordinator, which drops the system
        with contextlib.suppress(OSError):  # the coordinator is gone
            _send(conn, {"error": traceback.format_exc()})


# ============================================================================ coordinator
class RunError(RuntimeError):
    pass


FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch_backend", "engine_systems"]
"""What the forkserver of ``--parts`` imports once for every rank it forks (``torch._dynamo``, with sympy,
is otherwise imported by the first parameter initialised on the meta device: about 1 s of CPU)."""

REPORT_MARGIN_S = 15.0
"""Seconds kept before the deadline for the reports (peak memory, stats) and the tables."""


class Group:
    """The rank processes of one system and their pipes."""

    def __init__(self, ctx, spec, precision, world, init_file, cfg):
        self.spec, self.precision = spec, precision
        self.procs, self.conns = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(child, spec, precision, r, world, init_file, cfg), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def ask(self, msg: dict | None, deadline: float) -> list[dict]:
        if msg is not None:
            for c in self.conns:
                _send(c, msg)
        out = []
        for r, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise RunError(f"{self.spec} {self.precision}: rank {r} did not answer before the deadline")
            try:
                reply = json.loads(c.recv_bytes())
            except EOFError:
                raise RunError(
                    f"{self.spec} {self.precision}: rank {r} died (exit code {self.procs[r].exitcode})"
                ) from None
            if "error" in reply:
                raise RunError(f"{self.spec} {self.precision}: rank {r} failed:\n{reply['error']}")
            out.append(reply)
        return out

    def close(self):
        for c in self.conns:
            try:
                _send(c, {"op": "exit"})
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def _load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run_block(precision: str, specs: list[str], cfg: dict, deadline: float, loads: list[float]) -> dict:
    """All systems of one precision: spawn, warm up, interleaved timed repeats, reports. A system that
    fails (or misses the deadline) is dropped with its error; the others go on."""
    import multiprocessing as mp  # the standard one: this process never imports torch (the ranks do)

    ctx = mp.get_context(cfg["start_method"])
    results: dict[str, dict] = {}
    live: list[Group] = []

    def ask(g: Group, msg: dict | None):
        try:
            return g.ask(msg, deadline)
        except RunError as e:
            results[g.spec]["error"] = str(e)
            print(f"# {precision} {g.spec}: FAILED, dropped: {e}", file=sys.stderr, flush=True)
            live.remove(g)
            g.close()
            return None

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        try:
            for i, spec in enumerate(specs):  # built one after another: construction never overlaps
                results[spec] = {"steps": []}
                if deadline - time.monotonic() < 2 * REPORT_MARGIN_S:
                    results[spec]["error"] = "not built: too little of --timeout left"
                    print(f"# {precision} {spec}: not built (time)", file=sys.stderr, flush=True)
                    continue
                g = Group(ctx, spec, precision, cfg["world_size"], os.path.join(tmp, f"store{i}"), cfg)
                live.append(g)
                ready = ask(g, None)
                if ready is not None:
                    results[spec]["ready"] = ready
                    print(
                        f"# {precision} {spec}: built ({ready[0]['n_params'] / 1e6:.1f}M parameters)",
                        file=sys.stderr,
                        flush=True,
                    )
            for g in list(live):  # noqa: PERF101 - ask() removes a failed system from live
                ask(g, {"op": "run", "steps": cfg["warmup"], "measure_state": True})
            rep_s = 0.0
            for rep in range(cfg["repeats"]):
                if rep and deadline - time.monotonic() < 1.5 * rep_s + REPORT_MARGIN_S:
                    print(
                        f"# {precision}: stopped after {rep} of {cfg['repeats']} repeats (--timeout)",
                        file=sys.stderr,
                        flush=True,
                    )
                    break
                rep_t0 = time.monotonic()
                loads.append(os.getloadavg()[0])
                order = list(live)
                k = rep % max(1, len(order))
                for g in order[k:] + order[:k]:  # rotate the order: drift hits every system alike
                    replies = ask(g, {"op": "run", "steps": cfg["steps"], "timed": True})
                    for i in range(cfg["steps"] if replies else 0):  # per step and phase: the slowest rank
                        results[g.spec]["steps"].append([max(r["steps"][i][j] for r in replies) for j in range(4)])
                    if replies:  # CPU seconds per step of the main thread and of the others, the busiest rank
                        results[g.spec].setdefault("cpu", []).append(
                            [max(r["cpu_s"][j] for r in replies) / cfg["steps"] for j in range(2)])
                rep_s = time.monotonic() - rep_t0
                print(f"# {precision} repeat {rep + 1}/{cfg['repeats']} done, load {os.getloadavg()[0]:.2f}",
                      file=sys.stderr, flush=True)
            for g in list(live):  # noqa: PERF101 - as above
                report = ask(g, {"op": "report"})
                if report is not None:
                    results[g.spec]["report"] = report
        finally:
            for g in live:
                g.close()
    return results


def summarize(precision: str, spec: str, res: dict, cfg: dict) -> dict:
    steps = res["steps"]
    total = [s[0] for s in steps]
    rep, ready = res["report"], res["ready"]
    n_params = ready[0]["n_params"]
    tokens = cfg["batch"] * cfg["seq"] * cfg["world_size"]
    row = {
        "system": spec,
        "precision": precision,
        "n_params": n_params,
        "timed_steps": len(steps),
        "min_s": min(total),
        "median_s": statistics.median(total),
        "max_s": max(total),
        "forward_s": statistics.median(s[1] for s in steps),
        "backward_s": statistics.median(s[2] for s in steps),
        "optimizer_s": statistics.median(s[3] for s in steps),
        "tokens_per_s": tokens / statistics.median(total),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in rep),
        "base_rss_mib": max(r["base_rss_mib"] for r in ready),
        "state_mib": max(r["state_bytes"] for r in rep) / 2**20,
        "zero_bound_mib": BYTES_PER_PARAM_ZERO * n_params / cfg["world_size"] / 2**20,
        "peak_cuda_mib": rep[0]["peak_cuda_mib"],
        "cpu_main_s": statistics.median(c[0] for c in res["cpu"]),
        "cpu_other_s": statistics.median(c[1] for c in res["cpu"]),
    }
    after, before = rep[0]["zero_after"], rep[0]["zero_before"]
    n = max(1, len(steps))
    if after is not None:
        row["zero"] = {
            **{k: after[k] for k in ("chunks", "chunk_size", "chunk_bytes", "prefetch")},
            "peak_gathered_chunks": max(r["zero_after"]["peak_gathered_chunks"] for r in rep),
            **{f"{k}_per_step": (after[k] - before[k]) / n for k in ("rounds", "gathers", "misses", "late_gathers")},
            "window_mib": max(r["zero_after"]["peak_gathered_chunks"] for r in rep) * after["chunk_bytes"] / 2**20,
        }
    if rep[0].get("profile"):  # per step, the rank that spent the most
        row["profile"] = {k: {"s": max(r["profile"][k][0] for r in rep) / n, "calls": rep[0]["profile"][k][1] / n}
                          for k in rep[0]["profile"]}
    if cfg["flops_per_token"]:
        row["mfu"] = row["tokens_per_s"] * cfg["flops_per_token"] / (cfg["peak_tflops"] * 1e12 * cfg["world_size"])
    return row


def _ratio(seconds: float, reference: float | None) -> str:
    return f"{seconds / reference:.2f}" if reference else "–"


def print_tables(rows: list[dict], cfg: dict) -> None:
    cuda = cfg["backend"] == "nccl"
    for precision in dict.fromkeys(r["precision"] for r in rows):
        block = [r for r in rows if r["precision"] == precision]
        ref = {r["system"]: r["median_s"] for r in block}
        base = "floor" if "floor" in ref else "autocast"
        floor, fsdp2 = ref.get(base), ref.get("fsdp2")
        print(f"\n**{precision}**\n")
        print(
            f"| system | min s | median s | max s | × {base} | × FSDP2 | fwd / bwd / opt s | tokens/s | peak RSS/rank "
            "MiB "
            "(base) | model state/rank MiB | ZeRO bound 16Ψ/W MiB | CPU s/step main / other threads |"
            + (" peak CUDA MiB | MFU |" if cuda else "")
        )
        print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|" + ("---:|---:|" if cuda else ""))
        for r in block:
            ratio = functools.partial(_ratio, r["median_s"])
            extra = f" {r['peak_cuda_mib']:.0f} | {100 * r.get('mfu', 0):.1f}% |" if cuda else ""
            print(
                f"| {label(r['system'])} | {r['min_s']:.3f} | {r['median_s']:.3f} | {r['max_s']:.3f} | {ratio(floor)} "
                "| "
                f"{ratio(fsdp2)} | {r['forward_s']:.3f} / {r['backward_s']:.3f} / {r['optimizer_s']:.3f} | "
                f"{r['tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} ({r['base_rss_mib']:.0f}) | {r['state_mib']:.1f} | "
                f"{r['zero_bound_mib']:.1f} | {r['cpu_main_s']:.3f} / {r['cpu_other_s']:.3f} |{extra}"
            )
        zero = [r for r in block if "zero" in r]
        if zero:
            print("\n| ZeroDDP | chunks × size | peak gathered chunks | bound + peak gathered (largest chunks) MiB | "
                  "vote rounds / step | all-gathers / step | misses / step | late gathers / step |")
            print("|---|---|---:|---:|---:|---:|---:|---:|")
            for r in zero:
                z = r["zero"]
                print(f"| {label(r['system'])} | {z['chunks']} × {z['chunk_size']:,} | {z['peak_gathered_chunks']} | "
                      f"{r['zero_bound_mib'] + z['window_mib']:.1f} | {z['rounds_per_step']:.1f} | "
                      f"{z['gathers_per_step']:.1f} | {z['misses_per_step']:.1f} | {z['late_gathers_per_step']:.1f} |")


def print_profile(rows: list[dict]) -> None:
    prof = [r for r in rows if "profile" in r]
    if not prof:
        return
    keys = list(prof[0]["profile"])
    print("\n**Where ZeroDDP's time goes** (`--profile`: seconds per step inside each engine function, the busiest "
          "rank; calls per step in parentheses; inclusive times, so they overlap)\n")
    print("| system | precision | median step s | " + " | ".join(keys) + " |")
    print("|---|---|---:|" + "---:|" * len(keys))
    for r in prof:
        cells = " | ".join(f"{r['profile'][k]['s']:.3f} ({r['profile'][k]['calls']:.0f})" for k in keys)
        print(f"| {label(r['system'])} | {r['precision']} | {r['median_s']:.3f} | {cells} |")


def _append_rows(args, block: list[dict], errors: list[tuple[str, str]]) -> None:
    shape = f"{args.n_layer}x{args.n_embd}"
    for r in block:
        z = r.get("zero", {})
        gpu_rows.add(args.jsonl, {"part": args.part, "kind": "engine", "label": label(r["system"]), "shape": shape,
                                  "gathers_per_step": z.get("gathers_per_step"),
                                  "late_gathers_per_step": z.get("late_gathers_per_step"), **r})
    for spec, error in errors:
        gpu_rows.add(
            args.jsonl,
            {
                "part": args.part,
                "kind": "engine",
                "label": label(spec),
                "system": spec,
                "shape": shape,
                "error": (error.strip().splitlines() or ["?"])[-1][:200],
            },
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="floor,ddp,fsdp2,zero:prefetch=0,zero:prefetch=1",
                    help="comma-separated: floor, ddp, fsdp2, autocast, zero[:key=value...] (ZeroDDP keyword "
                         "arguments, e.g. zero:prefetch=2:chunk_size=3200000); default: %(default)s")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16; default: %(default)s")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats after warm-up (all systems each)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per system per repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per system before the repeats")
    ap.add_argument("--model", choices=["hf-gpt2", "gpt"], default="hf-gpt2")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (= positions)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--adamw", choices=list(ADAMW_KERNELS), default="default",
                    help="AdamW kernel of every system (autocast always uses fused)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="for MFU on CUDA (H100/H200 dense bf16)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    ap.add_argument("--profile", action="store_true", help="time ZeroDDP's engine functions (adds a little overhead)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--jsonl", help="append one row per system to this JSON-lines file as each block ends")
    ap.add_argument("--part", default="engine", help="the rows' part name (with --jsonl)")
    ap.add_argument("--parts", help="several parts in this one run (their rank processes forked from one server "
                    "that imported torch once): a JSON list of objects, each with 'part', 'timeout' (seconds, its own "
                    "limit within --timeout) and any of the shape and system options above (e.g. 'n_layer', "
                    "'systems'); each part appends its rows and a 'kind: part' row (its status) to --jsonl")
    ap.add_argument("--start-method", choices=["spawn", "forkserver"], default=None,
                    help="how the rank processes start (default: spawn; forkserver with --parts)")
    args = ap.parse_args(argv)
    if not args.parts:
        return run(args, time.monotonic() + args.timeout, args.start_method or "spawn")
    return run_parts(ap, args)


def run_parts(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--parts``: each part in turn, with its own deadline (its ``timeout``, within what is left of
    ``--timeout``); a part's failure is its ``part`` row, and the next part still runs."""
    try:
        parts = json.loads(args.parts)
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and "part" in p and "timeout" in p for p in parts
        ):
            raise ValueError("a list of objects with 'part' and 'timeout'")
    except ValueError as e:
        ap.error(f"--parts: {e}")
    known = set(vars(args))
    for p in parts:
        unknown = set(p) - known - {"part", "timeout"}
        if unknown:
            ap.error(f"--parts: part {p['part']!r} has unknown options {sorted(unknown)}")
    method = args.start_method or "forkserver"
    if method == "forkserver":  # the server imports torch and the engine once; every rank is a fork of it
        import multiprocessing as mp

        mp.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    end = time.monotonic() + args.timeout
    worst = 0
    for p in parts:
        part_args = argparse.Namespace(**{**vars(args), **p, "parts": None})
        t0 = time.monotonic()
        left = end - t0
        rc, status = 1, "failed"
        if left < 2 * REPORT_MARGIN_S:
            status = "not run: --timeout spent"
        else:
            try:
                rc = run(part_args, t0 + min(float(p["timeout"]), left), method)
                status = "done" if rc == 0 else "failed"
            except Exception:  # noqa: BLE001 - this part's row says so; the next part runs
                traceback.print_exc()
        worst = max(worst, rc)
        if args.jsonl:
            n = sum(1 for r in gpu_rows.read(args.jsonl) if r.get("part") == p["part"] and r.get("kind") != "part")
            gpu_rows.add(args.jsonl, {"part": p["part"], "kind": "part", "status": status, "rc": rc,
                                      "seconds": round(time.monotonic() - t0), "limit_s": p["timeout"], "rows": n})
        print(f"# part {p['part']}: {status}", file=sys.stderr, flush=True)
    if method == "forkserver":  # reap the server now (it reaped the ranks): no process outlives the run, and
        from multiprocessing import forkserver  # its CPU time is counted in this process's children's

        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is not None:
            stop()
    return worst


def run(args: argparse.Namespace, deadline: float, start_method: str) -> int:
    """One benchmark run (one shape, its systems and precisions), ending before ``deadline``."""
    specs = args.systems.split(",")
    for s in specs:
        parse_system(s)
    cfg = dict(vars(args))
    cfg["start_method"] = start_method
    cfg["timeout"] = max(1.0, deadline - time.monotonic())
    if not cfg["threads"]:
        cfg["threads"] = max(1, (os.cpu_count() or 1) // args.world_size)
    os.environ["OMP_NUM_THREADS"] = str(cfg["threads"])  # inherited by the rank processes
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # model FLOPs per token: 6 N (N: parameters, tied head once) + attention 12 L T d (PaLM appendix B)
    cfg["flops_per_token"] = 0.0
    load_before = _load()
    print(f"# load before: {load_before}", file=sys.stderr, flush=True)
    rows, loads, failed = [], [], []
    started = datetime.datetime.now()
    for precision in args.precisions.split(","):
        res = run_block(precision, specs, cfg, deadline, loads)
        failed += [(precision, spec, r["error"]) for spec, r in res.items() if "error" in r]
        done = [spec for spec in specs if "report" in res[spec] and res[spec]["steps"]]
        if done and args.backend == "nccl":
            n_params = res[done[0]]["ready"][0]["n_params"]
            cfg["flops_per_token"] = 6 * n_params + 12 * args.n_layer * args.seq * args.n_embd
        block = [summarize(precision, spec, res[spec], cfg) for spec in done]
        rows += block
        if args.jsonl:
            _append_rows(args, block, [(spec, r["error"]) for spec, r in res.items() if "error" in r])
    load_after = _load()
    from importlib.metadata import version

    n_params = rows[0]["n_params"] if rows else 0
    print(
        f"{args.model} {n_params / 1e6:.1f}M parameters ({args.n_layer} layers × {args.n_embd}, {args.n_head} heads, "
        f"vocab {args.vocab}), world size {args.world_size} ({args.backend}), {args.batch}×{args.seq} tokens per rank, "
        f"AdamW ({args.adamw} kernel), {cfg['threads']} thread(s) per rank; {args.repeats} interleaved repeats × "
        f"{args.steps} steps after "
        f"{args.warmup} warm-up per system ({args.repeats * args.steps} timed steps each)"
    )
    print(f"\n{started:%Y-%m-%d %H:%M}, {platform.node() or 'host'}: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {version('torch')}")
    print(f"load before: {load_before}\nload after:  {load_after}")
    if loads:
        print(f"1-min load average at each repeat: {min(loads):.2f} – {max(loads):.2f}")
    print_tables(rows, cfg)
    print_profile(rows)
    for precision, spec, error in failed:
        print(f"\n**{label(spec)} ({precision}) failed**: {error.strip().splitlines()[-1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "load_before": load_before, "load_after": load_after, "loads": loads,
                       "rows": rows, "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
