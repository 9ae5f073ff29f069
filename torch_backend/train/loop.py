"""``chunkzero train``'s training loop, plain and visible (nanoGPT's ``train.py`` style).

Run by every worker (rank) of a data-parallel group (:mod:`torch_backend.train.worker` starts it):

    build the module → wrap it (TorchAdapter: ZeroDDP + ZeroOptimizer) → [resume] → evaluate at the start
    → for each step: LR schedule, grad-accum micro-batches (forward, backward), optimizer step, log,
      [save a checkpoint], [evaluate], hooks → sample text → summary and outputs (rank 0)

What is written, and where, is :mod:`chunkzero.job.report`'s; the model :mod:`torch_backend.train.models`';
the tokenizer and the batches (numpy) :mod:`chunkzero.job`'s; every collective :mod:`torch_backend.zero.collectives`'.

Determinism: the model is initialised from ``seed`` (:mod:`chunkzero.job.init`, the same on every rank and in
the JAX engine), the data stream is a pure function of ``(seed, world size, batch size, step)``
(:mod:`chunkzero.job.data`),
and each rank's torch RNG is re-seeded with ``seed + 1 + rank`` for dropout, so the same seed and world
size give the same loss sequence on the same kind of machine (another CPU's kernels sum in another order).

Hooks: ``train(..., on_step_end=[hook, ...])`` calls each ``hook(StepEnd(...))`` after every optimizer
step, on every rank, once the step's metrics, checkpoint and evaluation are done.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chunkzero.checkpoint.orbax_store import FINITE_KEY, wait_until_finished
from chunkzero.errors import CheckpointError, ChunkZeroError
from chunkzero.job import data as data_mod
from chunkzero.job.guards import ema_resume_line
from chunkzero.job.report import Report, peak_memory_mib
from chunkzero.resume_check import run_settings, sampler_position
from chunkzero.run_dir import CHECKPOINT_DIR, resume_failed
from chunkzero.train_config import TrainConfig, lr_at

from ..zero.collectives import all_gather_json, all_mean, world_group
from .adapter import TorchAdapter
from .models import build_module, lm_loss, logits_of, sample_text

log = logging.getLogger("chunkzero.train")


@dataclass(frozen=True)
class StepEnd:
    """What an ``on_step_end`` hook sees after optimizer step ``step`` (1-based) on rank ``rank``:
    ``loss``, the step's training loss averaged over the ranks (nats per token), and the ``adapter``."""

    step: int
    rank: int
    world_size: int
    loss: float
    adapter: TorchAdapter


StepHook = Callable[[StepEnd], None]
"""A callable run after every optimizer step (must be picklable to reach spawned workers)."""


def to_device(batch, device: torch.device) -> torch.Tensor:
    """A numpy micro-batch (:class:`chunkzero.job.data.BatchSampler`) as a tensor on ``device``."""
    return torch.from_numpy(batch).to(device, non_blocking=True)


