"""CPU AdamW for optimizer-offloaded chunks: torch's for-loop, ``foreach`` and ``fused`` kernels, and
DeepSpeed's ``DeepSpeedCPUAdam`` where it is installed.

An offloaded ``ZeroOptimizer`` steps one fp32 master shard per chunk on the host, so the shapes that
matter are a few large flat tensors. Layouts, for ``N`` fp32 elements in all:

- ``flat`` — one tensor of ``N`` elements (a single chunk's shard);
- ``views`` — ``--pieces`` (default 100) equal slices of one flat buffer, each its own parameter
  (the chunks of a model, one master shard each, as ``ZeroOptimizer`` sees them).

Implementations (all AdamW, lr 1e-3, weight decay 0.01, fp32 states): ``torch-loop``
(``foreach=False, fused=False``: torch's CPU default), ``torch-foreach`` (``foreach=True``),
``torch-fused`` (``fused=True``), ``deepspeed`` (``DeepSpeedCPUAdam(adamw_mode=True)``, its
AVX-512/AVX2 C++ kernel, JIT-built on first use). Every implementation steps its own parameters with
the same gradients; repeats are interleaved (each repeat times every implementation once, in a
rotating order). Reported: median and min ms per step, and the effective memory bandwidth (AdamW
reads parameter, gradient, ``exp_avg``, ``exp_avg_sq`` and writes three of them: 28 bytes per element).

    .venv/bin/python benchmarks/bench_cpu_adam.py                        # torch kernels
    ds-venv/bin/python benchmarks/bench_cpu_adam.py    # + DeepSpeed: a venv with `pip install torch==2.13.0 deepspeed`
    python benchmarks/bench_cpu_adam.py --sizes 1e6 --repeats 2 --warmup 1   # plumbing check
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import time

import torch

BYTES_PER_ELEMENT = 28  # reads p, g, m, v and writes p, m, v, fp32
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def make_params(numel: int, pieces: int, seed: int) -> list[torch.nn.Parameter]:
    """``pieces`` parameters viewing one flat fp32 buffer of ``numel`` elements, with gradients."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(numel, generator=g)
    grad = torch.randn(numel, generator=g) * 1e-2
    bounds = [numel * i // pieces for i in range(pieces + 1)]
    params = []
    for a, b in itertools.pairwise(bounds):
        p = torch.nn.Parameter(flat[a:b])
        p.grad = grad[a:b]
        params.append(p)
    return params


def optimizers() -> dict:
    out = {
        "torch-loop": lambda ps: torch.optim.AdamW(ps, foreach=False, fused=False, **HYPER),
        "torch-foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER),
        "torch-fused": lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - not installed, or its import fails here: measured without it
        return out
    out["deepspeed"] = lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, fp32_optimizer_states=True, **HYPER)
    return out


def agreement(impls: dict, numel: int = 100_000, steps: int = 3) -> float:
    """Largest relative difference between the implementations' parameters after ``steps`` steps from
    the same start (a sanity check that they compute the same AdamW)."""
    out = {}
    for name, make in impls.items():
        params = make_params(numel, 3, 0)
        opt = make(params)
        for _ in range(steps):
            opt.step()
        out[name] = torch.cat([p.detach() for p in params])
    ref = next(iter(out.values()))
    return max(float((v - ref).abs().max() / ref.abs().max()) for v in out.values())


def bench(numel: int, pieces: int, repeats: int, warmup: int, impls: dict) -> dict[str, list[float]]:
    """Seconds per step of each implementation. All step the same parameters and gradients (only the
    timing matters here; each keeps its own ``exp_avg``/``exp_avg_sq``), which bounds the memory to
    ``8 + 8 × implementations`` bytes per element."""
    params = make_params(numel, pieces, 0)
    opts = {name: make(params) for name, make in impls.items()}
    for _ in range(warmup):
        for opt in opts.values():
            opt.step()
    times: dict[str, list[float]] = {name: [] for name in opts}
    names = list(opts)
    for rep in range(repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            opts[name].step()
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e7,3e7,1e8", help="fp32 elements in all, comma-separated")
    ap.add_argument("--pieces", type=int, default=100, help="parameters of the 'views' layout")
    ap.add_argument("--layouts", default="flat,views")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--impls", default="", help="subset of implementations (default: all available)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    impls = optimizers()
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    load_before = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    diff = agreement(impls)
    rows = []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        for layout in args.layouts.split(","):
            pieces = 1 if layout == "flat" else args.pieces
            times = bench(size, pieces, args.repeats, args.warmup, impls)
            loop = statistics.median(times["torch-loop"]) if "torch-loop" in times else None
            for name, ts in times.items():
                med = statistics.median(ts)
                rows.append((size, layout, pieces, name, med, min(ts), max(ts), size * BYTES_PER_ELEMENT / med / 1e9,
                             loop / med if loop else float("nan")))
    load_after = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    version = ""
    if "deepspeed" in impls:
        import deepspeed

        version = f", DeepSpeed {deepspeed.__version__}"
    print(f"CPU AdamW step, fp32; {torch.get_num_threads()} torch thread(s); {args.repeats} interleaved repeats after "
          f"{args.warmup} warm-up; torch {torch.__version__}{version}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    print(f"load before: {load_before}\nload after:  {load_after}\n")
    print(
        "| elements | layout | implementation | median ms | min ms | max ms | GB/s (28 B/elem) | speed-up vs "
        "torch-loop |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for size, layout, pieces, name, med, lo, hi, gbs, speedup in rows:
        lay = layout if pieces == 1 else f"{layout} ({pieces})"
        print(f"| {size:,} | {lay} | {name} | {1e3 * med:.1f} | {1e3 * lo:.1f} | {1e3 * hi:.1f} | {gbs:.1f} | "
              f"{speedup:.2f}× |")
    print(f"\nAgreement: after 3 steps from the same start, the implementations' parameters differ by at most "
          f"{diff:.1e} (relative to the largest).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
