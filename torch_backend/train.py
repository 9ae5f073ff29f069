"""``chunkzero train``: the training loop, plain and visible (nanoGPT's ``train.py`` style).

One function per stage, run by every worker (rank) of a data-parallel group:

    init_distributed → load_corpus → build_module → Engine (ZeroDDP + ZeroOptimizer)
    → evaluate (step 0) → for each step: lr schedule, grad-accum micro-batches, optimizer step,
      metrics, [checkpoint hook], periodic evaluate → sample text → summary (rank 0)

Entry points: :func:`validate` (the launcher's checks of every user input, before any worker starts),
:func:`worker_main` (what each worker runs, directly under ``torchrun`` or spawned by
:mod:`torch_backend.launch`).

Outputs (rank 0, all in ``--out``): ``config.json`` (the resolved run), ``metrics.jsonl`` (one JSON line
per step ``{"kind": "train", "step", "loss", "lr", "loss_scale", "tokens", "tokens_per_s", "time_s"}``
and per evaluation ``{"kind": "val", "step", "val_loss"}``), ``train.log``, ``loss.png``,
``sample.txt``, ``summary.json`` and ``summary.txt``. Every rank writes ``pids/rank<r>.pid``.

Determinism: the model is initialised from ``torch.manual_seed(seed)`` (the same on every rank), the
data stream is a pure function of ``(seed, world size, batch size, step)`` (:mod:`torch_backend.data`),
and each rank's torch RNG is re-seeded with ``seed + 1 + rank`` for dropout, so the same seed and world
size give the same loss sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from chunkzero.errors import ChunkZeroError, ConfigError, DataError

from . import data as data_mod
from .gpt import GPT, GPT_CONFIGS, generate

log = logging.getLogger("chunkzero.train")

PRECISIONS = ("fp32", "bf16", "fp16")
ENGINES = ("zero", "ddp")
DEVICES = ("auto", "cpu", "cuda")

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_PEER_LOST = 3
"""A worker exits with this when a collective failed because another worker vanished (a consequence)."""

PEER_LOST_GRACE_S = 3.0
"""How long a worker that lost a peer waits before exiting (the agent polls every 0.5 s)."""

RUN_MARKERS = ("metrics.jsonl", "config.json", "summary.json", "checkpoints")
"""Entries whose presence in ``--out`` means it holds another run (refused unless ``--overwrite``)."""

RUN_OUTPUTS = RUN_MARKERS + ("summary.txt", "loss.png", "sample.txt", "train.log", "pids")
"""Everything a run writes in ``--out``; ``--overwrite`` removes exactly these first."""


# ============================================================================================ config

@dataclass
class TrainConfig:
    """Every setting of a run. The defaults are ``chunkzero train``'s (the CLI keeps the same ones).

    Units: ``batch_size`` is sequences per rank per micro-batch; ``seq_len`` tokens; one step is
    ``grad_accum`` micro-batches on every rank, i.e. ``world_size · grad_accum · batch_size · seq_len``
    tokens; ``timeout_s`` is the collective timeout in seconds.
    """

    data: list[str] | None = None
    model: str = "gpt-tiny"
    nproc: int | None = None
    device: str = "auto"
    engine: str = "zero"
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    max_norm: float = 1.0
    mixed_precision: str = "fp32"
    chunk_size: int | None = None
    out: str | None = None
    overwrite: bool = False
    seed: int = 1337
    eval_interval: int = 100
    eval_batches: int = 8
    val_fraction: float = 0.05
    prompt: str = "def "
    sample_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 40
    timeout_s: float = 45.0
    save_interval: int = 0  # steps between checkpoints in <out>/checkpoints (0: none); the last step too
    resume: bool = False  # continue the run in --out from its latest checkpoint
    # Filled by :func:`validate`; a worker that finds ``validated`` set skips the checks.
    validated: bool = False
    world_size: int | None = None
    model_kind: str | None = None
    block_size: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine decay to
    ``lr · min_lr_ratio`` at the last step (nanoGPT's ``get_lr``)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / (cfg.warmup + 1)
    min_lr = cfg.lr * cfg.min_lr_ratio
    span = max(1, cfg.steps - 1 - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


# ============================================================================================ models

def is_hf_dir(model: str) -> bool:
    return Path(model).is_dir()


def hf_config(model_dir: str):
    """The Hugging Face config of a local model directory (offline).

    Raises:
        ConfigError: no config.json, or transformers cannot read it.
    """
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"--model directory {model_dir} has no config.json (not a Hugging Face model directory)")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many kinds
        raise ConfigError(f"--model {model_dir}: cannot read its config.json: {str(e).splitlines()[0]}") from None


def hf_has_tokenizer(model_dir: str) -> bool:
    return any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer.model"))


def model_block_size(model: str) -> tuple[str, int, int]:
    """``(kind, block_size, vocab_size)`` of ``--model``; kind is ``"gpt"`` or ``"hf"``.

    Raises:
        ConfigError: an unknown name (listing the known ones) or an unreadable directory.
    """
    if is_hf_dir(model):
        c = hf_config(model)
        block = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None) or 1 << 30
        return "hf", int(block), int(c.vocab_size)
    if model in GPT_CONFIGS:
        c = GPT_CONFIGS[model]
        return "gpt", c.block_size, c.vocab_size
    if os.sep in model or "/" in model or model.startswith("."):
        raise ConfigError(f"--model directory {model} does not exist")
    raise ConfigError(f"unknown model {model!r}; known: {', '.join(GPT_CONFIGS)}, "
                      "or a local Hugging Face model directory (config.json + safetensors)")


def build_module(cfg: TrainConfig) -> nn.Module:
    """The model to train, on CPU in fp32, initialised from ``torch.manual_seed(cfg.seed)``."""
    torch.manual_seed(cfg.seed)
    if cfg.model_kind == "hf":
        from transformers import AutoModelForCausalLM

        try:
            module = AutoModelForCausalLM.from_pretrained(cfg.model, local_files_only=True)
        except Exception as e:
            raise ConfigError(f"--model {cfg.model}: cannot load the model: {str(e).splitlines()[0]}") from None
        return module.float()  # fp32 master values whatever the stored dtype; ZeroDDP casts for compute
    return GPT(GPT_CONFIGS[cfg.model])


def logits_of(output) -> torch.Tensor:
    """Logits ``[B, T, V]`` from a model's output (a tensor, or a Hugging Face ``ModelOutput``)."""
    return getattr(output, "logits", output)


