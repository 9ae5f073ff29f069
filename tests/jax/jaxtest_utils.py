"""Helpers of the JAX tests: a torch-trained gpt-tiny and its chunkzero checkpoint.

The checkpoint is written by the torch backend itself when ``torch_backend.checkpoint.sharded.save_checkpoint``
exists: gpt-tiny wrapped in ``ZeroDDP`` on 3 spawned gloo ranks, ``ZeroOptimizer(AdamW)``, trained
:data:`TRAIN_STEPS` steps, saved at world size 3 (every rank writing its own shards). Without it, a
plain torch GPT trained with ``torch.optim.AdamW`` is packed with the layout the torch backend builds
(``named_parameters()`` order, tied alias ``lm_head.weight``) and written by
``jax_backend.save_checkpoint``.

:class:`TorchRun` holds what the tests compare against: the trained parameters, the AdamW state, and
the torch model's logits on :func:`eval_tokens`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chunkzero import ChunkLayout, TensorSpec
from chunkzero.checkpoint import OptimizerMeta

SAVE_WORLD_SIZE = 3
"""World size the fixture checkpoint is saved at (3: chunk sizes not divisible by 2, 4 or 8)."""
CHUNK_SIZE = 30_000
"""Elements per chunk for gpt-tiny (125k parameters -> 6 chunks, several tensors per chunk)."""
TRAIN_STEPS = 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MODEL = "gpt-tiny"
XLA_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
"""Environment of every process the JAX tests spawn."""


def torch_param_specs(model: torch.nn.Module) -> list[TensorSpec]:
    """Specs in ``named_parameters()`` order with the tied head as an alias (what ZeroDDP packs)."""
    tied = {id(p): n for n, p in model.named_parameters(remove_duplicate=False) if n == "lm_head.weight"}
    specs = []
    for name, p in model.named_parameters():
        alias = (tied[id(p)],) if id(p) in tied and tied[id(p)] != name else ()
        specs.append(TensorSpec(name, tuple(p.shape), "float32", alias))
    return specs


def batch(seed: int, b: int = 4, t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte tokens ``(x, y)``, ``int64[b, t]`` each (y is x shifted by one)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (b, t + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def eval_tokens() -> np.ndarray:
    """``int64[2, 48]`` tokens the parity tests evaluate on."""
    return batch(7, b=2, t=48)[0].numpy()


def rel_err(got, ref) -> float:
    """``max|got - ref| / max|ref|``: the normwise relative error used for logits."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def torch_writer_available() -> bool:
    try:
        from torch_backend._testing import run_distributed  # noqa: F401
        from torch_backend.checkpoint.sharded import save_checkpoint  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class TorchRun:
    """A torch training run: its checkpoint and the state the JAX side must reproduce.

    Attributes:
        params: torch-named trained parameters (primary names), float32.
        opt_state: ``{"exp_avg": {name: array}, "exp_avg_sq": {...}}`` after the last step.
        logits: the torch model's logits on :func:`eval_tokens`.
        writer: which function wrote the checkpoint.
    """

    config: object
    root: Path
    step: int
    params: dict[str, np.ndarray]
    opt_state: dict[str, dict[str, np.ndarray]]
    logits: np.ndarray
    writer: str

    @property
    def step_dir(self) -> Path:
        return self.root / str(self.step)

    def torch_model(self):
        """A plain torch GPT holding the trained parameters."""
        from torch_backend.train.gpt import GPT

        model = GPT(self.config)
        missing, _ = model.load_state_dict({k: torch.from_numpy(v) for k, v in self.params.items()}, strict=False)
        assert set(missing) <= {"lm_head.weight"}, missing
        return model

    def torch_optimizer(self, model):
        """``torch.optim.AdamW`` over ``model`` holding the run's state (step = :attr:`step`)."""
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
        names = [n for n, _ in model.named_parameters()]
        state = {
            i: {
                "step": torch.tensor(float(self.step)),
                "exp_avg": torch.from_numpy(self.opt_state["exp_avg"][n].copy()),
                "exp_avg_sq": torch.from_numpy(self.opt_state["exp_avg_sq"][n].copy()),
            }
            for i, n in enumerate(names)
        }
        opt.load_state_dict(
            {"state": state, "param_groups": [{**opt.param_groups[0], "params": list(range(len(names)))}]}
        )
        return opt


