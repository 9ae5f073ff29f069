"""The CUDA stream paths one GPU can run, each checked bitwise: prefetch against ``prefetch=0``.

For each placement below, the same GPT (``torch_backend.train.gpt``, bf16 mixed precision, AdamW with
torch's default kernel choice, the same initial values and the same batch at every step) trains
``--steps`` steps three times in this process at world size 1: ``prefetch=0``, ``prefetch=1`` and
``prefetch=0`` again (the *control*). Two rows per placement compare the per-step losses and the
final parameters (``ZeroDDP.state_dict()``, fp32) with the first run, bitwise (``torch.equal``):

- ``prefetch=1`` vs ``prefetch=0``: prefetch only changes when a chunk is gathered (at W = 1 a copy,
  from the host when the parameter is offloaded), not which kernels run on which data in which order,
  so the results must be identical wherever the kernels are the same in both runs;
- the control: the same run twice, which tells whether the kernels themselves are deterministic here
  (if the control differs, a difference in the first row is the kernels', not the engine's).

``placement="auto"`` plans from a trace that depends on ``prefetch``: when the two runs' plans differ
(``plan_same`` false), a chunk's optimizer may step on the host in one run and on the device in the other
— another kernel, so bitwise equality is not expected there (on the CPU both are the same kernel).

Placements (``--configs``): ``static`` (everything on the device), ``optim50`` =
``offload_optim_frac=0.5`` (gradients device→host on the communication stream, AdamW on the host),
``param50`` = ``offload_param_frac=0.5`` (the parameter shards host→device at each gather; at W = 1
the gather is a copy on the current stream), ``offload100`` = both fractions 1.0, ``auto50`` =
``placement="auto"`` at half the model data on the device (``AutoPlacement.budget_for_fraction(0.5)``
after the warm-up step, or the smallest budget the trace allows if more: parameter shards move by the
plan while chunks are prefetched).

On CUDA one more step of the ``prefetch=1`` run (after the comparison) runs under ``torch.profiler``:
the bytes copied host→device and device→host on the compute stream (the stream with the most kernel
time) and on any other stream (the communication stream). The run uses
``torch.use_deterministic_algorithms(True, warn_only=True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and
the math attention kernel, so that the control can be exact.

One GPU cannot run NCCL at W > 1 (NCCL needs one device per rank): no collective runs here, and at W = 1
ZeroDDP's gathers and reductions are local copies.

    python benchmarks/gpu_streams.py --jsonl rows.jsonl            # CUDA if present
    python benchmarks/gpu_streams.py --smoke --jsonl rows.jsonl    # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_rows  # noqa: E402

CONFIGS = {
    "optim50": {"offload_optim_frac": 0.5},
    "param50": {"offload_param_frac": 0.5},
    "auto50": {"placement": "auto"},
    "static": {},
    "offload100": {"offload_optim_frac": 1.0, "offload_param_frac": 1.0},
}
"""Placement name → ``ZeroDDP`` keyword arguments (``auto50`` also sets its budget after the warm-up)."""


def train(base, kwargs: dict, prefetch: int, args, device, *, profile: bool) -> dict:
    """``args.steps`` steps of a copy of ``base``; the losses, the final fp32 parameters (host), the
    auto plan's signature, bytes moved and (``profile``) one more step's copies by stream."""
    import torch
    import torch.nn.functional as F

    from torch_backend import ZeroDDP, ZeroOptimizer

    module = copy.deepcopy(base).to(device)
    model = ZeroDDP(module, mixed_precision="bf16", prefetch=prefetch, **kwargs)
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, eps=1e-6)
    ap = model.auto_placement
    g = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps + 1)]

    def step(i: int) -> torch.Tensor:
        b = batches[i].to(device)
        loss = F.cross_entropy(model(b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten())
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        return loss.detach()

    losses = []
    for i in range(args.steps):
        losses.append(step(i))
        if i == 0 and ap is not None:
            ap.budget_bytes = auto_budget_bytes(ap, 0.5)
    model.synchronize()
    out = {"losses": torch.stack(losses).float().cpu(),
           "params": {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}}
    if ap is not None:
        out["plan"] = None if ap.plan is None else repr((ap.plan.optim_host, ap.plan.steps))
        out["moved_mib"] = sum(ap.step_bytes_moved) / 2**20
    if profile and device.type == "cuda":
        out.update(_profiled_copies(lambda: step(args.steps), torch))
    return out


def auto_budget_bytes(ap, fraction: float) -> int:
    """``ap.budget_for_fraction(fraction)``, raised to the smallest budget the traced step allows (one
    access's chunk plus its non-model and transient bytes) where that is more (a small model's chunks)."""
    trace = ap.trace
    need = max(ap.chunk_bytes[c] + a + b + ap.resident_bytes
               for c, a, b in zip(trace.access_order, trace.non_model_bytes, trace.transient_bytes))
    return max(ap.budget_for_fraction(fraction), need)


def _profiled_copies(run, torch) -> dict:
    """MiB copied host→device and device→host during ``run()``, on the compute stream (most kernel
    time) and on the others; an ``error`` field if the profiler's trace cannot be read."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        kernel_us: dict = {}
        for e in events:
            if e.get("cat") == "kernel":
                s = e.get("args", {}).get("stream")
                kernel_us[s] = kernel_us.get(s, 0.0) + float(e.get("dur", 0.0))
        compute = max(kernel_us, key=kernel_us.get) if kernel_us else None
        out = {f"{d}_mib_{w}": 0.0 for d in ("h2d", "d2h") for w in ("compute", "other")}
        for e in events:
            if e.get("cat") != "gpu_memcpy":
                continue
            name, a = e.get("name", ""), e.get("args", {})
            direction = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else None
            if direction is None:
                continue
            where = "compute" if a.get("stream") == compute else "other"
            out[f"{direction}_mib_{where}"] += float(a.get("bytes", 0)) / 2**20
        out["streams_with_kernels"] = len(kernel_us)
        return out
    except Exception as e:  # noqa: BLE001 - the profile is a measurement, not the check
        return {"profile_error": f"{type(e).__name__}: {str(e)[:150]}"}


