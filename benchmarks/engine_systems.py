"""The systems ``benchmarks/bench_engine.py`` compares, as they run inside one rank process.

- :class:`System` builds one system on one rank (``floor``, ``exchanges``, ``ddp``, ``fsdp2``, ``zero``,
  ``autocast``; see ``bench_engine.py`` for what each is) over the same model and per-rank batch, and
  runs a timed training step;
- :class:`MasterWeights` gives the floor and DDP in bf16 the fp32 masters ZeroDDP and FSDP2 keep;
- :class:`EngineProfile` (``--profile``) times ZeroDDP's engine functions, and :func:`oracle_votes`
  (``zero:oracle_votes=1``) replaces its vote all-reduce by the rank's own votes (diagnosis only).
"""

from __future__ import annotations

import functools
import json
import time

NAMES = {"floor": "floor (no communication)", "exchanges": "floor + exchanges alone", "ddp": "DDP",
         "fsdp2": "FSDP2 (fully_shard per block)", "zero": "ZeroDDP", "autocast": "torch autocast + fused AdamW"}
ADAMW_KERNELS = {"default": {}, "loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True},
                 "fused": {"fused": True}}
"""``--adamw``: torch AdamW's kernel for every system (``default``: torch's choice, the for-loop on CPU)."""
BYTES_PER_PARAM_ZERO = 16  # mixed-precision Adam (ZeRO paper, Rajbhandari et al. 2020): 2 + 2 + 12


def parse_system(spec: str) -> tuple[str, dict]:
    """``"zero:prefetch=0:offload_optim_frac=0.5"`` -> ``("zero", {"prefetch": 0, ...})``."""
    name, *opts = spec.split(":")
    if name not in NAMES:
        raise SystemExit(f"unknown system {name!r}; known: {', '.join(NAMES)}")
    kwargs = {}
    for o in opts:
        k, _, v = o.partition("=")
        kwargs[k] = json.loads(v) if v not in ("", None) else True
    return name, kwargs


def label(spec: str) -> str:
    name, kwargs = parse_system(spec)
    return NAMES[name] + (" " + " ".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "")


def build_module(cfg: dict, device):
    """The benchmark GPT: HF GPT-2 (``--model hf-gpt2``) or the byte-level GPT of ``torch_backend.train.gpt``."""
    import torch

    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: no host copy of a large model
        return _new_module(cfg)


def _new_module(cfg: dict):
    if cfg["model"] == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        hf = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["n_embd"], n_layer=cfg["n_layer"],
                        n_head=cfg["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(hf)  # transformers' default attention: sdpa
    from torch_backend.train.gpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=cfg["seq"], vocab_size=cfg["vocab"], n_layer=cfg["n_layer"],
                         n_head=cfg["n_head"], n_embd=cfg["n_embd"]))


def blocks_of(module):
    return module.transformer.h


def logits_of(out):
    return getattr(out, "logits", out)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (DTensors by their local shard), each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


class MasterWeights:
    """fp32 master copies of a bf16 module's parameters and the AdamW over them (floor, DDP in bf16)."""

    def __init__(self, params, optimizer_cls, **kw):
        import torch

        self.params = list(params)
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = optimizer_cls(self.masters, **kw)

    def step(self):
        import torch

        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad = None

    def state_tensors(self):
        yield from self.masters
        yield from (m.grad for m in self.masters)
        for st in self.optimizer.state.values():
            yield from (v for v in st.values() if hasattr(v, "numel") and v.dim() > 0)


def oracle_votes(world: int) -> None:
    """Diagnosis only (system option ``oracle_votes=1``): replace ZeroDDP's blocking vote all-reduce
    by this rank's own votes × W — what the sum is when every rank votes alike, as here (same model,
    same shapes, same order). The step time without the cost of agreeing; wrong if ranks diverge."""
    from torch_backend.zero import collectives

    def agree(votes, group, *, async_op=False):
        votes.mul_(world)
        return collectives.Pending()

    collectives.agree = agree


