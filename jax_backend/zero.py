"""ZeRO-3 training step on the chunk layout, in JAX: one all-gather and one reduce-scatter per chunk.

The method is ZeRO stage 3 (Rajbhandari et al. 2020) with chunk-based storage (ColossalAI Gemini /
PatrickStar, Fang et al. 2021), the design of :class:`torch_backend.ZeroDDP`: each device holds its
shard ``[r·size/W, (r+1)·size/W)`` of every chunk of a :class:`chunkzero.ChunkLayout` (keep-gathered
chunks whole), as the 1-D arrays of :mod:`jax_backend.layout` sharded ``P('shard')``.

:class:`ZeroTrainer` is the schedule of :mod:`jax_backend.schedule` with one :class:`ChunkUnit` per
chunk: a chunk is gathered with ``all_gather(tiled=True)`` before the first stage that reads one of
its tensors (keep-gathered chunks are already whole) and its tensors sliced out at their offsets; in
backward their gradients are written into one zero-padded full-size chunk buffer, reduced after the
last stage that reads the chunk with ``psum_scatter(tiled=True)`` (the transpose of the tiled
all-gather, through :func:`jax_backend.collectives.reduce_scatter_sum`) to the device's gradient shard, or
``psum`` for a keep-gathered chunk. AdamW then updates the fp32 master shards locally.

Per step and per sharded chunk: one all-gather in forward, one in backward, one reduce-scatter
(trainable chunks) — the counts of :func:`chunkzero.chunk_zero3_cost` (XLA drops a backward gather
whose values the backward does not need, e.g. a chunk of output biases only). The per-parameter FSDP
and DDP baselines (:mod:`jax_backend.baselines`) run the same schedule with other units.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from chunkzero.checkpoint import CheckpointMeta, OptimizerMeta, chunk_key
from chunkzero.checkpoint.orbax_store import DEFAULT_TIMEOUT_S
from chunkzero.errors import ConfigError, LayoutError
from chunkzero.layout import ChunkLayout

from . import checkpoint as jax_checkpoint
from .blocks import Program, gpt_program, hf_program
from .collectives import reduce_scatter_sum
from .gpt import GPTConfig
from .layout import check_chunks
from .mesh import DEFAULT_AXIS, mesh_world_size
from .optim import ADAMW_STATE_KEYS, adam_state_from_chunks, adam_state_to_chunks, adamw_from_meta
from .schedule import GatherUnit, ShardedTrainer, TrainState


class ChunkUnit(GatherUnit):
    """One chunk of a :class:`ChunkLayout`: a 1-D array of the chunk's size, ``P(axis)`` (keep-gathered:
    ``P()``). Gather: ``all_gather(tiled)`` then slice tensors at their offsets. Reduce: the
    tensors' gradients written into a zero-padded chunk buffer, ``psum_scatter(tiled)`` (keep-gathered:
    ``psum``)."""

    def __init__(self, layout: ChunkLayout, index: int):
        c = layout.chunks[index]
        self.layout, self.index, self.info = layout, index, c
        self.key = chunk_key(index)
        self.offsets = tuple(sorted(layout.chunk_tensors(index), key=lambda t: t.offset))  # its tensors by offset
        self.tensors = tuple(t.name for t in self.offsets)
        self.trainable = c.requires_grad
        self.sharded = not c.keep_gathered

    def spec(self, axis):
        return P(axis) if self.sharded else P()

    def abstract(self, dtype):
        return jax.ShapeDtypeStruct((self.info.size,), jnp.dtype(dtype))

    def pack(self, full, dtype):
        out = np.zeros((self.info.size,), dtype=np.dtype(jnp.dtype(dtype)))
        for t in self.offsets:
            out[t.offset : t.end] = np.asarray(full[t.name], dtype=np.float32).reshape(-1)
        return out

    def unpack(self, value):
        v = np.asarray(jax.device_get(value))
        return {t.name: v[t.offset : t.end].reshape(t.shape) for t in self.offsets}

    def gather(self, local, axis):
        full = jax.lax.all_gather(local, axis, tiled=True) if self.sharded else local
        return {t.name: full[t.offset : t.end].reshape(t.shape) for t in self.offsets}

    def full_grad(self, grads):
        """The tensors' gradients in one zero-padded buffer of the chunk's size."""
        dtype = grads[self.tensors[0]].dtype
        parts = [grads[t.name].reshape(-1).astype(dtype) for t in self.offsets]
        if self.info.padding:
            parts.append(jnp.zeros((self.info.padding,), dtype))
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def reduce(self, grads, axis):
        full = self.full_grad(grads)
        if not self.sharded:
            return jax.lax.psum(full, axis)
        return reduce_scatter_sum(full, axis)


class ZeroTrainer(ShardedTrainer):
    """ZeRO-3 on a chunk layout: one :class:`ChunkUnit` per chunk (see the module docstring).

    ```python
    program = gpt_program(gpt_config("gpt-tiny"))
    layout = build_layout(program.specs, 4)                  # or a checkpoint's layout
    trainer = ZeroTrainer(program, layout, make_mesh(4), optax.adamw(3e-4))
    state = trainer.init(program.init(0))                    # or trainer.from_chunks(...)
    state, loss = trainer.step(state, batch)                 # batch: {"idx", "targets"} int32[B, T]
    chunks = trainer.chunks(state)                           # {chunk_key: f32[size]} P('shard')
    ```

    A checkpoint in, a checkpoint out, with the whole training state (torch resumes from it)::

        trainer, state = ZeroTrainer.from_checkpoint("runs/ckpt", make_mesh(4))   # torch-trained
        state, loss = trainer.step(state, batch)
        trainer.save_checkpoint("runs/ckpt", state, step=101)                     # torch loads it

    Args:
        program, mesh, tx, mixed_precision, max_norm, axis, donate: as
            :class:`jax_backend.schedule.ShardedTrainer`.
        layout: the chunk layout of ``program.specs`` (names must match, any chunk size); its world
            size must be the mesh's (``layout.relayout(n)`` otherwise).
        optimizer_meta: what ``tx`` is in the checkpoint format — torch AdamW's class and
            hyper-parameters (:func:`jax_backend.optim.adamw_meta`), needed by :meth:`save_checkpoint`;
            set by :meth:`from_checkpoint`.

    Raises:
        ConfigError: the layout's world size differs from the mesh's.
        LayoutError: the layout's tensors are not the program's.
    """

    name = "chunk-zero3"

    def __init__(self, program: Program, layout: ChunkLayout, mesh: Mesh, tx: optax.GradientTransformation, *,
                 optimizer_meta: OptimizerMeta | None = None, **kwargs):
        axis = kwargs.get("axis", DEFAULT_AXIS)
        n = mesh_world_size(mesh, axis)
        if layout.world_size != n:
            raise ConfigError(
                f"the layout is for world size {layout.world_size} but mesh axis {axis!r} has {n} devices; "
                f"use layout.relayout({n})"
            )
        for spec in program.specs:
            if spec.name not in layout:
                raise LayoutError(f"layout has no tensor {spec.name!r} of {program.name!r}")
            if layout.tensor(spec.name).shape != spec.shape:
                raise LayoutError(f"tensor {spec.name!r}: layout shape {layout.tensor(spec.name).shape}, "
                                  f"model shape {spec.shape}")
        self.layout = layout
        self.optimizer_meta = optimizer_meta
        self.source: CheckpointMeta | None = None
        """The metadata of the checkpoint :meth:`from_checkpoint` started from (``data_position``,
        ``model_config``, the loss scaler …), or ``None``."""
        super().__init__(program, self._chunk_units(layout), mesh, tx, **kwargs)

    def _chunk_units(self, layout: ChunkLayout) -> list[ChunkUnit]:
        """One gather unit per chunk (a subclass may reduce them otherwise)."""
        return [ChunkUnit(layout, c.index) for c in layout.chunks]

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike,
        mesh: Mesh,
        *,
        step: int | None = None,
        program: Program | None = None,
        axis: str = DEFAULT_AXIS,
        **kwargs,
    ) -> tuple[ZeroTrainer, TrainState]:
        """A trainer and its state from a chunkzero checkpoint of torch AdamW (any world size): the
        chunks and AdamW state restored on ``mesh`` (:func:`jax_backend.restore_checkpoint`),
        torch AdamW with the saved hyper-parameters of every param group (:func:`jax_backend.adamw_from_meta`), the
        saved ``max_norm`` and compute precision.

        Args:
            path, step: a checkpoint root or step directory, and the step (default: the latest).
            mesh, axis: where to train; the layout is the saved one relaid out for ``mesh.shape[axis]``.
            program: the model as stages (default: the GPT of the checkpoint's ``model_config``; a Hugging
                Face config, with a ``model_type``, gives its HF-named program: :func:`jax_backend.blocks.hf_program`).
            kwargs: more :class:`ZeroTrainer` arguments (``donate`` …); ``mixed_precision`` and
                ``max_norm`` override the saved ones.

        Returns:
            ``(trainer, state)``; ``trainer.source`` is the checkpoint's metadata.

        Raises:
            CheckpointError / CheckpointFormatError: as :func:`jax_backend.restore_checkpoint`; no
                optimizer state saved.
            ConfigError: the optimizer is not a mirrored AdamW (:func:`jax_backend.optim.adamw_hyperparameters`),
                no ``program`` and no GPT ``model_config`` saved, or fp16 compute saved and no
                ``mixed_precision`` given (JAX trains in fp32 or bf16).
        """
        restored = jax_checkpoint.restore_checkpoint(path, mesh, axis=axis, step=step, with_optimizer=True)
        meta, optim = restored.meta, restored.meta.optimizer
        if program is None:
            if not meta.model_config:
                raise ConfigError(f"checkpoint {str(restored.path)!r} has no model_config: pass program=")
            if "model_type" in meta.model_config:  # a Hugging Face config.json: HF names and shapes
                program = hf_program(meta.model_config)
            else:
                program = gpt_program(GPTConfig.from_dict(meta.model_config))
        if meta.mixed_precision == "fp16" and "mixed_precision" not in kwargs:
            raise ConfigError(f"checkpoint {str(restored.path)!r} was trained in fp16, which the JAX step does not "
                              "run: pass mixed_precision='fp32' or 'bf16'")
        kwargs.setdefault("mixed_precision", meta.mixed_precision)
        kwargs.setdefault("max_norm", optim.hyperparameters.get("max_norm"))
        trainer = cls(
            program,
            restored.layout,
            mesh,
            adamw_from_meta(optim, layout=restored.layout),
            optimizer_meta=optim,
            axis=axis,
            **kwargs,
        )
        trainer.source = meta
        return trainer, trainer.from_chunks(restored.chunks, restored.opt_state_chunks, optim.step)

    def save_checkpoint(self, directory: str | os.PathLike, state: TrainState, *, step: int,
                        data_position: dict | None = None, extra: dict | None = None, model_config: dict | None = None,
                        ema=None, timeout_s: float = DEFAULT_TIMEOUT_S, options: Any = None) -> Path:
        """Save ``state`` as step ``step`` of a chunkzero checkpoint that torch resumes with nothing built by hand.

        Writes the fp32 master chunks and the AdamW state (:meth:`opt_state_chunks`) at this trainer's
        layout, and the complete optimizer metadata: the class and hyper-parameters of
        ``optimizer_meta`` (every param group's, as restored) with this trainer's ``max_norm``, the step
        (optax's ``count``), and the loss scaler — :attr:`source`'s with ``step_count`` advanced by the steps
        applied here (``skipped_steps`` is not advanced: a step skipped with ``skip_nonfinite`` is not recorded),
        or ``{"step_count": count, "skipped_steps": 0}`` without a source.
        ``model_config`` defaults to the source's; the compute precision is the trainer's. ``options``:
        ``orbax.checkpoint.CheckpointManagerOptions`` to start from (``max_to_keep`` …). ``ema``: a
        :class:`jax_backend.ChunkEMA` of this trainer, saved as the ``ema`` arrays and record (torch loads it
        into a ``ZeroEMA``), or ``None``.

        Returns:
            The committed step directory.

        Raises:
            ConfigError: the trainer has no ``optimizer_meta``; bad ``step`` or ``timeout_s``.
            CheckpointError: as :func:`jax_backend.save_checkpoint` (the step exists, or is before the latest).
        """
        if self.optimizer_meta is None:
            raise ConfigError(
                "this ZeroTrainer has no optimizer_meta: build it with ZeroTrainer.from_checkpoint, or pass "
                "optimizer_meta=jax_backend.optim.adamw_meta(...) describing tx"
            )
        opt_state, count = self.opt_state_chunks(state)
        optim = dataclasses.replace(
            self.optimizer_meta,
            step=count,
            state_keys=list(ADAMW_STATE_KEYS),
            tensor_steps=None,
            hyperparameters={**self.optimizer_meta.hyperparameters, "max_norm": self.max_norm},
        )
        source = self.source
        if source is not None and source.loss_scaler is not None and source.optimizer is not None:
            taken = count - source.optimizer.step
            scaler = {**source.loss_scaler, "step_count": int(source.loss_scaler.get("step_count", 0)) + taken}
        else:
            scaler = {"step_count": count, "skipped_steps": 0}
        if model_config is None and source is not None:
            model_config = source.model_config
        return jax_checkpoint.save_checkpoint(
            directory, self.chunks(state), self.layout, step=step, opt_state_chunks=opt_state, optimizer_meta=optim,
            mixed_precision=self.mixed_precision, loss_scaler=scaler, model_config=model_config,
            data_position=data_position, extra=extra, timeout_s=timeout_s, options=options,
            ema_chunks=None if ema is None else ema.chunks, ema_meta=None if ema is None else ema.meta())

    @property
    def sharded_chunks(self) -> list[int]:
        """Indices of the chunks that are sharded (gathered and reduce-scattered)."""
        return [c.index for c in self.layout.chunks if not c.keep_gathered]

    def chunks(self, state: TrainState) -> dict[str, jax.Array]:
        """The fp32 master chunk arrays ``{chunk_key: f32[size]}`` (``P(axis)``), ready for
        :func:`jax_backend.unflatten` or :func:`jax_backend.save_checkpoint`."""
        return dict(state.master)

    def from_chunks(self, chunks: Mapping[str, Any], opt_state_chunks: Mapping[str, Mapping[str, Any]] | None = None,
                    step: int = 0, *, schedule_step: int | None = None) -> TrainState:
        """The state from fp32 chunk arrays and, optionally, torch AdamW state chunks
        (``{"exp_avg": {...}, "exp_avg_sq": {...}}``, trainable chunks) after ``step`` steps — what
        :func:`jax_backend.restore_checkpoint` returns. ``tx`` must then be an (optax) adamw;
        ``schedule_step``: its learning-rate schedule's count, when not ``step``
        (:func:`jax_backend.optim.adam_state_from_chunks`).

        Raises:
            LayoutError / ShapeMismatchError: chunks not matching the layout.
        """
        arrays = check_chunks(chunks, self.layout)
        master = {chunk_key(i): v for i, v in arrays.items()}
        opt = None
        if opt_state_chunks is not None:
            opt = adam_state_from_chunks(
                self.tx,
                {k: master[k] for k in self.trainable},
                {s: {k: opt_state_chunks[s][k] for k in self.trainable} for s in opt_state_chunks},
                step,
                schedule_step=schedule_step,
            )
        return self.state_from_master(master, opt)

    def opt_state_chunks(self, state: TrainState) -> tuple[dict[str, dict[str, jax.Array]], int]:
        """``({"exp_avg": {...}, "exp_avg_sq": {...}}, step)`` of an adam/adamw state, for a checkpoint."""
        return adam_state_to_chunks(state.opt_state)


__all__ = ["ChunkUnit", "ZeroTrainer"]