def device_peak_memory_mib(device: torch.device) -> dict:
    """This rank's peak memory: the process's peak resident set, and the CUDA allocator's peak on a GPU."""
    d = peak_memory_mib()
    if device.type == "cuda":
        d["peak_cuda_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return d


@torch.no_grad()
def evaluate(adapter: TorchAdapter, batches, device: torch.device, group) -> float:
    """Validation loss of the run's fixed validation set (this rank's share: ``(x, y, w)`` micro-batches of
    :func:`data_mod.val_batches`): the mean over its sequences of each one's mean token loss, all ranks
    together, padding rows (``w`` 0) left out, so the same at any world size."""
    adapter.model.eval()
    total, count = 0.0, 0.0
    for x, y, w in batches:
        logits = logits_of(adapter.model(to_device(x, device))).float()
        tokens = F.cross_entropy(logits.reshape(-1, logits.size(-1)), to_device(y, device).reshape(-1),
                                 reduction="none")
        total += float(tokens.view(len(x), -1).mean(1).cpu().double() @ torch.from_numpy(w).double())
        count += float(w.sum())
    adapter.model.train()
    return all_mean(total, group) / all_mean(count, group)


def evaluate_ema(adapter: TorchAdapter, batches, device: torch.device, group) -> float | None:
    """:func:`evaluate` with the EMA weights swapped in (``--ema-decay``), or ``None`` without an EMA."""
    if adapter.ema is None:
        return None
    with adapter.ema.ema_weights():
        return evaluate(adapter, batches, device, group)


def save_step(step: int, adapter: TorchAdapter, sampler: data_mod.BatchSampler, cfg: TrainConfig, counters: dict,
              settings: dict, finite: bool = True) -> None:
    """An asynchronous Orbax checkpoint of step ``step`` in ``<out>/checkpoints/<step>`` (the newest
    ``--keep`` are kept, and the newest saved with a finite loss: ``finite``, the step's), with the data
    position, the run's ``settings`` (:func:`chunkzero.resume_check.run_settings`, which ``--resume``
    compares) and cumulative ``counters`` (:meth:`Report.counters`), so ``--resume`` continues exactly here,
    at any world size. Every wait of
    the save for the other ranks is bounded by ``--timeout`` (``cfg.timeout_s``)."""
    from torch_backend import save_checkpoint

    save_checkpoint(Path(cfg.out) / CHECKPOINT_DIR, adapter.model, adapter.optim, step=step, async_save=True,
                    max_to_keep=cfg.keep, timeout_s=cfg.timeout_s, data_position={"sampler": sampler.state_dict()},
                    extra={**settings, "counters": counters, FINITE_KEY: finite})


def resume(adapter: TorchAdapter, sampler: data_mod.BatchSampler, cfg: TrainConfig,
           rank: int) -> tuple[int, dict | None]:
    """``--resume``: load the latest checkpoint of ``<out>/checkpoints`` (or ``--resume-step``'s) into the
    engine (parameters, optimizer, loss scaler, RNG states) and the sampler's position (with
    ``--allow-change`` and another ``--seed``, its index in the new seed's stream). Returns the next step to
    run and the run's counters at the checkpoint (``{"tokens", "train_time_s"}``; ``None`` from a checkpoint
    that has none). What the resume changes was checked and said before any worker started
    (``torch_backend.train.resolve.check_run_out``)."""
    from chunkzero.checkpoint import read_meta, resolve_step_dir
    from torch_backend import load_checkpoint

    root = Path(cfg.out) / CHECKPOINT_DIR
    saved = read_meta(resolve_step_dir(root, cfg.resume_step))  # metadata only: the EMA settings, said once below
    if adapter.ema is not None and saved.ema is not None:  # load_checkpoint then replaces nothing
        adapter.ema.decay, adapter.ema.warmup = saved.ema.decay, saved.ema.warmup
    try:
        meta = load_checkpoint(root, adapter.model, adapter.optim, step=saved.step)
    except CheckpointError as e:
        raise resume_failed(root, saved.step, e) from None
    # this session's clipping and weight decay, as a fresh run and a JAX resume take them (the checkpoint's
    # param groups and max_norm came back with its state); the LR is set at every step
    adapter.optim.param_groups[0]["weight_decay"] = cfg.weight_decay  # decay_groups' first group
    if adapter.kind == "zero":
        adapter.optim.max_norm = cfg.max_norm or None
    sampler.load_state_dict(sampler_position(meta, cfg))
    log.info("resumed from step %d (%s/%s/%d)", meta.step, cfg.out, CHECKPOINT_DIR, meta.step)
    resume_ema_settings(adapter, meta, cfg, rank)
    extra = dict(meta.extra or {})
    if rank == 0:
        if not cfg.save_interval:
            log.info("--resume without --save-interval: this session saves no checkpoint (the latest stays step %d); "
                     "pass --save-interval N to keep saving", meta.step)
    counters = extra.get("counters")
    return meta.step + 1, (counters if isinstance(counters, dict) else None)


def resume_ema_settings(adapter: TorchAdapter, meta, cfg: TrainConfig, rank: int) -> None:
    """The resumed run's command line wins for the EMA's hyper-parameters: ``load_checkpoint`` put the
    checkpoint's decay and warm-up into ``adapter.ema`` (with its shards and update count); a different
    ``--ema-decay`` / ``--ema-warmup`` replaces them, and rank 0 says so in one line (so ``config.json``,
    which records this run's options, is true of the EMA). Without ``--ema-decay`` the checkpoint's EMA
    is dropped: ``load_checkpoint`` warns (rank 0)."""
    if adapter.ema is None or meta.ema is None:
        return
    adapter.ema.decay, adapter.ema.warmup = float(cfg.ema_decay), bool(cfg.ema_warmup)
    if rank == 0:
        log.info("%s", ema_resume_line(meta.ema, cfg, meta.step))


def train(cfg: TrainConfig, corpus: data_mod.Corpus, rank: int, world: int, device: torch.device, *,
          open_out: Callable[[str | None], None], on_step_end: Sequence[StepHook] = ()) -> dict:
    """Run the training loop on this rank; returns the summary (complete on rank 0). ``open_out(error)``:
    called on every rank once the model is built and a resumed checkpoint loaded, with this rank's error
    (or ``None``): it raises every rank's first error, or prepares ``--out``, before anything is written
    there (``torch_backend.train.worker.open_out``); ``on_step_end``: hooks called after every step
    (:class:`StepEnd`)."""
    t_start = time.perf_counter()
    group = world_group()
    backend = dist.get_backend(group) if group is not None else "none"

    # build: the same initial weights on every rank, then a per-rank RNG stream (dropout)
    module = build_module(cfg)
    params = sum(p.numel() for p in module.parameters())
    adapter = TorchAdapter(module, cfg, device)
    torch.manual_seed(cfg.seed + 1 + rank)
    sampler = data_mod.BatchSampler(corpus.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, rank=rank,
                                    world_size=world, seed=cfg.seed)
    error, start, counters = None, 1, None
    try:
        start, counters = resume(adapter, sampler, cfg, rank) if cfg.resume else (1, None)  # saved RNGs win
    except ChunkZeroError as e:
        error = str(e)
    open_out(error)
    val = data_mod.val_batches(corpus.val, seq_len=cfg.seq_len, batch_size=cfg.batch_size, rank=rank,
                               world_size=world, seed=cfg.seed,
                               n_sequences=cfg.val_sequences or cfg.eval_batches * cfg.batch_size * world)
    report = Report(cfg, rank=rank, world_size=world, device_type=device.type, backend=backend, start=start,
                    tokens_per_step=world * cfg.grad_accum * cfg.batch_size * cfg.seq_len, counters=counters)
    report.begin(params, corpus, adapter)
    settings = run_settings(cfg, world, corpus.summary())

    # The evaluation at the start step, unless the earlier session logged it (before the checkpoint was
    # taken, so of the same weights). Rank 0's verdict is shared, as every rank must join evaluate().
    val_loss = all_gather_json(report.metrics.val_at(start - 1), group)[0]
    if val_loss is None:
        val_loss = evaluate(adapter, val, device, group)
        report.val(start - 1, val_loss, ema_val_loss=evaluate_ema(adapter, val, device, group))

    report.open_progress()
    try:
        for step in range(start, cfg.steps + 1):
            t0 = time.perf_counter()
            lr = lr_at(step - 1, cfg)
            adapter.set_lr(lr)
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):  # gradients are reduced at the last micro-batch only
                x, y = (to_device(a, device) for a in sampler.next())
                loss = lm_loss(adapter.model(x), y)
                adapter.backward(loss / cfg.grad_accum, sync=micro == cfg.grad_accum - 1)
                loss_sum += loss.detach()
            applied = adapter.step()  # a LossScaleError comes on every rank at the same step
            adapter.zero_grad()
            loss = all_mean(loss_sum / cfg.grad_accum, group)  # also a sync point, so the timing is honest
            report.train_step(step, loss, lr, adapter, applied, time.perf_counter() - t0)
            if cfg.save_interval and (step % cfg.save_interval == 0 or step == cfg.steps):
                save_step(step, adapter, sampler, cfg, report.counters(), settings,
                          finite=applied and math.isfinite(float(loss)))
            if step % cfg.eval_interval == 0 or step == cfg.steps:
                val_loss = evaluate(adapter, val, device, group)
                report.val(step, val_loss, train_loss=loss, ema_val_loss=evaluate_ema(adapter, val, device, group))
            for hook in on_step_end:
                hook(StepEnd(step=step, rank=rank, world_size=world, loss=loss, adapter=adapter))
    finally:
        report.close_progress()

    prompt, sample = sample_text(adapter.model, corpus, cfg, device) if cfg.sample_tokens else (None, None)
    memory, chunks = zip(*all_gather_json([device_peak_memory_mib(device), adapter.chunk_report(rank)], group))
    summary = report.summary(params=params, corpus=corpus, adapter=adapter, val_loss=val_loss, memory=list(memory),
                             chunks=list(chunks), prompt=prompt, sample=sample,
                             wall_time_s=time.perf_counter() - t_start)
    report.finish(summary)
    if cfg.save_interval:  # the last save's failure (a full disk ...) ends the run here: at exit it went unheard
        wait_until_finished(Path(cfg.out) / CHECKPOINT_DIR)
    return summary