class System:
    """One system on one rank: ``step()`` runs a timed training step."""

    def __init__(self, spec: str, precision: str, cfg: dict, rank: int, world: int, device):
        import torch
        import torch.distributed as dist

        self.name, kwargs = parse_system(spec)
        self.device, self.cfg = device, cfg
        bf16 = precision == "bf16"
        module = build_module(cfg, device)
        self.n_params = sum(p.numel() for p in module.parameters())
        self.autocast = None
        self.zero = None
        self.exchanges: list = []
        adamw = torch.optim.AdamW
        lr = dict(lr=1e-4, **ADAMW_KERNELS[cfg["adamw"]])
        if self.name == "zero":
            from torch_backend import ZeroDDP, ZeroOptimizer

            if kwargs.pop("oracle_votes", False):
                oracle_votes(world)

            self.model = self.zero = ZeroDDP(module, mixed_precision=precision, **kwargs)
            self.optim = ZeroOptimizer(self.zero, adamw, **lr)
        elif self.name == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (world,))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
            for block in blocks_of(module):
                fully_shard(block, mesh=mesh, mp_policy=mp, **kwargs)
            fully_shard(module, mesh=mesh, mp_policy=mp, **kwargs)
            self.model, self.optim = module, adamw(module.parameters(), **lr)
        elif self.name == "autocast":
            self.autocast = torch.autocast(device.type, dtype=torch.bfloat16)
            self.model, self.optim = module, adamw(module.parameters(), **{**lr, **ADAMW_KERNELS["fused"]})
        else:  # floor, exchanges, ddp
            if self.name == "exchanges":  # the floor, plus `count` all-to-alls of `numel` elements a step
                numel = -(-int(kwargs.pop("numel")) // world) * world
                self.exchanges = [(torch.randn(numel, device=device), torch.empty(numel, device=device))
                                  for _ in range(int(kwargs.pop("count")))]
            if bf16:
                module = module.to(torch.bfloat16)
            self.model = module
            if self.name == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                ids = [device.index] if device.type == "cuda" else None
                self.model = DistributedDataParallel(module, gradient_as_bucket_view=True, device_ids=ids, **kwargs)
            self.optim = MasterWeights(module.parameters(), adamw, **lr) if bf16 else adamw(module.parameters(), **lr)
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g).to(device)
        self.inp, self.tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        self.dist = dist
        self.state_bytes = 0

    def _sync(self):
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def step(self, measure_state: bool = False) -> list[float]:
        """One training step; returns ``[total, forward, backward, optimizer]`` seconds."""
        import torch.nn.functional as F

        self.dist.barrier()
        self._sync()
        t0 = time.perf_counter()
        # `exchanges`: issued at the start, waited for at the end: the most overlap any engine could have
        exchanged = [self.dist.all_to_all_single(out, x, async_op=True) for x, out in self.exchanges]
        if self.autocast is not None:
            with self.autocast:
                logits = logits_of(self.model(self.inp))
        else:
            logits = logits_of(self.model(self.inp))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), self.tgt.reshape(-1))
        self._sync()
        t1 = time.perf_counter()
        if self.zero is not None:
            self.optim.backward(loss)
        else:
            loss.backward()
        self._sync()
        t2 = time.perf_counter()
        self.optim.step()
        if measure_state:
            self.state_bytes = self.model_state_bytes()
        self.optim.zero_grad()
        for work in exchanged:
            work.wait()
        self._sync()
        t3 = time.perf_counter()
        del logits, loss
        return [t3 - t0, t1 - t0, t2 - t1, t3 - t2]

    def model_state_bytes(self) -> int:
        if self.zero is not None:
            return self.optim.memory_report().model_state_bytes()
        params = list(self.model.parameters())
        tensors = params + [p.grad for p in params]
        opt = self.optim
        if isinstance(opt, MasterWeights):
            tensors += list(opt.state_tensors())
        else:
            for st in opt.state.values():
                tensors += [v for v in st.values() if hasattr(v, "numel") and v.dim() > 0]
        return tensor_bytes(tensors)

    def zero_stats(self) -> dict | None:
        if self.zero is None:
            return None
        s = dict(self.zero.collective_stats)
        s.update(chunks=len(self.zero.chunks), chunk_size=self.zero.layout.chunk_size,
                 chunk_bytes=max(c.size for c in self.zero.chunks) * self.zero.chunks[0].buffer.element_size(),
                 prefetch=self.zero.prefetch)
        return s


def _timed_call(fn, acc: list):
    """``fn`` that adds its wall seconds to ``acc[0]`` and counts its calls in ``acc[1]``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t0
            acc[1] += 1

    return wrapper


class EngineProfile:
    """``--profile``: wall seconds and calls inside ZeroDDP's engine functions (inclusive), per rank.

    ``vote_rounds`` = ``collectives.agree`` (the blocking vote all-reduce of every round);
    ``gather_issue`` / ``gather_wait`` = ``Chunk.begin_gather`` / ``finish_gather`` (with
    ``prefetch=0`` the whole blocking all-gather is in the issue); ``reduce_issue`` / ``reduce_wait``
    likewise for gradient reductions; ``grad_hooks`` = the post-accumulate-grad hook (copy into the
    chunk's gradient buffer, and any reduction it triggers); ``finalize`` = the end-of-backward callback;
    ``torch_function`` = the access mode's ``__torch_function__`` minus the torch op it runs: the mode's
    own cost per intercepted call, with the engine work it triggers (rounds, gathers) included; its
    call of ``Tensor.backward`` is left out.
    """

    def __init__(self):
        from torch_backend.zero import access_mode, chunk_gradient, chunks, collectives, runtime

        self.totals: dict[str, list[float]] = {}
        targets = {
            "vote_rounds": (collectives, "agree"),
            "gather_issue": (chunks.Chunk, "begin_gather"),
            "gather_wait": (chunks.Chunk, "finish_gather"),
            "reduce_issue": (chunk_gradient.ChunkGradient, "begin_reduce"),
            "reduce_wait": (chunk_gradient.ChunkGradient, "finish_reduces"),
            "grad_hooks": (runtime.ChunkRuntime, "_on_grad"),
            "finalize": (runtime.ChunkRuntime, "_finalize_backward"),
        }
        for key, (owner, attr) in targets.items():
            setattr(owner, attr, self._timed(key, getattr(owner, attr)))
        mode = access_mode.ParamAccessMode
        mode.__torch_function__ = self._self_timed(mode.__torch_function__)

    def _self_timed(self, handler):
        """``handler``'s time minus that of the op it calls (timed by a stand-in that keeps the
        attributes the mode reads: ``__name__`` and, for property reads, ``__self__``)."""
        acc = self.totals.setdefault("torch_function", [0.0, 0])

        def wrapper(mode, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) == "backward":
                return handler(mode, func, types, args, kwargs)
            inner = [0.0, 0]
            op = _timed_call(func, inner)
            if hasattr(func, "__self__"):
                op.__self__ = func.__self__
            t0 = time.perf_counter()
            try:
                return handler(mode, op, types, args, kwargs)
            finally:
                acc[0] += time.perf_counter() - t0 - inner[0]
                acc[1] += 1

        return wrapper

    def _timed(self, key, fn):
        return _timed_call(fn, self.totals.setdefault(key, [0.0, 0]))

    def reset(self) -> None:
        for acc in self.totals.values():
            acc[0], acc[1] = 0.0, 0
