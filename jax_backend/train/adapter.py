""":class:`JaxAdapter`: :class:`jax_backend.ZeroTrainer` set up as ``chunkzero train`` sets up the torch
engine, behind the interface the loop and :class:`chunkzero.job.report.Report` read.

The same run as torch's: the model initialised from the same bytes (:func:`initial_params`: the core's
numpy initialization, or a directory's safetensors read with numpy; no torch) — a byte-level GPT, or a Hugging
Face GPT-2 or Llama-family (Llama, Mistral, Qwen2) directory under HF's own tensor names and shapes
(:func:`jax_backend.blocks.hf_program`), so its checkpoints are the torch run's — the chunk layout of
:class:`torch_backend.ZeroDDP` (the core search over the same tensor specs, in the compute dtype),
AdamW with betas (0.9, 0.95), eps 1e-8, the two param groups of
:func:`torch_backend.train.adapter.decay_groups` (weight decay on tensors of 2 or more dimensions),
clipping at ``--max-norm`` and the LR schedule of :func:`chunkzero.train_config.lr_at` at the schedule's
count in the optax state, which counts every step, a skipped one too, as the torch loop's ``lr_at(step - 1)``
(Adam's own count, for its bias correction, only the applied ones); with ``--ema-decay`` a
:class:`jax_backend.ChunkEMA` of the masters (torch's ``ZeroEMA``), updated after each applied step.
``--resume`` restores the latest checkpoint, torch's or JAX's, at any world size (its EMA too, with
``--ema-decay``).

A step's micro-batches: device ``r`` of the mesh (rank ``r``) trains micro-batches ``i·A … i·A + A − 1``
of :class:`chunkzero.job.data.BatchSampler` at rank ``r`` (``A`` = ``--grad-accum``), stacked into
one batch of ``A·B`` sequences: the mean loss over them has the gradient torch accumulates
(``loss / A`` per micro-batch). Each process builds only its own devices' rows.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from chunkzero.checkpoint import chunk_key, latest_step
from chunkzero.configs import GPT_CONFIGS
from chunkzero.errors import CheckpointError, ConfigError
from chunkzero.host_memory import release_free_memory
from chunkzero.job.guards import NonFiniteStop
from chunkzero.job.init import gpt_initial_params
from chunkzero.job.models import hf_config
from chunkzero.layout import ChunkLayout
from chunkzero.run_dir import resume_failed
from chunkzero.search import search_chunk_size
from chunkzero.train_config import TrainConfig

from ..blocks import Program, gpt_program, hf_program
from ..checkpoint import restore_checkpoint
from ..ema import ChunkEMA
from ..optim import adamw_meta, param_groups_adamw
from ..zero import ZeroTrainer

BETAS, EPS = (0.9, 0.95), 1e-8
"""AdamW's betas and eps, as :class:`torch_backend.train.adapter.TorchAdapter` uses them."""