# ------------------------------------------------------------------ writer 1: the torch backend (3 gloo ranks)
def _zero_train_and_save(rank: int, world_size: int, root: str, tokens: np.ndarray):
    """On each spawned rank: ZeroDDP gpt-tiny, TRAIN_STEPS AdamW steps, torch_backend.save_checkpoint."""
    import torch.nn.functional as F

    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.checkpoint.sharded import save_checkpoint
    from torch_backend.train.gpt import GPT, GPT_CONFIGS

    torch.manual_seed(0)
    model = ZeroDDP(GPT(GPT_CONFIGS[MODEL]), chunk_size=CHUNK_SIZE)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **HYPER)
    for i in range(TRAIN_STEPS):
        x, y = batch(100 + 10 * i + rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
    save_checkpoint(root, model, optim, step=TRAIN_STEPS)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).numpy()
    params = {k: v.numpy().copy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state = optim.state_dict()["state"]
    opt = {key: {n: s[key].numpy().copy() for n, s in state.items()} for key in ("exp_avg", "exp_avg_sq")}
    return (logits, params, opt) if rank == 0 else None


def write_with_torch_backend(root: Path, tokens: np.ndarray):
    from torch_backend._testing import run_distributed

    env = {**XLA_ENV, "CHUNKZERO_TEST_THREADS": "1"}
    logits, params, opt = run_distributed(
        _zero_train_and_save, SAVE_WORLD_SIZE, str(root), tokens, env=env, timeout=600
    )[0]
    return logits, params, opt


# ------------------------------------------------------------------ writer 2: jax_backend.save_checkpoint
def train_torch(cfg, steps: int = TRAIN_STEPS, seed: int = 0):
    """A plain torch GPT after ``steps`` AdamW steps on random bytes, and its optimizer."""
    from torch_backend.train.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for i in range(steps):
        x, y = batch(100 + i)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def torch_optimizer_meta(opt: torch.optim.Optimizer, steps: int) -> OptimizerMeta:
    hp = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    hp = {k: list(v) if isinstance(v, tuple) else v for k, v in hp.items()}
    return OptimizerMeta("torch.optim.AdamW", hp, ["exp_avg", "exp_avg_sq"], steps)


def write_with_jax_backend(root: Path, tokens: np.ndarray):
    import jax_backend as jb
    from torch_backend.train.gpt import GPT_CONFIGS

    model, opt = train_torch(GPT_CONFIGS[MODEL])
    layout = ChunkLayout.build(torch_param_specs(model), CHUNK_SIZE, SAVE_WORLD_SIZE)
    names = dict(model.named_parameters())
    params = {n: p.detach().numpy().copy() for n, p in names.items()}
    state = {key: {n: opt.state[p][key].numpy().copy() for n, p in names.items()} for key in ("exp_avg", "exp_avg_sq")}
    jb.save_checkpoint(
        root, jb.flatten(params, layout), layout, step=TRAIN_STEPS,
        opt_state_chunks=jb.flatten_optimizer(state, layout),
        optimizer_meta=torch_optimizer_meta(opt, TRAIN_STEPS), model_config=model.config.to_dict(),
    )
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(tokens)).numpy()
    return logits, params, state


def make_torch_run(base: Path, writer: str | None = None) -> TorchRun:
    """Write the fixture checkpoint under ``base`` (or reuse one already written there)."""
    from torch_backend.train.gpt import GPT_CONFIGS

    writer = writer or ("torch_backend.save_checkpoint" if torch_writer_available() else "jax_backend.save_checkpoint")
    root, saved = base / "ckpt", base / "expected.npz"
    if not saved.exists():
        tokens = eval_tokens()
        if writer == "torch_backend.save_checkpoint":
            logits, params, opt = write_with_torch_backend(root, tokens)
        else:
            logits, params, opt = write_with_jax_backend(root, tokens)
        arrays = {"logits": logits, **{f"p/{k}": v for k, v in params.items()}}
        arrays |= {f"o/{key}/{k}": v for key, d in opt.items() for k, v in d.items()}
        np.savez(base / "expected.tmp.npz", **arrays)
        (base / "writer.json").write_text(json.dumps({"writer": writer}))
        os.replace(base / "expected.tmp.npz", saved)
    data = np.load(saved, allow_pickle=False)
    params = {k[2:]: data[k] for k in data.files if k.startswith("p/")}
    opt: dict[str, dict[str, np.ndarray]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for k in data.files:
        if k.startswith("o/"):
            _, key, name = k.split("/", 2)
            opt[key][name] = data[k]
    writer = json.loads((base / "writer.json").read_text())["writer"]
    return TorchRun(GPT_CONFIGS[MODEL], root, TRAIN_STEPS, params, opt, data["logits"], writer)