def make_tokenizer(cfg: TrainConfig, vocab_size: int):
    """Bytes for the byte-level GPTs; the model's own tokenizer for a Hugging Face directory that has one.

    Raises:
        ConfigError: a Hugging Face model without a tokenizer whose vocabulary is smaller than 256.
    """
    if cfg.model_kind == "hf" and hf_has_tokenizer(cfg.model):
        return data_mod.HFTokenizer(cfg.model)
    if vocab_size < 256:
        raise ConfigError(f"--model {cfg.model} has no tokenizer and a vocabulary of {vocab_size} < 256, "
                          "so it cannot read byte tokens; give a tokenizer or a .bin token file")
    return data_mod.ByteTokenizer()


# ============================================================================================ devices

def available_cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def max_cpu_workers() -> int:
    """CPU workers allowed: one per available core, but at least 2 (the default run's two)."""
    return max(2, available_cpu_cores())


def resolve_device(device: str) -> str:
    """``"cuda"`` or ``"cpu"``.

    Raises:
        ConfigError: ``--device cuda`` without a CUDA device.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible")
    return device


_FORCE_UNSUPPORTED_ENV = "CHUNKZERO_TEST_UNSUPPORTED_PRECISION"
"""Test hook: a comma list of precisions the precision probe must report unsupported."""


def check_precision(precision: str, device: str) -> None:
    """Refuse a mixed precision this device cannot train in. On CPU a small GPT-like forward and
    backward (linear, layer norm, causal attention, cross-entropy) in that dtype must run (it does with
    torch 2.13 on x86, fp16 included); on a GPU, bf16 needs compute capability 8.0 (Ampere) or newer.

    Raises:
        ConfigError: naming the precision, the device and the reason.
    """
    if precision == "fp32":
        return
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    forced = {p.strip() for p in os.environ.get(_FORCE_UNSUPPORTED_ENV, "").split(",") if p.strip()}
    reason = None
    if precision in forced:
        reason = f"{dtype} kernels unavailable (forced by {_FORCE_UNSUPPORTED_ENV})"
    elif device == "cuda":
        # No kernel probe on a GPU: the launcher must not hold a CUDA context while its workers run.
        major, minor = torch.cuda.get_device_capability(0)
        if precision == "bf16" and major < 8:
            reason = f"bfloat16 needs a GPU of compute capability 8.0 or newer, this one is {major}.{minor}"
    else:
        try:
            dev = torch.device("cpu")
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(2, 4, 8, generator=g).to(dev, dtype).requires_grad_()
            lin = nn.Linear(8, 8).to(dev, dtype)
            ln = nn.LayerNorm(8).to(dev, dtype)
            h = ln(lin(x)).view(2, 4, 2, 4).transpose(1, 2)
            y = F.scaled_dot_product_attention(h, h, h, is_causal=True).transpose(1, 2).reshape(8, 8)
            loss = F.cross_entropy(y.float(), torch.zeros(8, dtype=torch.long, device=dev))
            loss.backward()
        except Exception as e:  # the kernels raise RuntimeError/NotImplementedError
            reason = str(e).splitlines()[0]
    if reason:
        raise ConfigError(f"--mixed-precision {precision} cannot run on {device}: {reason}")


# ============================================================================================ validation

def _fresh_run_dir(root: Path) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = root / stamp, 2
    while out.exists():
        out, n = root / f"{stamp}-{n}", n + 1
    return out


def check_out_dir(cfg: TrainConfig) -> None:
    """``--out`` must be a directory (or absent) not holding another run, unless ``--overwrite``.

    Checkpoint resumption hooks in here: a ``--resume`` run requires ``out`` to hold a run instead.

    Raises:
        ConfigError: ``out`` is a file, or holds another run.
    """
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if cfg.resume:
        from .checkpoint import latest_step

        if cfg.overwrite:
            raise ConfigError("--resume continues the run in --out; it cannot be combined with --overwrite")
        if latest_step(out / CHECKPOINT_DIR) is None:
            raise ConfigError(f"--resume: --out {out} holds no checkpoint ({CHECKPOINT_DIR}/<step>); "
                              "train with --save-interval to write some")
        return
    if out.is_dir() and not cfg.overwrite:
        held = [m for m in RUN_MARKERS if (out / m).exists()]
        if held:
            raise ConfigError(f"--out {out} holds another run ({held[0]}); choose another --out or pass --overwrite")


def validate(cfg: TrainConfig, *, check_out: bool = True) -> tuple[TrainConfig, data_mod.Corpus]:
    """Check every user input before any worker starts; return the resolved config and the corpus.

    Resolves ``device``, ``nproc``/``world_size`` (from the environment under ``torchrun``), ``out``
    (``runs/<timestamp>`` by default), ``model_kind`` and ``block_size``.

    Raises:
        ConfigError / DataError: one line naming the input at fault.
    """
    cfg = dataclasses.replace(cfg)
    if cfg.engine not in ENGINES:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {cfg.engine!r}")
    if cfg.mixed_precision not in PRECISIONS:
        raise ConfigError(f"--mixed-precision must be one of {', '.join(PRECISIONS)}, got {cfg.mixed_precision!r}")
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_batches"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.warmup < 0 or cfg.sample_tokens < 0:
        raise ConfigError("--warmup and --sample-tokens must be >= 0")
    if not cfg.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.chunk_size is not None and cfg.chunk_size < 1:
        raise ConfigError(f"--chunk-size must be >= 1 (elements), got {cfg.chunk_size}")
    if cfg.timeout_s <= 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {cfg.timeout_s}")
    if cfg.engine == "ddp" and cfg.mixed_precision != "fp32":
        raise ConfigError("--engine ddp (the plain-PyTorch baseline) trains in fp32 only")
    if cfg.save_interval < 0:
        raise ConfigError(f"--save-interval must be >= 0 steps (0: no checkpoints), got {cfg.save_interval}")
    if cfg.engine == "ddp" and (cfg.save_interval or cfg.resume):
        raise ConfigError("--save-interval and --resume need --engine zero (chunk checkpoints of ZeroDDP)")

    cfg.device = resolve_device(cfg.device)
    if "WORLD_SIZE" in os.environ:  # under torchrun: the world is given
        cfg.world_size = int(os.environ["WORLD_SIZE"])
        if cfg.nproc is not None and int(os.environ.get("RANK", 0)) == 0:
            log.warning("--nproc %d ignored: running under torchrun with world size %d", cfg.nproc, cfg.world_size)
    else:
        limit = torch.cuda.device_count() if cfg.device == "cuda" else max_cpu_workers()
        nproc = cfg.nproc if cfg.nproc is not None else (limit if cfg.device == "cuda" else 2)
        if nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {nproc}")
        if nproc > limit:
            what = (f"{limit} CUDA device(s) visible" if cfg.device == "cuda"
                    else f"at most {limit} CPU workers allowed (one per available core, at least 2)")
            raise ConfigError(f"--nproc {nproc} is more than this machine allows: {what}")
        cfg.nproc = cfg.world_size = nproc

    cfg.model_kind, cfg.block_size, vocab = model_block_size(cfg.model)
    if cfg.seq_len > cfg.block_size:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the block size {cfg.block_size} of model {cfg.model}")
    check_precision(cfg.mixed_precision, cfg.device)

    if check_out:
        if cfg.out is None:
            cfg.out = str(_fresh_run_dir(Path("runs")))
        check_out_dir(cfg)

    corpus = data_mod.load_corpus(cfg.data, seq_len=cfg.seq_len, tokenizer=make_tokenizer(cfg, vocab),
                                  vocab_size=vocab, val_fraction=cfg.val_fraction)
    cfg.validated = True
    return cfg, corpus


def prepare_out_dir(cfg: TrainConfig) -> Path:
    """Create ``--out``; with ``--overwrite`` remove the earlier run's outputs (only :data:`RUN_OUTPUTS`)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.overwrite:
        for name in RUN_OUTPUTS:
            p = out / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
    return out