def lr_schedule(cfg: TrainConfig):
    """:func:`chunkzero.train_config.lr_at` as an optax schedule of the step count (jnp)."""
    span_steps = max(1, cfg.schedule_steps or cfg.steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    span = max(1, span_steps - 1 - cfg.warmup)

    def schedule(count):
        step = jnp.minimum(count, span_steps - 1).astype(jnp.float32)
        warm = cfg.lr * (step + 1) / (cfg.warmup + 1)
        progress = jnp.clip((step - cfg.warmup) / span, 0.0, 1.0)
        decay = min_lr + 0.5 * (1.0 + jnp.cos(math.pi * progress)) * (cfg.lr - min_lr)
        return jnp.where(step < cfg.warmup, warm, decay)

    return schedule


def run_program(cfg: TrainConfig) -> Program:
    """The staged program of ``cfg.model``: a byte-level GPT by name, or (``cfg.model_kind == "hf"``) the
    Hugging Face GPT-2 or Llama-family model of that directory under HF's tensor names and shapes.

    Raises:
        ConfigError: a Hugging Face config no program computes (:func:`jax_backend.blocks.hf_program`).
    """
    if cfg.model_kind == "hf":
        return hf_program(hf_config(cfg.model))
    return gpt_program(GPT_CONFIGS[cfg.model])


def run_model_config(cfg: TrainConfig) -> dict:
    """The ``model_config`` a checkpoint of this run records, as the torch engine records it (the HF config's
    ``config.json`` for a Hugging Face directory, the byte-level GPT's config otherwise)."""
    if cfg.model_kind == "hf":
        return hf_config(cfg.model)
    return GPT_CONFIGS[cfg.model].to_dict()


def layout_for_config(cfg: TrainConfig, world: int) -> ChunkLayout:
    """The layout ZeroDDP builds for ``cfg.model`` at ``world`` ranks (same specs, same search)."""
    dtype = "bfloat16" if cfg.mixed_precision == "bf16" else "float32"
    specs = [dataclasses.replace(s, dtype=dtype) for s in run_program(cfg).specs]
    if cfg.chunk_size is not None:
        return ChunkLayout.build(specs, cfg.chunk_size, world)
    found = search_chunk_size(specs, world)
    return ChunkLayout.build(
        specs, int(found.chunk_size), world, keep_gathered_below_numel=int(found.keep_gathered_below_numel)
    )


def param_groups(layout: ChunkLayout, cfg: TrainConfig) -> list[dict]:
    """torch's two groups by tensor name: weight decay on tensors of 2 or more dimensions only."""
    names = [t.name for t in layout.tensors]
    dims = {t.name: len(t.shape) for t in layout.tensors}
    hp = {"lr": cfg.lr, "betas": list(BETAS), "eps": EPS, "amsgrad": False, "maximize": False}
    return [{**hp, "weight_decay": cfg.weight_decay, "params": [n for n in names if dims[n] >= 2]},
            {**hp, "weight_decay": 0.0, "params": [n for n in names if dims[n] < 2]}]


def initial_params(cfg: TrainConfig, specs) -> dict[str, np.ndarray]:
    """The run's initial weights by tensor name, numpy fp32: a byte-level GPT's numpy initialization of
    ``cfg.seed`` (:func:`chunkzero.job.init.gpt_initial_params`, the torch engine's too), or a Hugging Face
    directory's safetensors weights, read with numpy (HF's names, with or without the ``transformer.`` prefix).

    Raises:
        ConfigError: a Hugging Face directory without safetensors weights, or missing one of ``specs``.
    """
    if cfg.model_kind != "hf":
        return gpt_initial_params(GPT_CONFIGS[cfg.model], cfg.seed)
    from safetensors.numpy import load_file

    files = sorted(Path(cfg.model).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"--model {cfg.model}: no *.safetensors weights (the JAX engine reads only safetensors)")
    stored = {}
    for f in files:
        stored.update(load_file(f))
    out = {}
    for spec in specs:
        for name in (spec.name, *spec.aliases):
            value = stored.get(name, stored.get(name.removeprefix("transformer.")))
            if value is not None:
                out[spec.name] = np.asarray(value, np.float32)
                break
        else:
            raise ConfigError(f"--model {cfg.model}: its safetensors weights have no tensor {spec.name}")
    return out


class JaxAdapter:
    """The trainer, its state and the mesh of one run (see the module docstring).

    Raises:
        CheckpointError / ConfigError: ``resume_from`` cannot be restored here.
    """

    kind = "zero"
    loss_scale = 1.0
    last_grad_norm: float | None = None
    """The global gradient L2 norm before clipping of the last step (``None`` before the first)."""

    ema: ChunkEMA | None = None
    """The EMA of ``--ema-decay`` (checkpointed with the state), or ``None``."""

    _step_loaded = False
    """Whether the step is compiled (:meth:`_load_step`, before the first)."""

    def __init__(self, cfg: TrainConfig, mesh, *, resume_from: Path | None = None):
        self.cfg, self.mesh = cfg, mesh
        self.guard = NonFiniteStop(cfg.max_skipped_steps)
        """Steps skipped for non-finite gradients: the run stops at ``--max-skipped-steps`` in a row."""
        self.world = int(mesh.devices.size)
        self.program = run_program(cfg)
        self.meta = None
        if resume_from is not None:
            try:
                restored = restore_checkpoint(resume_from, mesh, step=cfg.resume_step, with_optimizer=True)
            except CheckpointError as e:
                raise resume_failed(resume_from, cfg.resume_step or latest_step(resume_from), e) from None
            layout, self.meta = restored.layout, restored.meta
        else:
            layout = layout_for_config(cfg, self.world)
        groups = param_groups(layout, cfg)
        tx = param_groups_adamw(lr_schedule(cfg), BETAS[0], BETAS[1], EPS, layout, groups)
        optim_meta = dataclasses.replace(
            adamw_meta(learning_rate=cfg.lr, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=cfg.weight_decay,
                       max_norm=cfg.max_norm or None), param_groups=groups)
        self.trainer = ZeroTrainer(self.program, layout, mesh, tx, optimizer_meta=optim_meta,
                                   mixed_precision=cfg.mixed_precision, max_norm=cfg.max_norm or None, grad_norm=True,
                                   skip_nonfinite=True, remat=cfg.activation_checkpointing)
        if resume_from is not None:
            self.trainer.source = restored.meta
            # Adam counts the applied steps, the LR schedule every step (torch's loop: lr_at(step - 1) whether
            # or not a step was skipped)
            state = self.trainer.from_chunks(restored.chunks, restored.opt_state_chunks, restored.meta.optimizer.step,
                                             schedule_step=restored.meta.step)
            # one buffer per leaf: the step donates its state, and the restored Adam and schedule counts share one
            self.state = jax.tree.map(jnp.copy, state)
        else:
            self.state = self.trainer.init(initial_params(cfg, self.program.specs))
        if cfg.ema_decay is not None:  # this run's decay and warm-up; a resumed EMA keeps its weights and count
            self.ema = ChunkEMA(self.trainer, self.state, cfg.ema_decay, warmup=cfg.ema_warmup)
            if self.meta is not None and self.meta.ema is not None:
                saved = restore_checkpoint(restored.path, mesh, item="ema")
                self.ema.load(saved.chunks, self.meta.ema.update_count)
        self.layout = layout
        self._batch_sharding = NamedSharding(mesh, P(self.trainer.axis))
        self._replicated = NamedSharding(mesh, P())
        self._sum = jax.jit(jnp.sum, out_shardings=self._replicated)
        self._eval = jax.jit(self._eval_loss, out_shardings=self._replicated)
        order = list(mesh.devices.reshape(-1))
        self.local_ranks = [(order.index(d), d) for d in mesh.local_devices]

    # ------------------------------------------------------------------ batches
    def global_batch(self, rows: dict[int, tuple[np.ndarray, ...]]) -> dict[str, jax.Array]:
        """``{"idx", "targets"}`` int32 ``[W·b, T]`` sharded on the batch, from this process's devices' rows
        ``{rank: (x, y)}`` (``int[b, T]`` each); with rows ``(x, y, w)`` also ``"weights"`` f32 ``[W·b]``."""
        out = {}
        keys = [("idx", 0, np.int32), ("targets", 1, np.int32), ("weights", 2, np.float32)]
        for k, j, dtype in keys[:len(next(iter(rows.values())))]:
            parts = [jax.device_put(np.asarray(rows[r][j], dtype), d) for r, d in self.local_ranks]
            shape = (self.world * parts[0].shape[0], *parts[0].shape[1:])
            out[k] = jax.make_array_from_single_device_arrays(shape, self._batch_sharding, parts)
        return out

    # ------------------------------------------------------------------ step, evaluation
    def step(self, step: int, batch: dict[str, jax.Array]) -> tuple[float, bool]:
        """Optimizer step ``step`` on a global batch: ``(mean token loss before the update, applied)``. A step
        whose gradient norm is not finite is skipped (the state is kept) and counted by :attr:`guard`. Sets
        :attr:`last_grad_norm` (the global gradient L2 norm before clipping, as torch's engine reports it).

        Raises:
            LossScaleError: the ``--max-skipped-steps``-th skip in a row.
        """
        if not self._step_loaded:
            self._load_step(batch)
        self.state, losses, norm = self.trainer.step_fn(self.state, batch)
        self.last_grad_norm = float(np.asarray(norm.addressable_data(0)))
        applied = math.isfinite(self.last_grad_norm)
        self.guard.record(step, applied)
        if applied and self.ema is not None:
            self.ema.update(self.state)
        return float(np.asarray(self._sum(losses).addressable_data(0))), applied

    def _load_step(self, batch: dict[str, jax.Array]) -> None:
        """Compile the step (or load it from the persistent compilation cache) before its first run, on as little
        host memory as the run can have, since the step's working memory (XLA's temp buffer, the most the run
        allocates at once) comes on top of it: with the persistent cache on, the programs compiled so far (the
        processes' agreement collectives, the reduce-scatter check, the initialization, the evaluation) are
        dropped first — each keeps about 1.4 MiB of host memory while loaded, and the few used again are loaded
        from the cache then — and the host memory that loading freed goes back to the operating system
        (:func:`chunkzero.host_memory.release_free_memory`: tens of MiB, which glibc would keep). A step function
        that is not jitted (no ``lower``) is left to its first call."""
        self._step_loaded = True
        lower = getattr(self.trainer.step_fn, "lower", None)
        if lower is None:
            return
        if jax.config.jax_compilation_cache_dir:
            jax.clear_caches()
        lower(self.state, batch).compile()
        release_free_memory()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients in this session."""
        return self.guard.skipped_steps

    def _eval_loss(self, chunks, batch):
        tensors = {t.name: chunks[chunk_key(t.chunk)][t.offset:t.end].reshape(t.shape) for t in self.layout.tensors}
        return self.program.loss_sum(tensors, batch)

    def evaluate(self, batches: list[dict[str, jax.Array]], chunks: dict[str, jax.Array] | None = None) -> float:
        """Validation loss of the global batches with ``"weights"`` (``global_batch`` of
        ``data.val_batches``' rows): the mean over the weighted rows of each one's mean token loss, as torch's
        ``evaluate`` (padding rows, weight 0, left out). ``chunks``: the weights to evaluate, in the compute
        dtype (default: the live ones)."""
        if chunks is None:
            chunks = self.state.params if self.state.params is not None else self.state.master
        total = sum(float(np.asarray(self._eval(chunks, b).addressable_data(0))) for b in batches)
        rows = sum(float(np.asarray(self._sum(b["weights"]).addressable_data(0))) for b in batches)
        return total / (rows * batches[0]["targets"].shape[1])

    def evaluate_ema(self, batches: list[dict[str, jax.Array]]) -> float | None:
        """:meth:`evaluate` of the EMA weights (cast to the compute dtype, as torch's ``ema_weights()``
        refreshes its low-precision shards from them), or ``None`` without an EMA."""
        if self.ema is None:
            return None
        dtype = self.trainer.compute_dtype
        return self.evaluate(batches, {k: v.astype(dtype) for k, v in self.ema.weights(self.state).items()})

    # ------------------------------------------------------------------ checkpoints, weights
    def save(self, directory: Path, step: int, *, data_position: dict, extra: dict, keep: int) -> None:
        """Step ``step`` of the run's checkpoint (the newest ``keep`` kept), every wait bounded by ``--timeout``."""
        import orbax.checkpoint as ocp

        self.trainer.save_checkpoint(directory, self.state, step=step, data_position=data_position, extra=extra,
                                     model_config=run_model_config(self.cfg), ema=self.ema,
                                     timeout_s=self.cfg.timeout_s,
                                     options=ocp.CheckpointManagerOptions(max_to_keep=keep))

    def full_params(self) -> dict[str, np.ndarray]:
        """Every tensor under each of its names (tied aliases too), full-shaped fp32 numpy, on every process (a
        collective)."""
        full = {k: np.asarray(process_allgather(v, tiled=True)) for k, v in self.state.master.items()}
        return {name: full[chunk_key(t.chunk)][t.offset:t.end].reshape(t.shape)
                for t in self.layout.tensors for name in t.names}

    # ------------------------------------------------------------------ what the report reads
    def describe(self) -> str:
        layout = self.layout
        return (
            f"engine zero (jax): {len(layout.chunks)} chunk(s) of {layout.chunk_size:,} elements over "
            f"{self.world} device(s), shard per device "
            f"{sum(layout.shard_numel(c.index) for c in layout.chunks):,} elements"
        )

    def memory_report(self) -> None:
        return None

    def chunk_report(self, rank: int) -> dict:
        layout = self.layout
        shard = int(layout.shard_bytes(rank))
        master = sum(layout.shard_numel(c.index) for c in layout.chunks) * 4
        ema = sum(layout.shard_numel(c.index) for c in layout.chunks if c.requires_grad) * 4 if self.ema else 0
        return {"chunks": len(layout.chunks), "chunk_size": int(layout.chunk_size),
                "sharded_chunks": sum(not c.keep_gathered for c in layout.chunks), "shard_bytes": shard,
                "param_bytes": sum(c.size_bytes for c in layout.chunks),
                "model_state_bytes": master * 3 + ema + (shard if self.cfg.mixed_precision == "bf16" else 0),
                "peak_gathered_chunks": "n/a"}  # XLA schedules the gathers
