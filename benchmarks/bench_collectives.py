"""One chunk's collectives on gloo: the reduce-scatter ZeroDDP issues against gloo's own.

gloo implements the flat reduce-scatter (``reduce_scatter_single``) as a whole all-reduce; ZeroDDP's
:func:`torch_backend.zero.collectives.reduce_scatter_avg` uses an all-to-all and a local sum of this rank's
slice instead. This times, on ``--world-size`` gloo ranks with one torch thread each, a chunk of
``--numel`` fp32 elements through:

- ``all_reduce`` — gloo's all-reduce of the whole chunk (what DDP and keep-gathered chunks do);
- ``reduce_scatter_single`` — gloo's flat reduce-scatter (what FSDP2 calls);
- ``zero reduce_scatter_avg`` — ZeroDDP's (all-to-all + local sum, then the division by W);
- ``gloo all_gather_single`` — gloo's all-gather of the chunk from its shards (what FSDP2 calls);
- ``zero all_gather_flat`` — ZeroDDP's (at two ranks one all-to-all into the other half and a local
  copy: Note [gather as an exchange] in :mod:`torch_backend.zero.collectives`).

Each repeat runs every collective ``--calls`` times in a rotating order (interleaved); reported per
collective: min / median / max over repeats of the wall ms per call and the CPU ms per call of the
whole process (every thread: gloo's included), rank 0.

    .venv/bin/python benchmarks/bench_collectives.py                # 2 ranks, 1.3M elements, ~30 s
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time


def rank_main(rank: int, world: int, init_file: str, args) -> None:
    import torch
    import torch.distributed as dist

    from torch_backend.zero import collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD
    full = torch.randn(args.numel)
    shard = torch.empty(args.numel // world)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "reduce_scatter_single": lambda: collectives._REDUCE_SCATTER_FLAT(shard, full, group=group),
        "zero reduce_scatter_avg": lambda: collectives.reduce_scatter_avg(shard, full, group),
        "gloo all_gather_single": lambda: collectives._ALL_GATHER_FLAT(full, shard, group=group),
        "zero all_gather_flat": lambda: collectives.all_gather_flat(full, shard, group),
    }
    names = list(ops)
    results: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for rep in range(args.warmup + args.repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                ops[name]()
            if rep >= args.warmup:
                results[name].append(((time.perf_counter() - wall) / args.calls * 1e3,
                                      (time.process_time() - cpu) / args.calls * 1e3))
    if rank == 0:
        print(f"{world} gloo ranks, 1 thread each, {args.numel:,} fp32 elements per chunk; {args.repeats} repeats × "
              f"{args.calls} calls after {args.warmup} warm-up; load average {os.getloadavg()[0]:.2f}\n")
        print("| collective | wall ms/call min / median / max | CPU ms/call (all threads) min / median / max |")
        print("|---|---|---|")
        for name in names:
            w, c = zip(*results[name])
            print(f"| {name} | {min(w):.2f} / {statistics.median(w):.2f} / {max(w):.2f} | "
                  f"{min(c):.2f} / {statistics.median(c):.2f} / {max(c):.2f} |")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1_329_152, help="chunk elements (a multiple of the world size)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--calls", type=int, default=50, help="calls per collective per repeat")
    args = ap.parse_args()
    if args.numel % args.world_size:
        ap.error(f"--numel {args.numel} is not a multiple of --world-size {args.world_size}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-collectives-") as tmp:
        mp.spawn(rank_main, args=(args.world_size, os.path.join(tmp, "store"), args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