# ============================================================================================ engine

class Engine:
    """The model and its optimizer behind one small interface, so the loop reads the same for
    chunk ZeRO-3 (:class:`torch_backend.ZeroDDP` + :class:`torch_backend.ZeroOptimizer`, the default)
    and the plain-PyTorch baseline (``DistributedDataParallel`` + ``AdamW``, ``--engine ddp``)."""

    def __init__(self, module: nn.Module, cfg: TrainConfig, device: torch.device):
        self.cfg = cfg
        self.kind = cfg.engine
        betas = (0.9, 0.95)
        if self.kind == "zero":
            try:
                from torch_backend import ZeroDDP, ZeroOptimizer
            except ImportError as e:
                raise ConfigError(f"--engine zero: torch_backend.ZeroDDP is not available ({e})") from None
            self.model = ZeroDDP(module.to(device), mixed_precision=cfg.mixed_precision, chunk_size=cfg.chunk_size)
            self.optim = ZeroOptimizer(self.model, torch.optim.AdamW, lr=cfg.lr, max_norm=cfg.max_norm or None,
                                       weight_decay=cfg.weight_decay, betas=betas)
        else:
            from torch.nn.parallel import DistributedDataParallel

            module = module.to(device)
            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(module, device_ids=ids) if dist.is_initialized() else module
            self.optim = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=betas)

    @property
    def module(self) -> nn.Module:
        return getattr(self.model, "module", self.model)

    def param_groups(self) -> list[dict]:
        opt = self.optim
        for _ in range(3):
            if hasattr(opt, "param_groups"):
                return opt.param_groups
            opt = getattr(opt, "optim", getattr(opt, "optimizer", None))
        raise RuntimeError("cannot find the optimizer's param_groups to set the learning rate")

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups():
            g["lr"] = lr

    def backward(self, loss: torch.Tensor, *, sync: bool = True) -> None:
        """Backward of ``loss``; ``sync=False`` (all but the last micro-batch of a step) accumulates
        gradients locally without reducing them (``no_sync``)."""
        ctx = contextlib.nullcontext() if sync or not hasattr(self.model, "no_sync") else self.model.no_sync()
        with ctx:
            if self.kind == "zero":
                self.optim.backward(loss)
            else:
                loss.backward()

    def step(self) -> bool:
        """Clip and apply the update; ``False`` when it was skipped (non-finite gradients)."""
        if self.kind == "ddp":
            if self.cfg.max_norm:
                self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_norm))
            self.optim.step()
            return True
        applied = self.optim.step()
        self.last_grad_norm = self.optim.last_grad_norm
        return applied is not False

    last_grad_norm: float | None = None

    def zero_grad(self) -> None:
        self.optim.zero_grad(set_to_none=True) if self.kind == "ddp" else self.optim.zero_grad()

    @property
    def loss_scale(self) -> float:
        s = getattr(self.optim, "loss_scale", None)
        if callable(s):
            s = s()
        return 1.0 if s is None else float(s)

    def memory_report(self) -> Any:
        report = getattr(self.optim, "memory_report", None)
        if report is None:
            return None
        r = report()
        if hasattr(r, "bytes"):  # torch_backend.ddp.MemoryReport
            return {"bytes": r.bytes, "offload_optim_chunks": list(r.offload_optim_chunks),
                    "offload_param_chunks": list(r.offload_param_chunks)}
        return r if isinstance(r, (dict, str, int, float, list)) or r is None else str(r)

    def describe(self) -> str:
        """One line about the wrapping: chunks and chunk size for ZeroDDP."""
        layout = getattr(self.model, "layout", None)
        if layout is None:
            return f"engine {self.kind}"
        return (f"engine zero: {len(layout.chunks)} chunk(s) of {layout.chunk_size:,} elements, "
                f"shard per rank {sum(layout.shard_numel(c.index) for c in layout.chunks):,} elements")


