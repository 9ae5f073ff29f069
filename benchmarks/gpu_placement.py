"""GPU figures of ``ZeroDDP(placement="auto")`` on one GPU (bf16, sequence length 1024, world size 1).

Two parts, each printing a markdown table (for ``benchmarks/gpu_check.sh``, which can call this script
as one of its parts, or by hand):

- ``--part speed``: one GPT shape trained with no offload (``placement="static"``) and with ``auto`` at
  50% and 25% of the model data on the device (``AutoPlacement.budget_for_fraction``: that share of the
  parameter shards plus the warm-up trace's peak non-model bytes): tokens/s (median step after the
  plan is applied), peak ``torch.cuda.max_memory_allocated``, parameter bytes moved per step,
  optimizer chunks on the host.
- ``--part largest``: the largest GPT of a ladder (width ``--n-embd``, depth ``--ladder``) that trains
  (three steps: the warm-up, the planned step and one more) with ``auto`` at its default budget
  (``steady_device_cap_ratio`` × the device's memory) and without offload. Sizes are tried from the
  largest that memory arithmetic says could fit, each in a fresh process under ``--try-timeout``;
  after one trains, the next larger is tried too, while ``--budget-s`` lasts.

Every configuration runs in its own process, so an out-of-memory (device or host) is a row, not the end.
That process stays in this script's process group (a timeout that kills the group kills it too, and
never leaves it holding the device) and is killed past ``--try-timeout`` or the ``--budget-s`` left.
``--jsonl PATH`` appends each configuration's row (``kind: placement``) as soon as it is measured.
``--smoke`` runs the same code on the CPU with tiny shapes (checks the plumbing anywhere).

    python benchmarks/gpu_placement.py --part speed --n-layer 24 --n-embd 2048 --n-head 16
    python benchmarks/gpu_placement.py --part largest --n-embd 4096 --n-head 32 --ladder 24,28,32,36,40
    python benchmarks/gpu_placement.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STATE_BYTES_PER_PARAM = 18
"""bf16 with AdamW: 2 (bf16 shard) + 4 (fp32 master) + 4 (fp32 gradient) + 8 (two fp32 moments)."""


def gpt_params(n_layer: int, n_embd: int, seq: int, vocab: int = 256) -> int:
    """Parameters of ``torch_backend.train.gpt.GPT`` (tied head, biases, LayerNorms)."""
    per_block = 12 * n_embd * n_embd + 13 * n_embd
    return n_layer * per_block + (vocab + seq) * n_embd + 2 * n_embd


# ------------------------------------------------------------------------------ one configuration
def run_one(cfg: dict) -> dict:
    """Train one configuration in this process; returns its measurements (or the error)."""
    import torch
    import torch.nn.functional as F

    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.train.gpt import GPT, GPTConfig

    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    gcfg = GPTConfig(block_size=cfg["seq"], vocab_size=256, n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                     n_embd=cfg["n_embd"])
    torch.manual_seed(0)
    with torch.device("meta"):
        module = GPT(gcfg)
    kwargs = {"placement": "auto"} if cfg["placement"] == "auto" else {}
    model = ZeroDDP(module, mixed_precision="bf16", device=device, **kwargs)
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, eps=1e-6)
    ap = model.auto_placement
    batch = torch.randint(0, 256, (cfg["batch"], cfg["seq"] + 1), device=device)
    x, y = batch[:, :-1], batch[:, 1:]

    def step() -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    out = {"params": module.num_params(), "chunks": len(model.chunks)}
    step()  # warm-up (auto: traced with every chunk on the host)
    if ap is not None and cfg.get("fraction") is not None:
        ap.budget_bytes = ap.budget_for_fraction(cfg["fraction"])
    step()  # auto: plans, moves the masters, enters the cycle
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = [step() for _ in range(cfg["steps"])]
    out["tokens_per_s"] = cfg["batch"] * cfg["seq"] / statistics.median(times)
    out["peak_device_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    if ap is not None:
        steady = ap.step_bytes_moved[-cfg["steps"]:]
        out.update(budget_gib=ap.budget_bytes / 2**30, moved_mib_per_step=sum(steady) / len(steady) / 2**20,
                   optim_host=ap.plan.optim_host_count, trainable=sum(c.requires_grad for c in model.chunks),
                   param_gib=sum(ap.chunk_bytes) / 2**30)
    return out


def _try(cfg: dict, timeout: float) -> dict:
    """``run_one(cfg)`` in a fresh process (its own process group), killed after ``timeout`` seconds."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(cfg)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # same process group as this script: whoever kills the group (gpu_check.sh's part timeout) kills it
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return {"error": tail[:160] + (" (killed: host out of memory?)" if proc.returncode == -9 else "")}


def _row(args, row: dict) -> None:
    if args.jsonl:
        import gpu_rows

        gpu_rows.add(args.jsonl, {"part": args.part_name, "kind": "placement", **row})


