"""Checkpoint save/load: chunkzero's sharded Orbax checkpoints vs ``torch.distributed.checkpoint`` vs a
rank-0 ``torch.save`` of the gathered full state dict — same model, same world size.

The model is a stack of ``--layers`` × ``Linear(d, d)`` (default 24 × 2048² ≈ 100.7M fp32 parameters)
under ZeroDDP with a ZeroOptimizer(AdamW) whose state is filled (exp_avg, exp_avg_sq), so every method
writes parameters + optimizer state ≈ 1.2 GB. Each of ``--world`` gloo ranks holds 1/W of it.

- **orbax (chunkzero)**: ``save_checkpoint`` (synchronous: until committed) / ``load_checkpoint``. Every
  rank writes only its shards (jax.distributed on CPU, one process per rank); the load reads each rank's
  own ranges with TensorStore. Includes the checksums and the RNG-state gather.
- **DCP**: ``dcp.save`` / ``dcp.load`` of each chunk's master and optimizer shards as ``DTensor`` s
  (``Shard(0)`` over a 1-D device mesh) — the DCP way to save sharded state (default
  ``FileSystemWriter``).
- **torch.save rank 0**: ``model.state_dict()`` + ``optim.state_dict()`` gathered (collective), rank 0
  writes one file; load = every rank ``torch.load(weights_only=True, mmap=True)`` + ``load_state_dict``.

Times are wall seconds of the slowest rank (a barrier before and after), median of ``--repeats``; the
data goes through the page cache (loads follow saves; caches are not dropped on a shared machine).
``dd`` gives the disk's own sequential write rate (``conv=fdatasync``) for reference. Prints a markdown
table.

    .venv/bin/python benchmarks/bench_checkpoint.py [--layers 24] [--dim 2048] [--world 2] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank, world, args, root):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)])
    model = ZeroDDP(module, chunk_size=4 * args.dim * args.dim)
    del module
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for c in model.layout.chunks:
        n = model.layout.shard_numel(c.index)
        optim.load_shard_state(c.index, {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g),
                                         "step": torch.tensor(1.0)})
    n_params = model.layout.utilized_numel
    root = Path(root)
    results: dict[str, list[float]] = {}

    def record(name, seconds):
        results.setdefault(name, []).append(seconds)

    # ---- chunkzero / Orbax
    for i in range(args.repeats):
        record("orbax save", _timed(lambda i=i: save_checkpoint(root / "orbax", model, optim, step=i + 1)))
        record("orbax load", _timed(lambda: load_checkpoint(root / "orbax", model, optim)))

    # ---- DCP with DTensors of each chunk's shards
    mesh = init_device_mesh("cpu", (world,))

    def dtensors():
        sd = {}
        for c in model.layout.chunks:
            shape = (c.size,)
            sd[f"params.{c.index}"] = DTensor.from_local(model.master_shard(c.index), mesh, [Shard(0)], shape=shape, stride=(1,))
            for k, v in optim.shard_state(c.index).items():
                if v.dim() == 1:
                    sd[f"optim.{k}.{c.index}"] = DTensor.from_local(v, mesh, [Shard(0)], shape=shape, stride=(1,))
        return sd

    for i in range(args.repeats):
        path = root / f"dcp{i}"
        record("dcp save", _timed(lambda path=path: dcp.save(dtensors(), checkpoint_id=path)))
        record("dcp load", _timed(lambda path=path: dcp.load(dtensors(), checkpoint_id=path)))  # in place into the live shards

    # ---- rank-0 torch.save of the gathered full state dict
    for i in range(args.repeats):
        path = root / f"full{i}.pt"

        def save_full(path=path):
            sd = {"model": model.state_dict(), "optim": optim.state_dict()}
            if rank == 0:
                torch.save(sd, path)

        def load_full(path=path):
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            model.load_state_dict(sd["model"])
            optim.load_state_dict(sd["optim"])

        record("torch.save rank 0 save", _timed(save_full))
        record("torch.save rank 0 load", _timed(load_full))

    sizes = {
        "orbax": sum(p.stat().st_size for p in (root / "orbax" / str(args.repeats)).rglob("*") if p.is_file()),
        "dcp": sum(p.stat().st_size for p in (root / "dcp0").rglob("*") if p.is_file()),
        "torch.save rank 0": (root / "full0.pt").stat().st_size,
    }
    dist.barrier()
    return {"times": results, "sizes": sizes, "params": n_params}


def dd_write_rate(directory: Path, mib: int = 1024) -> float:
    """MB/s of ``dd if=/dev/zero bs=1M count=mib conv=fdatasync`` into ``directory``."""
    target = directory / "dd.bin"
    out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "conv=fdatasync"],
                         capture_output=True, text=True, check=True).stderr
    target.unlink()
    for line in out.splitlines():
        if "copied" in line:
            seconds = float(line.split(",")[-2].split()[0])
            return mib * 2**20 / seconds / 1e6
    raise RuntimeError(out)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="where to write (default: a temporary directory, removed after)")
    args = ap.parse_args(argv)

    from torch_backend._testing import run_distributed

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        dd = dd_write_rate(base)
        results = run_distributed(_worker, args.world, args, str(base), timeout=3000)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    r0 = results[0]
    state_bytes = r0["params"] * 4 * 3
    rows = []
    for method in ("orbax", "dcp", "torch.save rank 0"):
        key = "orbax" if method == "orbax" else method
        save = statistics.median(r0["times"][f"{key} save"])
        load = statistics.median(r0["times"][f"{key} load"])
        name = {"orbax": "chunkzero Orbax (sharded)", "dcp": "torch DCP (DTensor shards)",
                "torch.save rank 0": "rank-0 torch.save (gathered)"}[method]
        rows.append(f"| {name} | {save:.2f} | {state_bytes / save / 1e6:.0f} | {load:.2f} | {state_bytes / load / 1e6:.0f} | "
                    f"{r0['sizes'][method] / 1e6:.0f} |")
    cpu = platform.processor() or platform.machine()
    table = "\n".join([
        f"Model: {args.layers} × Linear({args.dim}, {args.dim}) = {r0['params'] / 1e6:.1f}M fp32 parameters + AdamW "
        f"state ({state_bytes / 1e9:.2f} GB), ZeroDDP world size {args.world} (gloo, CPU), median of {args.repeats}. "
        f"Disk: `dd` sequential write {dd:.0f} MB/s. Machine: {os.cpu_count()} CPU cores ({cpu}), Python "
        f"{platform.python_version()}.",
        "",
        "| method | save s | save MB/s | load s | load MB/s | on disk MB |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
    ])
    print(table)
    return table


if __name__ == "__main__":
    main()