# ============================================================================================ distributed

def init_distributed(cfg: TrainConfig) -> tuple[int, int, int, torch.device]:
    """``(rank, world_size, local_rank, device)``; joins the process group given by the environment
    (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``… set by ``torchrun`` or our launcher) with a collective
    timeout of ``cfg.timeout_s``, so a vanished peer ends the run instead of hanging for 30 minutes."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device_type = resolve_device(cfg.device)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, available_cpu_cores() // max(1, local_world)))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=_dt.timedelta(seconds=cfg.timeout_s), **kwargs)
    return rank, world, local_rank, device


def all_mean(x: float | torch.Tensor, device: torch.device) -> float:
    """The mean of a scalar over all ranks (itself when not distributed)."""
    t = torch.as_tensor(x, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device).detach().clone()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return float(t)


def gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says another worker vanished (a broken or timed-out collective)."""
    if isinstance(exc, getattr(dist, "DistBackendError", ())) or isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("connection closed by peer", "connection reset", "broken pipe", "timed out",
                            "timeout", "read error"))


# ============================================================================================ reporting

def peak_memory_mib(device: torch.device) -> dict:
    """This rank's peak memory: CUDA allocator peak on a GPU, else the process's peak resident set."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    d = {"peak_rss_mib": round(rss, 1)}
    if device.type == "cuda":
        d["peak_cuda_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return d


def read_metrics_history(path: Path, upto_step: int) -> list[dict]:
    """The records of an earlier session's ``metrics.jsonl`` up to step ``upto_step`` (a resumed run's
    checkpoint step), in file order. Later records belong to steps that the resumed run trains again
    (the earlier session outlived its last checkpoint) and are dropped; so are unreadable lines (a line
    cut short by a kill)."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return records
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= upto_step:
            records.append(r)
    return records


