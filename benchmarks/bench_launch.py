"""The launch-bound benchmark: ZeroDDP's host work per step against FSDP2, DDP and the floor.

GPT-2's 12-block op graph at width 64 (HF GPT-2, 4 heads, vocab 256, 64 positions, 2 sequences of 64
tokens per rank), fp32, W = 2 on gloo, one torch thread per rank. The kernels are tiny, so a step's
time is mostly the host launching them and the engine's own Python work: on a GPU that host time is
what starves the device. Systems, interleaved by ``bench_engine.py`` (each in its own rank processes,
one system at a time, the order rotating per repeat):

- ``floor`` — no communication; ``ddp``; ``fsdp2`` (``fully_shard`` per block);
- ZeroDDP with the searched chunk size (``zero``) and with one chunk per transformer block
  (``zero:chunk_size=<block numel>``, computed here from the model): 13 chunks (12 blocks, and one for the
  embeddings and the final norm);
- ``exchanges`` — the floor plus the 39 exchanges of one block's elements that ZeroDDP issues a step at one
  chunk per block (13 gathers in the forward, 13 in the backward, 13 reductions), with no engine: what
  communication alone costs at that chunk size on this machine.

Reported: min / median / max ms per step and the median's ratio to the floor and to FSDP2
(``bench_engine.py``'s tables), with the machine's load average before and after.

Command: ``python benchmarks/bench_launch.py`` (``--repeats``, ``--steps``, ``--json`` pass through).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE = dict(model="hf-gpt2", n_layer=12, n_embd=64, n_head=4, vocab=256, seq=64, batch=2)


def block_numel() -> int:
    """Elements of one GPT-2 block at :data:`SHAPE` (the chunk size for one chunk per block)."""
    from engine_systems import blocks_of, build_module

    module = build_module({**SHAPE}, "cpu")
    return sum(p.numel() for p in blocks_of(module)[0].parameters())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per system per repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import bench_engine

    numel = block_numel()
    chunks = SHAPE["n_layer"] + 1  # one per block, one for the embeddings and the final norm
    systems = ["floor", f"exchanges:count={3 * chunks}:numel={numel}", "ddp", "fsdp2", "zero",
               f"zero:chunk_size={numel}"]
    forwarded = ["--systems", ",".join(systems), "--precisions", "fp32", "--world-size", "2", "--backend", "gloo",
                 "--threads", "1", "--repeats", str(args.repeats), "--steps", str(args.steps),
                 "--warmup", str(args.warmup)]
    for k, v in SHAPE.items():
        forwarded += [f"--{k.replace('_', '-')}", str(v)]
    if args.json:
        forwarded += ["--json", args.json]
    return bench_engine.main(forwarded)


if __name__ == "__main__":
    raise SystemExit(main())
