"""JAX parity: logits of the Flax GPT restored from a torch-trained chunkzero checkpoint vs the torch GPT.

For each model: train the torch GPT ``--steps`` AdamW steps on random bytes under ``ZeroDDP`` on
``--world`` (default 3) gloo ranks and save it with ``torch_backend.save_checkpoint`` (each rank writes
its shards); the torch reference logits are the ZeroDDP model's own on the evaluation tokens. (Without
``torch_backend.save_checkpoint``: a plain torch GPT and ``jax_backend.save_checkpoint`` with the same
layout.) Then ``jax_backend.restore_gpt`` on 1, 3, 4 and 8 simulated CPU devices and compare the logits
on the same tokens, fp32.

Prints a markdown table: max |Δ| / max |torch logits| (normwise relative error) and max |Δ|.

    .venv/bin/python benchmarks/bench_jax_parity.py [--models gpt-tiny gpt-small] [--devices 1 3 4 8]
"""

from __future__ import annotations

import os

XLA_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
for _k, _v in XLA_ENV.items():  # before jax is imported, here and in every spawned rank
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def batch(seed: int, b: int = 4, t: int = 64):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (b, t + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def chunk_size_for(name: str) -> int:
    import jax_backend as jb

    specs = jb.param_specs(jb.gpt_config(name))
    return 2 * max(s.numel for s in specs) // 3  # several tensors per chunk, the largest alone


def _zero_rank(rank: int, world: int, name: str, root: str, steps: int, tokens: np.ndarray):
    """One gloo rank: ZeroDDP + ZeroOptimizer(AdamW), ``steps`` steps, save; rank 0 returns logits."""
    import torch.nn.functional as F

    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.checkpoint.sharded import save_checkpoint
    from torch_backend.train.gpt import GPT, GPT_CONFIGS

    torch.manual_seed(0)
    model = ZeroDDP(GPT(GPT_CONFIGS[name]), chunk_size=chunk_size_for(name))
    optim = ZeroOptimizer(model, torch.optim.AdamW, **HYPER)
    for i in range(steps):
        x, y = batch(100 * i + rank)
        optim.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        optim.step()
        optim.zero_grad()
    save_checkpoint(root, model, optim, step=steps)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).numpy()
    return logits if rank == 0 else None


def torch_written(name: str, root: Path, steps: int, world: int, tokens: np.ndarray) -> np.ndarray:
    from torch_backend._testing import run_distributed

    return run_distributed(_zero_rank, world, name, str(root), steps, tokens, env=XLA_ENV, timeout=3600)[0]


def jax_written(name: str, root: Path, steps: int, world: int, tokens: np.ndarray) -> np.ndarray:
    import jax_backend as jb
    from chunkzero import ChunkLayout
    from chunkzero.checkpoint import OptimizerMeta
    from torch_backend.train.gpt import GPT, GPT_CONFIGS

    torch.manual_seed(0)
    model = GPT(GPT_CONFIGS[name])
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for i in range(steps):
        x, y = batch(100 * i)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    layout = ChunkLayout.build(jb.param_specs(model.config), chunk_size_for(name), world)
    names = dict(model.named_parameters())
    params = {n: p.detach().numpy() for n, p in names.items()}
    state = {k: {n: opt.state[p][k].numpy() for n, p in names.items()} for k in ("exp_avg", "exp_avg_sq")}
    hp = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.param_groups[0].items() if k != "params"}
    jb.save_checkpoint(root, jb.flatten(params, layout), layout, step=steps,
                       opt_state_chunks=jb.flatten_optimizer(state, layout),
                       optimizer_meta=OptimizerMeta("torch.optim.AdamW", hp, ["exp_avg", "exp_avg_sq"], steps),
                       model_config=model.config.to_dict())
    with torch.no_grad():
        return model.eval()(torch.from_numpy(tokens)).numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-tiny", "gpt-small"])
    ap.add_argument("--devices", nargs="+", type=int, default=[1, 3, 4, 8])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--world", type=int, default=3, help="torch world size the checkpoint is saved at")
    args = ap.parse_args()

    import jax.numpy as jnp

    import jax_backend as jb

    try:
        from torch_backend.checkpoint.sharded import save_checkpoint  # noqa: F401

        writer, write = "torch_backend.save_checkpoint (ZeroDDP)", torch_written
    except ImportError:
        writer, write = "jax_backend.save_checkpoint (plain torch GPT)", jax_written
    rows = []
    for name in args.models:
        tokens = batch(7, b=4, t=min(jb.gpt_config(name).block_size, 128))[0].numpy()
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "ckpt"
            ref = write(name, root, args.steps, args.world, tokens).astype(np.float64)
            for n in args.devices:
                model, _ = jb.restore_gpt(root, jb.make_mesh(n))
                out = np.asarray(jb.logits(model, jnp.asarray(tokens)), np.float64)
                diff = float(np.abs(out - ref).max())
                rows.append((name, n, diff / float(np.abs(ref).max()), diff))
    print(
        f"checkpoint: {writer}, world size {args.world}, {args.steps} AdamW steps; tokens "
        f"{tokens.shape[0]}×{tokens.shape[1]}"
    )
    print()
    print("| model | devices | max rel. logit error | max abs. logit error |")
    print("|---|---:|---:|---:|")
    for name, n, rel, ab in rows:
        print(f"| {name} | {n} | {rel:.2e} | {ab:.2e} |")


if __name__ == "__main__":
    main()