class Metrics:
    """``metrics.jsonl`` (rank 0): one JSON object per line, flushed at once. ``history``: a resumed run's
    earlier records (:func:`read_metrics_history`); the file is rewritten with exactly those first, so it
    holds the whole run once per step, and :attr:`train` / :attr:`val` cover the whole run."""

    def __init__(self, path: Path | None, history: list[dict] | None = None):
        self.path = path
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        for r in history or ():
            self._record(r)
        if path is not None and history is not None:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in history), encoding="utf-8")
            os.replace(tmp, path)
        self.f = open(path, "a", buffering=1) if path is not None else None

    def _record(self, record: dict) -> None:
        if record.get("kind") == "train" and "loss" in record:
            self.train.append((record["step"], record["loss"]))
        elif record.get("kind") == "val" and "val_loss" in record:
            self.val.append((record["step"], record["val_loss"]))

    def val_at(self, step: int) -> float | None:
        """The logged validation loss at ``step``, if any."""
        return next((v for s, v in self.val if s == step), None)

    def write(self, record: dict) -> None:
        self._record(record)
        if self.f is not None:
            self.f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def plot_loss(path: Path, metrics: Metrics, title: str) -> None:
    """The loss curve: training loss per step (and its running mean) and validation loss points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if metrics.train:
        steps, losses = zip(*metrics.train)
        ax.plot(steps, losses, lw=0.7, alpha=0.45, color="tab:blue", label="train (per step)")
        k = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, lw=1.6, color="tab:blue", label=f"train (mean of {k})")
    if metrics.val:
        vs, vl = zip(*metrics.val)
        ax.plot(vs, vl, "o-", color="tab:orange", lw=1.4, ms=4, label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt_time(s: float) -> str:
    m, s = divmod(s, 60)
    return f"{int(m)}m {s:04.1f}s" if m else f"{s:.1f}s"


def _fmt_count(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def summary_table(s: dict) -> str:
    mem = "; ".join(
        f"rank {r}: " + ", ".join(f"{v:,.0f} MiB {k.replace('peak_', '').replace('_mib', '').replace('_', ' ')}"
                                  for k, v in m.items())
        for r, m in enumerate(s["peak_memory"]))
    v0, v1 = s["val_loss_step0"], s["val_loss_final"]
    rows = [
        ("model", f"{s['model']} ({_fmt_count(s['params'])} parameters), {s['mixed_precision']}, engine {s['engine']}"),
        ("workers", f"{s['world_size']} × {s['device']} ({s['backend']})"),
        ("data", f"{s['data']['source']}: {_fmt_count(s['data']['train_tokens'])} train / "
                 f"{_fmt_count(s['data']['val_tokens'])} val tokens"),
        ("steps", f"{s['steps']} × {s['tokens_per_step']:,} tokens"),
        ("tokens", f"{s['tokens']:,}"),
        ("train loss", f"{s['train_loss_first']:.4f} (step {s.get('train_loss_first_step', 1)}) → "
                       f"{s['train_loss_last']:.4f} (step {s.get('train_loss_last_step', s['steps'])})"),
        ("val loss", f"{v0:.4f} (step {s.get('val_loss_first_step', 0)}) → "
                     f"{v1:.4f} (step {s.get('val_loss_final_step', s['steps'])}), ratio {v1 / v0:.3f}"),
        ("wall time", f"{_fmt_time(s['wall_time_s'])} (training {_fmt_time(s['train_time_s'])})"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}"),
        ("peak memory", mem),
        ("outputs", f"{s['out']}/ (metrics.jsonl, loss.png, sample.txt, summary.txt, train.log)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["chunkzero train — summary", "-" * 25] + [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


class _TqdmHandler(logging.StreamHandler):
    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover
            self.handleError(record)


def setup_logging(rank: int, out: Path | None) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if rank == 0 and out is not None:
        fh = logging.FileHandler(out / "train.log")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(fh)
    for name in ("torch.distributed", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Orbax logs through absl: INFO lines on every save ("Created BasePyTreeCheckpointHandler", "Closing
    # _NonBlockingMetadataStore", "[wait_until_finished] ...") would flood the console and train.log (a short
    # run with checkpoints logs no absl WARNING). JAX's distributed service announces itself at INFO.
    for name in ("absl", "jax._src.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)


# ============================================================================================ the loop

@torch.no_grad()
def evaluate(engine: Engine, batches, device: torch.device) -> float:
    """Mean validation loss over this rank's fixed batches, averaged over all ranks."""
    engine.model.eval()
    total = 0.0
    for x, y in batches:
        logits = logits_of(engine.model(x.to(device)))
        total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1)).item()
    engine.model.train()
    return all_mean(total / len(batches), device)


