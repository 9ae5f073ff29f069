"""Checkpoint save/load: chunkzero's sharded Orbax checkpoints vs ``torch.distributed.checkpoint`` vs a
rank-0 ``torch.save`` of the gathered full state dict — same model, same world size.

The model is a stack of ``--layers`` × ``Linear(d, d)`` (default 24 × 2048² ≈ 100.7M fp32 parameters)
under ZeroDDP with a ZeroOptimizer(AdamW) whose state is filled (exp_avg, exp_avg_sq), so every method
writes parameters + optimizer state ≈ 1.2 GB. Each of ``--world`` gloo ranks holds 1/W of it.

- **orbax (chunkzero)**: ``save_checkpoint`` (synchronous: until committed) / ``load_checkpoint``. Every
  rank writes only its shards (jax.distributed on CPU, one process per rank); the load reads each rank's
  own ranges with TensorStore. Includes the checksums and the RNG-state gather. Two loads: the default
  staged one (read into new buffers, agreed across ranks, then copied in) and ``staged=False``
  (straight into the live shards).
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

With ``--resume-world 3`` it measures instead what a resume at another world size reads: the same
model and state saved at ``--world`` ranks, then loaded by ``--resume-world`` ranks; per rank, the bytes
it owns (valid elements of its new shards: parameters and both AdamW states) and the bytes TensorStore
read from files during its ``load_checkpoint`` (its ``/tensorstore/kvstore/file/bytes_read`` counter:
array data and OCDBT metadata, page cache or not).
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


def _model(rank, args):
    """The benchmark's ZeroDDP model and a ZeroOptimizer(AdamW) whose state is filled."""
    import torch
    from torch import nn

    from torch_backend import ZeroDDP, ZeroOptimizer

    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)])
    model = ZeroDDP(module, chunk_size=4 * args.dim * args.dim)
    del module
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for c in model.layout.chunks:
        n = model.layout.shard_numel(c.index)
        optim.load_shard_state(
            c.index,
            {
                "exp_avg": torch.randn(n, generator=g),
                "exp_avg_sq": torch.rand(n, generator=g),
                "step": torch.tensor(1.0),
            },
        )
    return model, optim


def _worker(rank, world, args, root):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from torch_backend.checkpoint.sharded import load_checkpoint, save_checkpoint

    model, optim = _model(rank, args)
    n_params = model.layout.utilized_numel
    root = Path(root)
    results: dict[str, list[float]] = {}

    def record(name, seconds):
        results.setdefault(name, []).append(seconds)

    # ---- chunkzero / Orbax
    for i in range(args.repeats):
        record("orbax save", _timed(lambda i=i: save_checkpoint(root / "orbax", model, optim, step=i + 1)))
        record("orbax load", _timed(lambda: load_checkpoint(root / "orbax", model, optim)))  # staged (the default)
        record("orbax in place load", _timed(lambda: load_checkpoint(root / "orbax", model, optim, staged=False)))

    # ---- DCP with DTensors of each chunk's shards
    mesh = init_device_mesh("cpu", (world,))

    def dtensors():
        sd = {}
        for c in model.layout.chunks:
            shape = (c.size,)
            sd[f"params.{c.index}"] = DTensor.from_local(
                model.master_shard(c.index), mesh, [Shard(0)], shape=shape, stride=(1,)
            )
            for k, v in optim.shard_state(c.index).items():
                if v.dim() == 1:
                    sd[f"optim.{k}.{c.index}"] = DTensor.from_local(v, mesh, [Shard(0)], shape=shape, stride=(1,))
        return sd

    for i in range(args.repeats):
        path = root / f"dcp{i}"
        record("dcp save", _timed(lambda path=path: dcp.save(dtensors(), checkpoint_id=path)))
        record(
            "dcp load", _timed(lambda path=path: dcp.load(dtensors(), checkpoint_id=path))
        )  # in place into the live shards

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


def _resume_save(rank, world, args, root):
    from torch_backend.checkpoint.sharded import save_checkpoint

    model, optim = _model(rank, args)
    save_checkpoint(root, model, optim, step=1)


def _resume_load(rank, world, args, root):
    """Load the checkpoint saved at another world size; this rank's owned and read bytes."""
    from chunkzero.checkpoint.reader import file_bytes_read
    from torch_backend.checkpoint.sharded import load_checkpoint

    model, optim = _model(rank, args)
    layout = model.layout
    owned = sum(layout.valid_length(c.index, rank) for c in layout.chunks) * 4 * 3  # fp32 params + 2 AdamW states
    before = file_bytes_read()
    t0 = time.perf_counter()
    load_checkpoint(root, model, optim)
    return {"owned": owned, "read": file_bytes_read() - before, "seconds": time.perf_counter() - t0}


def resume_bytes(args, base: Path) -> str:
    """Bytes each rank reads from disk when a world-size-``args.world`` checkpoint is loaded at
    ``args.resume_world``: the markdown table."""
    from torch_backend._testing import run_distributed

    root = base / "resume"
    run_distributed(_resume_save, args.world, args, str(root), timeout=3000)
    rows = run_distributed(_resume_load, args.resume_world, args, str(root), timeout=3000)
    lines = [
        f"| rank (of {args.resume_world}) | owned MB | read MB | read / owned | load s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for rank, r in enumerate(rows):
        lines.append(
            f"| {rank} | {r['owned'] / 1e6:.1f} | {r['read'] / 1e6:.1f} | {r['read'] / r['owned']:.3f} | "
            f"{r['seconds']:.2f} |"
        )
    total_owned, total_read = sum(r["owned"] for r in rows), sum(r["read"] for r in rows)
    lines.append(f"| all | {total_owned / 1e6:.1f} | {total_read / 1e6:.1f} | {total_read / total_owned:.3f} | |")
    return "\n".join(lines)


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
    ap.add_argument("--resume-world", type=int, default=0,
                    help="instead of the timings: save at --world, load at this world size, and print the bytes "
                         "each rank reads (TensorStore's file-read counter)")
    args = ap.parse_args(argv)

    from torch_backend._testing import run_distributed

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    base.mkdir(parents=True, exist_ok=True)
    if args.resume_world:
        try:
            table = resume_bytes(args, base)
        finally:
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
        print(table)
        return table
    try:
        dd = dd_write_rate(base)
        results = run_distributed(_worker, args.world, args, str(base), timeout=3000)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    r0 = results[0]
    state_bytes = r0["params"] * 4 * 3
    rows = []
    names = {"orbax": "chunkzero Orbax (sharded), staged load", "orbax in place": "chunkzero Orbax, load staged=False",
             "dcp": "torch DCP (DTensor shards)", "torch.save rank 0": "rank-0 torch.save (gathered)"}
    for method, name in names.items():
        save_key = "orbax" if method.startswith("orbax") else method
        save = statistics.median(r0["times"][f"{save_key} save"])
        load = statistics.median(r0["times"][f"{method} load"])
        rows.append(
            f"| {name} | {save:.2f} | {state_bytes / save / 1e6:.0f} | {load:.2f} | {state_bytes / load / 1e6:.0f} | "
            f"{r0['sizes'][save_key] / 1e6:.0f} |"
        )
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
