"""Streaming export: peak memory of ``chunkzero export`` on a checkpoint bigger than 1 GB.

Writes a synthetic chunk checkpoint of Hugging Face GPT-2 medium's tensors (``chunkzero.configs``:
354.8M fp32 parameters, 1.42 GB; tensor names and shapes are GPT-2 medium's, values random) with a
chunk size of ``--chunk-numel`` elements, then exports it — each export in a fresh process — to
safetensors (fp32, and bf16) and to an Orbax parameter tree, and reports each process's peak resident
memory (``ru_maxrss``) next to its floor (the RSS after importing torch, JAX and Orbax and reading
the metadata, before any array is read), the largest tensor and the largest chunk. Streaming means
peak − floor stays near the largest chunk plus a tensor, not the model's size. Prints a markdown
table.

    .venv/bin/python benchmarks/bench_export.py [--model hf-gpt2-medium] [--chunk-numel 33554432] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make(args) -> dict:
    """Write the synthetic checkpoint (step 1, world size 1, parameters only)."""
    import numpy as np

    from chunkzero.checkpoint import CheckpointMeta
    from chunkzero.configs import model_specs
    from chunkzero.layout import ChunkLayout
    from torch_backend.checkpoint.sharded import write_shards

    layout = ChunkLayout.build(model_specs(args.model), args.chunk_numel, 1)
    rng = np.random.default_rng(0)
    params = {}
    for c in layout.chunks:
        a = np.zeros(c.size, dtype=np.float32)
        a[: c.utilized] = rng.standard_normal(c.utilized, dtype=np.float32) * 0.02
        params[c.index] = a
    write_shards(args.ckpt, CheckpointMeta(step=1, layout=layout, model_config={"name": args.model}), 0, params)
    return {"params": layout.utilized_numel, "chunks": len(layout.chunks),
            "largest_tensor_bytes": max(t.numel for t in layout.tensors) * 4,
            "largest_chunk_bytes": max(c.size for c in layout.chunks) * 4}


def export(args) -> dict:
    """One export in this process; its peak RSS and floor."""
    import jax  # noqa: F401  (imported before the floor is taken, as the export needs them)
    import orbax.checkpoint  # noqa: F401
    import torch  # noqa: F401

    from torch_backend.checkpoint.export import export_checkpoint
    from torch_backend.checkpoint.sharded import read_meta

    read_meta(args.ckpt)
    floor = _rss_mib()
    t0 = time.perf_counter()
    report = export_checkpoint(args.ckpt, args.out, format=args.format, dtype=args.dtype)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "floor_mib": floor,
        "peak_mib": peak,
        "seconds": seconds,
        "bytes": report.total_bytes,
        "files": len(report.files),
    }


def _child(mode: str, **kw) -> dict:
    cmd = [sys.executable, __file__, "--_child", mode] + [
        f"--{k.replace('_', '-')}={v}" for k, v in kw.items() if v is not None
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stdout + out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf-gpt2-medium")
    ap.add_argument("--chunk-numel", type=int, default=32 * 2**20)
    ap.add_argument("--dir")
    ap.add_argument("--_child", dest="child_mode", choices=("make", "export"))  # set by _child, not by users
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    ap.add_argument("--format")
    ap.add_argument("--dtype")
    args = ap.parse_args(argv)
    if args.child_mode == "make":
        print(json.dumps(make(args)))
        return ""
    if args.child_mode == "export":
        print(json.dumps(export(args)))
        return ""

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-export-"))
    base.mkdir(parents=True, exist_ok=True)
    ckpt = base / "ckpt"
    try:
        info = _child("make", model=args.model, chunk_numel=args.chunk_numel, ckpt=ckpt)
        rows = []
        for fmt, dtype in (("safetensors", None), ("safetensors", "bfloat16"), ("orbax-params", None)):
            out = base / f"out-{fmt}-{dtype or 'fp32'}"
            r = _child("export", ckpt=ckpt, out=out, format=fmt, dtype=dtype)
            shutil.rmtree(out, ignore_errors=True)
            rows.append(
                f"| {fmt} {dtype or 'float32'} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.1f} | "
                f"{r['bytes'] / r['seconds'] / 1e6:.0f} | "
                f"{r['floor_mib']:.0f} | {r['peak_mib']:.0f} | {r['peak_mib'] - r['floor_mib']:.0f} |"
            )
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    mib = 2**20
    table = "\n".join(
        [
            f"Checkpoint: {args.model} shapes, {info['params'] / 1e6:.1f}M fp32 parameters = "
            f"{info['params'] * 4 / 1e9:.2f} GB in "
            f"{info['chunks']} chunks (chunk size {args.chunk_numel:,} elements); largest tensor "
            f"{info['largest_tensor_bytes'] / mib:.0f} MiB, largest chunk {info['largest_chunk_bytes'] / mib:.0f} MiB. "
            f"Machine: {os.cpu_count()} CPU cores, Python {platform.python_version()}.",
            "",
            "| export | written GB | s | MB/s | floor RSS MiB | peak RSS MiB | peak − floor MiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(table)
    return table


if __name__ == "__main__":
    main()