def _diff(a: dict, b: dict) -> tuple[bool, bool, float]:
    import torch

    losses_equal = torch.equal(a["losses"], b["losses"])
    params_equal = a["params"].keys() == b["params"].keys() and all(
        torch.equal(v, b["params"][k]) for k, v in a["params"].items()
    )
    worst = max(
        ((v - b["params"][k]).abs().max().item() for k, v in a["params"].items() if k in b["params"]), default=0.0
    )
    return losses_equal, params_equal, worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=60.0, help="no placement starts that would not end in time")
    p.add_argument("--jsonl", help="append one row per comparison to this JSON-lines file")
    p.add_argument("--part", default="streams", help="the rows' part name")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args()
    t_start = time.monotonic()
    import torch

    from torch_backend.train.gpt import GPT, GPTConfig

    if args.smoke:
        args.n_layer, args.n_embd, args.n_head, args.seq, args.batch = 2, 64, 2, 32, 2
        args.steps = min(args.steps, 4)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    base = GPT(
        GPTConfig(block_size=args.seq, vocab_size=256, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    )
    shape = (
        f"{args.n_layer}x{args.n_embd}, {base.num_params() / 1e6:.1f}M params, batch {args.batch}x{args.seq}, "
        f"{device.type}"
    )
    print(f"# streams: {shape}", file=sys.stderr, flush=True)
    deadline = t_start + args.budget_s

    def emit(row: dict) -> None:
        print(json.dumps(row, default=str), flush=True)
        if args.jsonl:
            gpu_rows.add(args.jsonl, row)
    per_config_s = 0.0
    for name in args.configs.split(","):
        kwargs = CONFIGS[name]
        row = {"part": args.part, "kind": "streams", "config": name, "shape": shape, "steps": args.steps}
        if time.monotonic() + 1.3 * per_config_s > deadline:
            emit({**row, "verdict": "not run: --budget-s spent"})
            continue
        t0 = time.monotonic()
        try:
            with sdpa_kernel([SDPBackend.MATH]):
                first = train(base, kwargs, 0, args, device, profile=False)
                pre = train(base, kwargs, 1, args, device, profile=True)
                control = train(base, kwargs, 0, args, device, profile=False)
        except Exception as e:  # noqa: BLE001 - a row, then the next placement
            emit({**row, "verdict": "error", "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"# streams {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        per_config_s = time.monotonic() - t0
        c_loss, c_param, c_diff = _diff(control, first)
        control_exact = c_loss and c_param
        plan_same = first.get("plan") == pre.get("plan") if "plan" in first else None
        expect = device.type == "cpu" or plan_same is not False
        loss_eq, param_eq, worst = _diff(pre, first)
        exact = loss_eq and param_eq
        if exact:
            verdict = "exact"
        elif not control_exact:
            verdict = "differs; so does the control: the kernels are not deterministic here"
        elif not expect:
            verdict = "differs; plans differ, so optimizer kernels differ (not expected exact)"
        else:
            verdict = "DIFFERS: same kernels, different result"
        extra = {k: v for k, v in pre.items() if k not in ("losses", "params", "plan")}
        for prefetch, rl, rp, rd, rv, rx in (
            (1, loss_eq, param_eq, worst, verdict, extra),
            (0, c_loss, c_param, c_diff, "exact" if control_exact else "control differs", {}),
        ):
            out = {**row, "prefetch": prefetch, "compare_to": "prefetch=0 (first run)", "losses_equal": rl,
                   "params_equal": rp, "max_abs_diff": rd, "expect_equal": expect if prefetch else True,
                   "verdict": rv, "plan_same": plan_same if prefetch else None, "seconds": round(per_config_s, 1), **rx}
            emit(out)
        del first, pre, control
    return 0


if __name__ == "__main__":
    sys.exit(main())