def sample_text(engine: Engine, corpus: data_mod.Corpus, cfg: TrainConfig, device: torch.device) -> tuple[str, str]:
    """``(prompt, text)``: the prompt and the prompt followed by ``cfg.sample_tokens`` sampled tokens. Every rank
    must call it (each forward gathers chunks); all ranks sample the same tokens (same seed)."""
    tok = corpus.tokenizer
    try:
        ids = list(tok.encode(cfg.prompt.encode("utf-8")))
    except DataError:
        ids = []
    if not ids:  # pre-tokenized data without a tokenizer: prompt with the first validation tokens
        ids = [int(t) for t in corpus.val[:16]]
    ids = ids[-cfg.block_size:]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    engine.model.eval()
    out = generate(engine.model, idx, cfg.sample_tokens, block_size=min(cfg.block_size, cfg.seq_len),
                   temperature=cfg.temperature, top_k=cfg.top_k, generator=gen)
    engine.model.train()
    return tok.decode(ids), tok.decode(out[0].tolist())


CHECKPOINT_DIR = "checkpoints"
CHECKPOINTS_KEPT = 3


def on_step_end(step: int, engine: Engine, sampler: data_mod.BatchSampler, cfg: TrainConfig) -> None:
    """Hook after optimizer step ``step`` (1-based), on every rank: every ``--save-interval`` steps and at
    the last step, an asynchronous Orbax checkpoint in ``<out>/checkpoints/<step>`` (the newest
    :data:`CHECKPOINTS_KEPT` are kept) with the data position, so ``--resume`` continues exactly here."""
    if cfg.save_interval and engine.kind == "zero" and (step % cfg.save_interval == 0 or step == cfg.steps):
        from .checkpoint import save_checkpoint

        save_checkpoint(Path(cfg.out) / CHECKPOINT_DIR, engine.model, engine.optim, step=step, async_save=True,
                        max_to_keep=CHECKPOINTS_KEPT, data_position={"sampler": sampler.state_dict()},
                        extra={"model": cfg.model, "seed": cfg.seed, "world_size": cfg.world_size,
                               "steps": cfg.steps, "warmup": cfg.warmup, "lr": cfg.lr,
                               "min_lr_ratio": cfg.min_lr_ratio})


SCHEDULE_KEYS = ("steps", "warmup", "lr", "min_lr_ratio")
"""The settings of :func:`lr_at`: changing one at ``--resume`` changes the LR schedule mid-run."""


def warn_schedule_change(previous: dict | None, source: str, cfg: TrainConfig, step: int) -> None:
    """Warn when ``--resume`` runs with another LR schedule (``--steps``, ``--warmup``, ``--lr``, ``--min-lr-ratio``) than the
    checkpointed run's ``previous`` settings: :func:`lr_at` re-stretches warmup + cosine decay to the new
    total, so the LR jumps at the resumed step."""
    if not previous:
        return
    changed = [f"--{k.replace('_', '-')} {getattr(cfg, k):g} (was {previous[k]:g})" for k in SCHEDULE_KEYS
               if isinstance(previous.get(k), (int, float)) and previous[k] != getattr(cfg, k)]
    if not changed:
        return
    old = TrainConfig(**{**cfg.to_dict(), **{k: previous[k] for k in SCHEDULE_KEYS if k in previous}})
    before = lr_at(step - 1, old) if step >= 1 else 0.0
    log.warning("warning: --resume with %s differs from the checkpointed run's settings (%s): the LR schedule "
                "(warmup + cosine decay) is re-stretched to the new total of %d steps, so the LR jumps from "
                "%.3g at step %d to %.3g at step %d", ", ".join(changed), source, cfg.steps, before, step,
                lr_at(step, cfg), step + 1)


def resume(engine: Engine, sampler: data_mod.BatchSampler, cfg: TrainConfig,
           previous_config: dict | None = None) -> int:
    """``--resume``: load the latest checkpoint of ``<out>/checkpoints`` into the engine (parameters,
    optimizer, loss scaler, RNG states) and the sampler's position; returns the next step to run.
    ``previous_config``: the earlier run's ``config.json``, for checkpoints without the schedule in their
    ``extra`` (rank 0 warns when the LR schedule changes, see :func:`warn_schedule_change`)."""
    from .checkpoint import load_checkpoint

    meta = load_checkpoint(Path(cfg.out) / CHECKPOINT_DIR, engine.model, engine.optim)
    sampler.load_state_dict((meta.data_position or {}).get("sampler", {}))
    log.info("resumed from step %d (%s/%s/%d)", meta.step, cfg.out, CHECKPOINT_DIR, meta.step)
    if not dist.is_initialized() or dist.get_rank() == 0:
        extra = dict(meta.extra or {})
        if "steps" in extra:
            warn_schedule_change(extra, f"checkpoint {meta.step}", cfg, meta.step)
        else:
            warn_schedule_change(previous_config, f"{cfg.out}/config.json", cfg, meta.step)
    return meta.step + 1


_TEST_KILL_ENV = "CHUNKZERO_TEST_KILL"
"""Test hook ``"<rank>:<step>"``: that rank kills itself with SIGKILL after that optimizer step."""


