"""ZeroOptimizer.step(): one inner-optimizer parameter per tensor piece (param groups, per-tensor
skipping) against one parameter per chunk (the design before param groups), same model, one process.

For each model the gradients are computed once; then each variant runs ``--steps`` AdamW steps on them,
interleaved ``--repeats`` times (min / median / max milliseconds per step):

- **per-chunk**: ``torch.optim.AdamW`` over the chunks' fp32 master shards (``c.master``, grads set),
  plus the chunk refresh — the optimizer work of the old one-parameter-per-chunk step;
- **pieces**: ``ZeroOptimizer.step()`` with two param groups (nanoGPT's), the whole step (norm,
  grads of the pieces, inner step, state adoption, refresh);
- each with torch's default kernel choice (``foreach=None``: a per-tensor loop on CPU, foreach on
  CUDA) and with ``foreach=True``.

Models: the tests' HF GPT-2 (2 layers, 16 wide, chunks of 1500 elements) and a ~20M-parameter GPT
(6 layers, 512 wide, chunks searched).

    .venv/bin/python benchmarks/bench_optim_step.py [--steps 5] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "torch"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def models(device):
    import zero_cases

    from torch_backend.train.gpt import GPT, GPTConfig

    def tiny():
        m = zero_cases.tiny_gpt2().to(device)
        return m, lambda mod: mod(input_ids=x_tiny, labels=x_tiny).loss, 1500

    def gpt20m():
        torch.manual_seed(0)
        m = GPT(GPTConfig(block_size=128, vocab_size=256, n_layer=6, n_head=8, n_embd=512, dropout=0.0)).to(device)
        x = torch.randint(0, 256, (2, 128), device=device)
        return m, lambda mod: F.cross_entropy(mod(x).float().flatten(0, 1), x.flatten()), None

    x_tiny = torch.randint(0, 64, (2, 8), device=device)
    return {"gpt2-tests": tiny, "gpt-20M": gpt20m}


def groups_of(module):
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def timed(fn, steps: int, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    from torch_backend import ZeroDDP, ZeroOptimizer

    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}; ms per step, min / median / max of {args.repeats} interleaved repeats")
    print("| model | params | chunks | pieces | variant | foreach=None | foreach=True |")
    print("|---|---|---|---|---|---|---|")
    for name, make in models(device).items():
        module, loss_fn, chunk_size = make()
        model = ZeroDDP(module, chunk_size=chunk_size)
        variants = {}
        for foreach in (None, True):
            optim = ZeroOptimizer(model, torch.optim.AdamW, param_groups=groups_of(module), lr=1e-4, foreach=foreach)
            masters = [c.master for c in model.chunks if c.requires_grad]
            inner = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1, foreach=foreach)

            def per_chunk(inner=inner, model=model):
                inner.step()
                for c in model.chunks:
                    c.refresh_from_master()

            variants[("per-chunk", foreach)] = per_chunk
            variants[("pieces", foreach)] = optim.step
        optim.backward(loss_fn(model))
        model.finish_gradients()
        for fn in variants.values():
            fn()  # state allocated outside the timing
        times = {k: [] for k in variants}
        for _ in range(args.repeats):
            for k, fn in variants.items():
                times[k].append(timed(fn, args.steps, device))
        n_params = sum(t.numel for t in model.layout.tensors)
        n_pieces = sum(len(model.layout.shard_pieces(c.index, 0)) for c in model.layout.chunks if c.requires_grad)

        def cell(k, times=times):
            v = sorted(times[k])
            return f"{v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}"

        for variant in ("per-chunk", "pieces"):
            print(f"| {name} | {n_params / 1e6:.2f}M | {len(model.layout.chunks)} | {n_pieces} | {variant} | "
                  f"{cell((variant, None))} | {cell((variant, True))} |")


if __name__ == "__main__":
    main()