# ------------------------------------------------------------------------------ parts
def part_speed(args, base: dict) -> None:
    cfg = {**base, "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head}
    n = gpt_params(args.n_layer, args.n_embd, args.seq)
    print(f"GPT {args.n_layer} x {args.n_embd} ({n / 1e9:.2f}B parameters), bf16, batch {args.batch} x {args.seq}, "
          f"AdamW, world size 1, median of {args.steps} steps after the plan is applied\n")
    print("| placement | model data on the device | tokens/s | peak device GiB | budget GiB | param MiB moved / step "
          "| optimizer chunks on the host |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    deadline = time.monotonic() + args.budget_s
    for config in args.configs.split(","):
        placement, _, frac = config.partition(":")
        fraction = float(frac) if frac else None
        share = "100% (no offload)" if fraction is None else f"{100 * fraction:.0f}%"
        left = deadline - time.monotonic() - 2
        if left < 10:
            print(f"| {placement} | {share} | not tried: --budget-s spent | | | | |")
            _row(args, {"placement": placement, "share": share, "error": "not tried: --budget-s spent"})
            continue
        r = _try({**cfg, "placement": placement, "fraction": fraction}, min(args.try_timeout, left))
        _row(args, {"placement": placement, "share": share, "shape": f"{args.n_layer}x{args.n_embd}", **r})
        if "error" in r:
            print(f"| {placement} | {share} | failed: {r['error']} | | | | |")
            continue
        auto = placement == "auto"
        print(f"| {placement} | {share} | {r['tokens_per_s']:,.0f} | {r['peak_device_gib']:.1f} | "
              f"{r['budget_gib']:.1f} |" if auto else f"| {placement} | {share} | {r['tokens_per_s']:,.0f} | "
              f"{r['peak_device_gib']:.1f} | – |", end="")
        print(f" {r['moved_mib_per_step']:,.0f} | {r['optim_host']} of {r['trainable']} |" if auto else " 0 | 0 |")
        sys.stdout.flush()


def _fits(n_params: int, placement: str, device_bytes: int, host_bytes: int) -> bool:
    """Memory arithmetic: without offload the model state is on the device; with ``auto`` the warm-up
    holds it all on the host (pinned)."""
    need = n_params * STATE_BYTES_PER_PARAM
    return need <= (0.9 * device_bytes if placement == "static" else 0.9 * host_bytes)


def part_largest(args, base: dict) -> None:
    import torch

    ladder = sorted(int(v) for v in args.ladder.split(","))
    device_bytes = torch.cuda.get_device_properties(0).total_memory if base["device"] == "cuda" else 2**40
    host_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    deadline = time.monotonic() + args.budget_s
    print(f"GPT width {args.n_embd}, depth from {ladder}, bf16, batch {args.batch} x {args.seq}, AdamW; device "
          f"{device_bytes / 2**30:.0f} GiB, host {host_bytes / 2**30:.0f} GiB; three steps must run\n")
    print("| placement | layers | parameters | result | tokens/s | peak device GiB |")
    print("|---|---:|---:|---|---:|---:|")
    for placement in ("auto", "static"):
        sizes = [(L, gpt_params(L, args.n_embd, args.seq)) for L in ladder]
        start = max((i for i, (_, n) in enumerate(sizes) if _fits(n, placement, device_bytes, host_bytes)), default=0)
        i, best, tried = start, None, set()
        while 0 <= i < len(sizes) and i not in tried:
            left = deadline - time.monotonic()
            if left < 30:
                print(f"| {placement} | {sizes[i][0]} | {sizes[i][1] / 1e9:.2f}B | not tried: time budget spent | | |")
                break
            tried.add(i)
            L, n = sizes[i]
            r = _try({**base, "n_layer": L, "n_embd": args.n_embd, "n_head": args.n_head, "placement": placement,
                      "fraction": None, "steps": 1}, min(args.try_timeout, left))
            ok = "error" not in r
            print(f"| {placement} | {L} | {n / 1e9:.2f}B | {'trains' if ok else r['error']} | "
                  + (f"{r['tokens_per_s']:,.0f} | {r['peak_device_gib']:.1f} |" if ok else " | |"))
            sys.stdout.flush()
            if ok:
                best = i
                i += 1  # confirm the next larger does not
            elif best is None:
                i -= 1
            else:
                break
        print(
            f"| **{placement}: largest** | {sizes[best][0] if best is not None else '–'} | "
            f"{sizes[best][1] / 1e9:.2f}B | | | |"
            if best is not None
            else f"| **{placement}: largest** | – | – | | | |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("speed", "largest", "both"), default="both")
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=2048)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--ladder", default="16,24,32,36,40,48", help="depths for --part largest (width --largest-n-embd)")
    p.add_argument("--largest-n-embd", type=int, default=4096)
    p.add_argument("--largest-n-head", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--try-timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument("--budget-s", type=float, default=400.0, help="seconds for each part (its tries are cut to fit)")
    p.add_argument("--configs", default="static,auto:0.5,auto:0.25",
                   help="--part speed: placement[:share of the model data on the device], comma-separated")
    p.add_argument("--jsonl", help="append each configuration's row to this JSON-lines file")
    p.add_argument("--part-name", default="placement", help="the rows' part name (with --jsonl)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        try:
            print(json.dumps(run_one(json.loads(args.one))))
        except Exception as e:  # noqa: BLE001 - reported as the configuration's result
            print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"}))
        return
    if args.smoke:
        device = "cpu"  # no torch import here: the configurations' own processes import it
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.n_layer, args.n_embd, args.n_head, args.seq, args.batch, args.steps = 4, 128, 4, 64, 2, 2
        args.ladder, args.largest_n_embd, args.largest_n_head = "1,2,3", 64, 2
    elif device != "cuda":
        raise SystemExit("no CUDA device: run with --smoke to check the plumbing on the CPU")
    base = {"device": device, "seq": args.seq, "batch": args.batch, "steps": args.steps}
    if args.smoke:  # one torch thread: a tiny model's steps on every core of a shared CPU only spin
        base["threads"] = 1
    if args.part in ("speed", "both"):
        part_speed(args, base)
    if args.part in ("largest", "both"):
        print()
        args.n_embd, args.n_head = args.largest_n_embd, args.largest_n_head
        part_largest(args, base)


if __name__ == "__main__":
    main()