def train(cfg: TrainConfig, corpus: data_mod.Corpus, rank: int, world: int, device: torch.device,
          previous_config: dict | None = None) -> dict:
    """Run the training loop on this rank; returns the summary (complete on rank 0). ``previous_config``:
    with ``--resume``, the earlier run's ``config.json`` (read before this run replaced it)."""
    t_start = time.perf_counter()
    out = Path(cfg.out)
    is_main = rank == 0
    module = build_module(cfg)
    n_params = sum(p.numel() for p in module.parameters())
    engine = Engine(module, cfg, device)
    torch.manual_seed(cfg.seed + 1 + rank)  # per-rank stream (dropout); the init above was shared

    sampler = data_mod.BatchSampler(corpus.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, rank=rank,
                                    world_size=world, seed=cfg.seed)
    start = resume(engine, sampler, cfg, previous_config) if cfg.resume else 1  # after the seeding: the saved RNGs win
    val = data_mod.val_batches(corpus.val, seq_len=cfg.seq_len, batch_size=cfg.batch_size, rank=rank,
                               world_size=world, seed=cfg.seed, n_batches=cfg.eval_batches)
    tokens_per_step = world * cfg.grad_accum * cfg.batch_size * cfg.seq_len
    history = None
    if is_main and cfg.resume:  # the whole run in metrics.jsonl, the plot and the summary
        history = read_metrics_history(out / "metrics.jsonl", start - 1)
    metrics = Metrics(out / "metrics.jsonl" if is_main else None, history)
    backend = dist.get_backend() if dist.is_initialized() else "none"
    if is_main:
        log.info("model %s: %s parameters, %s, engine %s; %d worker(s) on %s (%s); %s tokens per step",
                 cfg.model, f"{n_params:,}", cfg.mixed_precision, cfg.engine, world, device.type, backend,
                 f"{tokens_per_step:,}")
        log.info("data %s: %s train / %s val tokens (%s)", corpus.description, f"{corpus.train.size:,}",
                 f"{corpus.val.size:,}", "; ".join(corpus.notes))
        log.info("%s", engine.describe())

    kill = os.environ.get(_TEST_KILL_ENV)
    kill_rank, kill_step = (int(v) for v in kill.split(":")) if kill else (-1, -1)

    # The evaluation at the start step, unless the earlier session logged it (before the checkpoint was
    # taken, so of the same weights). Rank 0's verdict is shared, as every rank must join evaluate().
    logged = gather_objects(metrics.val_at(start - 1) if is_main else None)[0]
    if logged is None:
        val_loss = evaluate(engine, val, device)
        metrics.write({"kind": "val", "step": start - 1, "val_loss": val_loss})
        if is_main:
            log.info("step %d: val loss %.4f", start - 1, val_loss)
    else:
        val_loss = logged

    pbar = None
    if is_main:
        from tqdm import tqdm

        tty = sys.stderr.isatty()  # in a log file, a refresh every 30 s instead of every 0.5 s
        pbar = tqdm(total=cfg.steps, initial=start - 1, desc="train", unit="step", dynamic_ncols=True,
                    file=sys.stderr,
                    mininterval=0.5 if tty else 30.0, maxinterval=10.0 if tty else 60.0)
    train_time = 0.0
    tokens = (start - 1) * tokens_per_step  # all of the run's, including steps before a resume
    session_tokens = 0  # this process's, for tokens/s
    skipped = 0
    for step in range(start, cfg.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step - 1, cfg)
        engine.set_lr(lr)
        loss_sum = 0.0
        for micro in range(cfg.grad_accum):
            x, y = sampler.next()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = logits_of(engine.model(x))
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            engine.backward(loss / cfg.grad_accum, sync=micro == cfg.grad_accum - 1)
            loss_sum += loss.detach()
        applied = engine.step()
        engine.zero_grad()
        skipped += not applied
        loss = all_mean(loss_sum / cfg.grad_accum, device)  # also a sync point, so the timing is honest
        dt = time.perf_counter() - t0
        train_time += dt
        tokens += tokens_per_step
        session_tokens += tokens_per_step
        scale = engine.loss_scale
        metrics.write({"kind": "train", "step": step, "loss": loss, "lr": lr, "loss_scale": scale,
                       "grad_norm": engine.last_grad_norm, "skipped": not applied, "tokens": tokens,
                       "tokens_per_s": tokens_per_step / dt, "time_s": round(train_time, 4)})
        if pbar is not None:
            pbar.set_postfix_str(f"loss {loss:.4f} | {session_tokens / train_time:,.0f} tok/s | lr {lr:.2e} | scale {scale:g}",
                                 refresh=False)
            pbar.update(1)
        if rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        on_step_end(step, engine, sampler, cfg)
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            val_loss = evaluate(engine, val, device)
            metrics.write({"kind": "val", "step": step, "val_loss": val_loss})
            if is_main:
                log.info("step %d: train loss %.4f, val loss %.4f", step, loss, val_loss)
    if pbar is not None:
        pbar.close()

    prompt, sample = ("", "")
    if cfg.sample_tokens:
        prompt, sample = sample_text(engine, corpus, cfg, device)
    memory = gather_objects(peak_memory_mib(device))
    # First and last losses of the whole run (metrics.jsonl, all sessions), with their steps; on ranks
    # other than 0 (no history) of this session.
    nan = float("nan")
    (t0_step, first_loss), (t1_step, last_loss) = (metrics.train[0], metrics.train[-1]) if metrics.train \
        else ((start, nan), (cfg.steps, nan))
    (v0_step, val0), (v1_step, val_loss) = (metrics.val[0], metrics.val[-1]) if metrics.val \
        else ((start - 1, nan), (cfg.steps, val_loss))
    summary = {
        "model": cfg.model, "params": n_params, "mixed_precision": cfg.mixed_precision, "engine": cfg.engine,
        "world_size": world, "device": device.type, "backend": backend, "data": corpus.summary(),
        "steps": cfg.steps, "skipped_steps": skipped, "tokens_per_step": tokens_per_step, "tokens": tokens,
        "train_loss_first": first_loss, "train_loss_last": last_loss,
        "train_loss_first_step": t0_step, "train_loss_last_step": t1_step,
        "val_loss_step0": val0, "val_loss_final": val_loss, "val_ratio": val_loss / val0 if val0 else nan,
        "val_loss_first_step": v0_step, "val_loss_final_step": v1_step,
        "wall_time_s": time.perf_counter() - t_start, "train_time_s": train_time,
        "tokens_per_s": session_tokens / train_time if train_time else 0.0,
        "peak_memory": memory, "memory_report": engine.memory_report(),
        "out": str(out), "sample": {"prompt": prompt, "text": sample},
    }
    if is_main:
        metrics.close()
        (out / "sample.txt").write_text(sample + "\n", encoding="utf-8")
        plot_loss(out / "loss.png", metrics, f"{cfg.model} · {world} × {device.type} · {cfg.mixed_precision} · "
                                            f"seed {cfg.seed}")
        table = summary_table(summary)
        (out / "summary.txt").write_text(table + "\n", encoding="utf-8")
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        log.info("sample (prompt %r):\n%s\n", prompt, sample)
        log.info("%s", table)
    return summary


