"""Bytes moved per step by ``ZeroDDP(placement="auto")`` against Gemini's static policy at the same budget.

A byte-level GPT (default: 6 layers, 256 wide, 4.8M parameters, the default chunk search) trains on
the CPU under ``placement="auto"``. The first step is the warm-up trace; then, for each budget, the
model is re-planned twice through the same engine — with the ``auto`` rule (Belady's farthest next
use, or the static plan when that is cheaper) and with the ``static`` rule (the smallest prefix of
chunks on the host, each moved in before its access and out after) — and trains until its plan's
cycle is complete; the table gives the parameter-shard bytes each moved per step in steady state
(host→device plus device→host), measured by the engine's counters (the script checks they equal the
plan's).

Budgets are simulated: ``AutoPlacement.budget_for_fraction(f)`` = ``f`` × the parameter shards'
bytes (the model data the plan places) + the trace's peak non-model and transient bytes, from 100%
down to the smallest budget ``plan_placement`` accepts (one access's chunk plus its non-model memory);
budgets above 100% leave a margin in which the optimizer state (master, gradient and Adam's
moments, 16 bytes per element against the shard's 4) of the last chunks goes on the device.
On a CPU host and device are the same memory: the copies run all the same and are counted.

    .venv/bin/python benchmarks/bench_placement.py
    .venv/bin/python benchmarks/bench_placement.py --world-size 2 --n-layer 4
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_backend import ZeroDDP, ZeroOptimizer  # noqa: E402
from torch_backend._testing import run_distributed  # noqa: E402
from torch_backend.train.gpt import GPT, GPTConfig  # noqa: E402

FRACTIONS = (5.0, 3.0, 2.0, 1.0, 0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05)


def _measure(rank: int, world: int, args) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(block_size=args.seq, vocab_size=256, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    module = GPT(cfg)
    model = ZeroDDP(module, placement="auto", prefetch=args.prefetch)
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, eps=1e-6)
    ap = model.auto_placement
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 256, (args.batch, args.seq), generator=g)

    def step() -> int:
        loss = F.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        return ap.step_bytes_moved[-1]

    step()  # warm-up: traced with every chunk on the host
    trace, total = ap.trace, sum(ap.chunk_bytes)
    need = max(ap.chunk_bytes[c] + a + b + ap.resident_bytes
               for c, a, b in zip(trace.access_order, trace.non_model_bytes, trace.transient_bytes))
    smallest = (need - trace.peak_bytes - ap.resident_bytes) / total
    budgets = [(f, ap.budget_for_fraction(f)) for f in FRACTIONS if f > smallest] + [(smallest, need)]
    rows = []
    for fraction, budget in budgets:
        row = {"fraction": fraction, "budget": budget}
        for policy in ("auto", "static"):
            ap.policy, ap.budget_bytes = policy, budget
            step()  # re-plans and enters the cycle
            plan = ap.plan
            moved = [step() for _ in range(plan.period_steps)]
            row[policy] = sum(moved) / len(moved)
            row[f"{policy}_plan"] = plan.bytes_moved_per_step
            row[f"{policy}_rule"] = plan.policy
            row[f"{policy}_optim_host"] = plan.optim_host_count
        rows.append(row)
    trainable = sum(1 for c in model.chunks if c.requires_grad)
    return {
        "rows": rows,
        "chunks": len(model.chunks),
        "chunk_size": model.layout.chunk_size,
        "params": module.num_params(),
        "param_bytes": total,
        "peak_non_model": trace.peak_bytes,
        "accesses": len(trace.access_order),
        "trainable": trainable,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.world_size == 1:
        results = [_measure(0, 1, args)]
    else:
        results = run_distributed(_measure, args.world_size, args, timeout=3600)
    r = results[0]
    print(f"{datetime.date.today()} · {platform.machine()} {platform.processor() or ''} · {os.cpu_count()} CPUs · "
          f"torch {torch.__version__} · load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"GPT {args.n_layer} x {args.n_embd}, {r['params'] / 1e6:.2f}M parameters, fp32, W = {args.world_size}, "
          f"batch {args.batch} x {args.seq} per rank, prefetch {args.prefetch}; {r['chunks']} chunks of "
          f"{r['chunk_size']:,} elements; rank 0: parameter shards {_mib(r['param_bytes'])} MiB, peak non-model + "
          f"transient {_mib(r['peak_non_model'])} MiB, {r['accesses']} chunk accesses per step")
    print()
    print(
        "| budget beyond the peak non-model bytes, share of the parameter shards | budget (MiB) | auto: MiB moved / "
        "step | static: MiB moved / step | auto / static "
        f"| auto rule | optimizer chunks on the host (auto, of {r['trainable']}) |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|")
    for row in r["rows"]:
        for q in results:  # every rank's plan agrees with what it moved
            for other in q["rows"]:
                if other["fraction"] == row["fraction"]:
                    for policy in ("auto", "static"):
                        if abs(other[policy] - other[f"{policy}_plan"]) > 0.5:
                            raise SystemExit(
                                f"measured {other[policy]} bytes/step differ from the plan's {other[f'{policy}_plan']}"
                            )
        ratio = "–" if row["static"] == 0 else f"{row['auto'] / row['static']:.2f}"
        label = f"{100 * row['fraction']:.1f}%" + (" (smallest)" if row is r["rows"][-1] else "")
        print(f"| {label} | {_mib(row['budget'])} | {_mib(row['auto'])} | {_mib(row['static'])} | {ratio} "
              f"| {row['auto_rule']} | {row['auto_optim_host']} |")


if __name__ == "__main__":
    main()
