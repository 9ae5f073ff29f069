"""ZeroDDP vs DistributedDataParallel vs FSDP2 (``fully_shard`` per block) on the same GPT.

For each engine and precision one spawned run of ``--world-size`` ranks trains the byte-level GPT of
``torch_backend.gpt`` (default: 6 layers, 576 wide, 24.2M parameters) with AdamW on the same
per-rank batch, and reports, per engine and precision:

- median step time (forward + backward + optimizer step), seconds — the slowest rank's median;
- peak RSS per rank, MiB (``ru_maxrss`` of the rank's process: the whole process, torch included);
- model-state bytes per rank, MiB — parameters, gradients, fp32 master and optimizer states this rank
  holds right after ``step()`` (before ``zero_grad``). DDP: full parameters, gradients and states;
  FSDP2: the local shards of its DTensors; ZeroDDP: ``optim.memory_report().model_state_bytes()``.

Precisions: ``fp32``; ``bf16`` = ZeroDDP(mixed_precision="bf16"), DDP under ``torch.autocast``
(bf16) with fp32 parameters, FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)`` (fp32 shards,
bf16 gather and reduce).

Gloo on CPU by default; ``--backend nccl`` puts rank ``r`` on GPU ``r`` (peak CUDA memory is then
reported too). Engine ``plain`` is the module without any wrapper (bf16 via autocast): the world-size-1
reference on a GPU. Prints a markdown table (the result of one run, not an average of runs).

    .venv/bin/python benchmarks/bench_ddp.py --world-size 2 --steps 6
    .venv/bin/python benchmarks/bench_ddp.py --backend nccl --world-size 1 --precisions bf16 \
        --engines zero,plain --batch 16 --seq 1024 --n-layer 12 --n-embd 768 --n-head 12
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_backend._testing import run_distributed  # noqa: E402
from torch_backend.gpt import GPT, GPTConfig  # noqa: E402


def _local_bytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def _torch_model_state_bytes(params, optimizer) -> int:
    total = sum(_local_bytes(p.data if not hasattr(p, "to_local") else p) + _local_bytes(p.grad) for p in params)
    for st in optimizer.state.values():
        total += sum(_local_bytes(v) for v in st.values() if isinstance(v, torch.Tensor))
    return total


def worker(rank: int, world: int, engine: str, precision: str, cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    device = torch.device("cpu")
    if cfg["backend"] == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    gcfg = GPTConfig(block_size=cfg["seq"], vocab_size=256, n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"])
    module = GPT(gcfg).to(device)
    n_params = module.num_params()
    bf16 = precision == "bf16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if (bf16 and engine in ("ddp", "plain")) else None

    if engine == "zero":
        from torch_backend import ZeroDDP, ZeroOptimizer

        model = ZeroDDP(module, mixed_precision=precision)
        optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4)
    elif engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(module, gradient_as_bucket_view=True, device_ids=[device.index] if device.type == "cuda" else None)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif engine == "plain":  # no data parallelism at all (world size 1 reference)
        model = module
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        for block in module.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(module, mesh=mesh, mp_policy=mp)
        model = module
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        raise ValueError(engine)

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, 256, (cfg["batch"], cfg["seq"] + 1), generator=g).to(device)
    inp, tgt = x[:, :-1], x[:, 1:]

    def step():
        if autocast is not None:
            with autocast:
                logits = model(inp)
        else:
            logits = model(inp)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt.reshape(-1))
        if engine == "zero":
            optim.backward(loss)
        else:
            loss.backward()
        optim.step()

    times, state_bytes = [], 0
    for i in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= cfg["warmup"]:
            times.append(dt)
        if i == cfg["warmup"]:
            if engine == "zero":
                state_bytes = optim.memory_report().model_state_bytes()
            else:
                state_bytes = _torch_model_state_bytes(list(model.parameters()), optim)
        optim.zero_grad()
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "median_s": statistics.median(times),
        "peak_rss_mib": peak_rss_mib,
        "state_mib": state_bytes / 2**20,
        "n_params": n_params,
        "peak_cuda_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--engines", default="zero,ddp,fsdp2")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=9)
    ap.add_argument("--n-embd", type=int, default=576)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    cfg = dict(vars(args))
    rows = []
    for precision in args.precisions.split(","):
        for engine in args.engines.split(","):
            res = run_distributed(worker, args.world_size, engine, precision, cfg, timeout=args.timeout,
                                  env={"CHUNKZERO_TEST_THREADS": str(args.threads)}, backend=args.backend)
            rows.append((engine, precision, res))
            print(f"# {engine} {precision}: {res[0]}", file=sys.stderr, flush=True)
    n_params = rows[0][2][0]["n_params"]
    names = {"zero": "ZeroDDP", "ddp": "DDP", "fsdp2": "FSDP2 (fully_shard per block)", "plain": "plain torch (autocast)"}
    print(f"GPT {n_params / 1e6:.1f}M parameters ({args.n_layer} layers, width {args.n_embd}), world size "
          f"{args.world_size} ({args.backend}), batch {args.batch}x{args.seq} tokens per rank, AdamW, "
          f"{args.threads} thread(s) per rank, median of {args.steps} steps after {args.warmup} warm-up\n")
    cuda = args.backend == "nccl"
    print("| engine | precision | median step (s) | peak RSS per rank (MiB) | model-state per rank (MiB) |"
          + (" peak CUDA per rank (MiB) |" if cuda else ""))
    print("|---|---|---:|---:|---:|" + ("---:|" if cuda else ""))
    for engine, precision, res in rows:
        step = max(r["median_s"] for r in res)
        rss = max(r["peak_rss_mib"] for r in res)
        state = max(r["state_mib"] for r in res)
        extra = f" {max(r['peak_cuda_mib'] for r in res):.0f} |" if cuda else ""
        print(f"| {names[engine]} | {precision} | {step:.3f} | {rss:.0f} | {state:.1f} |{extra}")
    print(f"\n{datetime.date.today().isoformat()}, {platform.node() or 'host'}: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")


if __name__ == "__main__":
    main()