# ============================================================================================ worker

def worker_main(cfg: TrainConfig) -> dict:
    """What one worker runs (spawned by :func:`torch_backend.launch.launch`, or directly under
    ``torchrun``). Returns ``{"status": "ok", "summary": ...}`` or ``{"status": "error", "message":
    ...}`` for bad input (exit code 2 under torchrun); exits with :data:`EXIT_PEER_LOST` when another
    worker vanished mid-run."""
    rank = int(os.environ.get("RANK", 0))
    setup_logging(rank, None)
    try:
        rank, world, _, device = init_distributed(cfg)
        # Every rank checks its inputs at once (under torchrun nobody did yet); rank 0 alone resolves and
        # checks --out. The verdicts are exchanged, so either all ranks train or all stop with one error.
        error, corpus = None, None
        try:
            if cfg.validated:
                corpus = _load_corpus(cfg)
            else:
                cfg, corpus = validate(cfg, check_out=rank == 0)
        except ChunkZeroError as e:
            error = str(e)
        verdicts = gather_objects((error, cfg.out))
        errors = [e for e, _ in verdicts if e is not None]
        if errors:
            return {"status": "error", "message": errors[0]}
        cfg.out = verdicts[0][1]
        out = Path(cfg.out)
        previous_config = None
        if rank == 0:
            prepare_out_dir(cfg)
            if cfg.resume:
                try:
                    previous_config = json.loads((out / "config.json").read_text())
                except (OSError, ValueError):
                    previous_config = None
            (out / "config.json").write_text(json.dumps(
                {**cfg.to_dict(), "world_size": world, "data_summary": corpus.summary()}, indent=2) + "\n")
            setup_logging(rank, out)
        barrier()
        pid_dir = out / "pids"
        pid_dir.mkdir(parents=True, exist_ok=True)
        (pid_dir / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")
        summary = train(cfg, corpus, rank, world, device, previous_config)
        return {"status": "ok", "summary": summary}
    except ChunkZeroError as e:
        return {"status": "error", "message": str(e)}
    except Exception as e:
        if is_peer_failure(e):
            log.error("rank %d: a collective failed, another worker has stopped (%s)", rank, str(e).splitlines()[0])
            sys.stderr.flush()
            # Give the agent time to see the worker that died first (it reports one failure per poll and
            # stops the rest), so the run names the cause and not this consequence.
            time.sleep(PEER_LOST_GRACE_S)
            os._exit(EXIT_PEER_LOST)
        raise
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # pragma: no cover - best effort at exit
                pass


def _load_corpus(cfg: TrainConfig) -> data_mod.Corpus:
    _, _, vocab = model_block_size(cfg.model)
    return data_mod.load_corpus(cfg.data, seq_len=cfg.seq_len, tokenizer=make_tokenizer(cfg, vocab),
                                vocab_size=vocab, val_fraction=cfg.val_fraction)
