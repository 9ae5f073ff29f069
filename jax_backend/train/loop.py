"""``chunkzero train --backend jax``'s loop, the torch loop's steps (:mod:`torch_backend.train.loop`)
with :class:`jax_backend.train.adapter.JaxAdapter`:

    build (or resume) → evaluate at the start → for each step: this process's devices' micro-batches,
    one ZeRO-3 step, log, [save a checkpoint], [evaluate] → sample text → summary and outputs (process 0)

The report is the job core's :class:`chunkzero.job.report.Report` (``metrics.jsonl``, progress bar,
``loss.png``, ``summary.json``/``.txt``, ``sample.txt``), with process 0 as rank 0. The sample is drawn
in JAX from the trained weights, gathered once at the end (:mod:`jax_backend.train.sampling`).
Checkpoints are the one chunkzero format (:meth:`jax_backend.ZeroTrainer.save_checkpoint`): torch resumes
them at any world size, and this loop resumes torch's, with its EMA under ``--ema-decay`` (the EMA weights and update
count kept, this run's decay and warm-up used from the resumed step on). What does not carry between engines:
the JAX step draws no random numbers (no dropout), so no RNG state is saved, and a torch checkpoint's
RNG states are ignored here; the loss scaler is saved as a passthrough (bf16 and fp32 run at scale 1).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from chunkzero.checkpoint.orbax_store import FINITE_KEY, wait_until_finished
from chunkzero.errors import ChunkZeroError
from chunkzero.job.guards import ema_resume_line, warn_dropped_ema
from chunkzero.resume_check import run_settings, sampler_position
from chunkzero.run_dir import CHECKPOINT_DIR
from chunkzero.train_config import TrainConfig, lr_at

log = logging.getLogger("chunkzero.train")


def train(cfg: TrainConfig, corpus, place, *, open_out: Callable[[str | None], None]) -> dict:
    """Run the loop on this process; returns the summary (complete on process 0). ``open_out(error)``: called
    on every process once the engine is built (a resumed checkpoint loaded), with this process's error or
    ``None``; it raises every process's first error, or prepares ``--out``, before anything is written there
    (``jax_backend.train.worker.open_out``)."""
    import jax

    from chunkzero.job import data as data_mod
    from chunkzero.job.report import Report, peak_memory_mib

    from ..processes import all_gather_json, process_mesh
    from .adapter import JaxAdapter

    t_start = time.perf_counter()
    mesh = process_mesh()
    world = int(mesh.devices.size)
    rank0 = place.process_id == 0
    ckpt_root = Path(cfg.out) / CHECKPOINT_DIR
    resume_from = ckpt_root if cfg.resume else None  # its latest step, or --resume-step's
    error = None
    try:
        adapter = JaxAdapter(cfg, mesh, resume_from=resume_from)
    except ChunkZeroError as e:
        error = str(e)
    open_out(error)
    params = sum(t.numel for t in adapter.layout.tensors)
    samplers = {r: data_mod.BatchSampler(corpus.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, rank=r,
                                         world_size=world, seed=cfg.seed) for r, _ in adapter.local_ranks}
    start, counters = 1, None
    if adapter.meta is not None:
        meta = adapter.meta
        for s in samplers.values():
            s.load_state_dict(sampler_position(meta, cfg))
        extra = dict(meta.extra or {})
        if rank0:
            log.info("resumed from step %d (%s/%d), saved at world size %d", meta.step, ckpt_root, meta.step,
                     meta.world_size)
            _say_resumed_ema(meta, ckpt_root / str(meta.step), cfg)
        start = meta.step + 1
        counters = extra.get("counters") if isinstance(extra.get("counters"), dict) else None
    val_rows = {r: data_mod.val_batches(corpus.val, seq_len=cfg.seq_len, batch_size=cfg.batch_size, rank=r,
                                        world_size=world, seed=cfg.seed,
                                        n_sequences=cfg.val_sequences or cfg.eval_batches * cfg.batch_size * world)
                for r, _ in adapter.local_ranks}
    n_val = len(next(iter(val_rows.values())))  # the same on every rank
    val = [adapter.global_batch({r: rows[k] for r, rows in val_rows.items()}) for k in range(n_val)]
    backend = f"jax, {jax.process_count()} process(es) × {cfg.devices_per_process} device(s)"
    report = Report(cfg, rank=place.process_id, world_size=world, device_type="cpu", backend=backend, start=start,
                    tokens_per_step=world * cfg.grad_accum * cfg.batch_size * cfg.seq_len, counters=counters)
    report.begin(params, corpus, adapter)
    settings = run_settings(cfg, world, corpus.summary())

    val_loss = all_gather_json(report.metrics.val_at(start - 1))[0]
    if val_loss is None:
        val_loss = adapter.evaluate(val)
        report.val(start - 1, val_loss, ema_val_loss=adapter.evaluate_ema(val))

    report.open_progress()
    try:
        for step in range(start, cfg.steps + 1):
            t0 = time.perf_counter()
            lr = lr_at(step - 1, cfg)
            rows = {}
            for r, s in samplers.items():  # the step's micro-batches, stacked: one batch of grad_accum · B rows
                xs, ys = zip(*(s.arrays_at(s.offsets(s.index + m)) for m in range(cfg.grad_accum)))
                s.index += cfg.grad_accum
                rows[r] = (_cat(xs), _cat(ys))
            loss, applied = adapter.step(step, adapter.global_batch(rows))  # a LossScaleError on every process alike
            report.train_step(step, loss, lr, adapter, applied, time.perf_counter() - t0)
            if cfg.save_interval and (step % cfg.save_interval == 0 or step == cfg.steps):
                sampler = next(iter(samplers.values()))
                adapter.save(ckpt_root, step, data_position={"sampler": sampler.state_dict()}, keep=cfg.keep,
                            extra={**settings, "counters": report.counters(), "backend": "jax",
                                   FINITE_KEY: applied and math.isfinite(float(loss))})
            if step % cfg.eval_interval == 0 or step == cfg.steps:
                val_loss = adapter.evaluate(val)
                report.val(step, val_loss, train_loss=loss, ema_val_loss=adapter.evaluate_ema(val))
    finally:
        report.close_progress()

    prompt, sample = _sample(adapter, corpus, cfg) if cfg.sample_tokens else (None, None)
    memory, chunks = zip(*all_gather_json([peak_memory_mib(), adapter.chunk_report(place.process_id)]))
    summary = report.summary(params=params, corpus=corpus, adapter=adapter, val_loss=val_loss, memory=list(memory),
                             chunks=list(chunks), prompt=prompt, sample=sample,
                             wall_time_s=time.perf_counter() - t_start)
    report.finish(summary)
    if cfg.save_interval:  # the last save's failure (a full disk ...) ends the run here: at exit it went unheard
        wait_until_finished(Path(cfg.out) / CHECKPOINT_DIR)
    return summary


def _say_resumed_ema(meta, step_dir: Path, cfg: TrainConfig) -> None:
    """What the resume did with the checkpoint's EMA, in one line (process 0), as the torch engine says it:
    dropped without ``--ema-decay``; restarted at the loaded weights from a checkpoint without one; kept, with
    this run's other ``--ema-decay`` / ``--ema-warmup``."""
    if cfg.ema_decay is None:
        warn_dropped_ema(meta, step_dir)
    elif meta.ema is None:
        log.warning("checkpoint %s holds no EMA: this run's EMA (--ema-decay) starts at the loaded weights (update "
                    "count 0)", step_dir)
    else:
        log.info("%s", ema_resume_line(meta.ema, cfg, meta.step))


def _cat(parts):
    import numpy as np

    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _sample(adapter, corpus, cfg: TrainConfig) -> tuple[str, str]:
    """The run's sample, drawn in JAX from the trained weights (gathered on every process; all sample alike)."""
    from .sampling import sample_text

    return sample_text(adapter.program, adapter.full_params(), corpus, cfg)
