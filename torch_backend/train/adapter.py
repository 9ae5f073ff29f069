"""The model and its optimizer behind one small interface (:class:`TorchAdapter`), so the training loop reads
the same for chunk ZeRO-3 (:class:`torch_backend.ZeroDDP` + :class:`torch_backend.ZeroOptimizer`, the
default) and the plain-PyTorch baseline (``DistributedDataParallel`` + ``AdamW``, ``--engine ddp``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from chunkzero.errors import ConfigError
from chunkzero.train_config import TrainConfig


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's two param groups over ``module``'s trainable parameters: ``weight_decay`` on tensors
    of 2 or more dimensions (matrices, embeddings), none on the others (biases, LayerNorm weights)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class TorchAdapter:
    """``model`` (the wrapped module) and ``optim`` for ``cfg.engine``, on ``device``; AdamW with betas
    (0.9, 0.95), ``cfg.lr``, weight decay ``cfg.weight_decay`` on tensors of 2 or more dimensions
    only (:func:`decay_groups`) and clipping at ``cfg.max_norm`` (0: none).

    Raises:
        ConfigError: ``--engine zero`` where ``torch_backend.ZeroDDP`` cannot be imported.
    """

    def __init__(self, module: nn.Module, cfg: TrainConfig, device: torch.device):
        self.cfg = cfg
        self.kind = cfg.engine
        self.ema = None
        """The :class:`~torch_backend.ZeroEMA` of ``--ema-decay`` (checkpointed with the optimizer), or ``None``."""
        betas = (0.9, 0.95)
        if self.kind == "zero":
            try:
                from torch_backend import ZeroDDP, ZeroOptimizer
            except ImportError as e:
                raise ConfigError(f"--engine zero: torch_backend.ZeroDDP is not available ({e})") from None
            offload = {} if device.type != "cuda" else {"offload_optim_frac": cfg.offload_optim_frac,
                                                        "offload_param_frac": cfg.offload_param_frac}
            self.model = ZeroDDP(module.to(device), mixed_precision=cfg.mixed_precision, chunk_size=cfg.chunk_size,
                                 shard_group_size=getattr(cfg, "shard_group_size", None), prefetch=cfg.prefetch,
                                 **offload)
            self.optim = ZeroOptimizer(
                self.model,
                torch.optim.AdamW,
                param_groups=decay_groups(module, cfg.weight_decay),
                lr=cfg.lr,
                max_norm=cfg.max_norm or None,
                betas=betas,
                max_skipped_at_min_scale=cfg.max_skipped_steps or None,
            )
            if cfg.ema_decay is not None:
                from torch_backend import ZeroEMA

                self.ema = ZeroEMA(self.optim, cfg.ema_decay, warmup=getattr(cfg, "ema_warmup", False))
        else:
            from torch.nn.parallel import DistributedDataParallel

            module = module.to(device)
            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(module, device_ids=ids) if dist.is_initialized() else module
            self.optim = torch.optim.AdamW(decay_groups(module, cfg.weight_decay), lr=cfg.lr, betas=betas)

    @property
    def module(self) -> nn.Module:
        return getattr(self.model, "module", self.model)

    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

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

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients so far (ZeroOptimizer's count, resumes included; DDP
        never skips)."""
        return int(getattr(self.optim, "skipped_steps", 0))

    def zero_grad(self) -> None:
        self.optim.zero_grad(set_to_none=True) if self.kind == "ddp" else self.optim.zero_grad()

    @property
    def loss_scale(self) -> float:
        s = getattr(self.optim, "loss_scale", None)
        if callable(s):
            s = s()
        return 1.0 if s is None else float(s)

    def memory_report(self) -> dict | None:
        """This rank's :meth:`ZeroDDP.memory_report` as plain data (``None`` for ``--engine ddp``):
        ``{"bytes": {device: {kind: bytes}}, "offload_optim_chunks", "offload_param_chunks",
        "peak_gathered_chunks", "frozen_parameters"}`` (``{device: {dtype: bytes}}``)."""
        if self.kind != "zero":
            return None
        r = self.optim.memory_report()
        return {"bytes": r.bytes, "offload_optim_chunks": list(r.offload_optim_chunks),
                "offload_param_chunks": list(r.offload_param_chunks), "peak_gathered_chunks": r.peak_gathered_chunks,
                "frozen_parameters": r.frozen_parameters}

    def chunk_report(self, rank: int) -> dict | None:  # noqa: ARG002 - the adapter interface
        """What chunk ZeRO-3 does on ``rank`` (``None`` for ``--engine ddp``): ``chunks`` (count),
        ``chunk_size`` (elements, searched unless ``--chunk-size``), ``sharded_chunks`` (those split over
        the ranks; the others are kept whole on every rank), ``shard_bytes`` (the compute-dtype
        parameter shards this rank holds, ``layout.shard_bytes(rank)``), ``param_bytes`` (all chunks
        whole, in the same dtype), ``model_state_bytes`` (this rank's parameters, gradients, fp32
        masters and optimizer state, gathered buffers excluded), ``peak_gathered_chunks`` (the most
        sharded chunks gathered at once so far), ``shard_group_size`` and ``replicas`` (hybrid sharding's
        S and R; flat: the world size and 1) and ``intra_sent_bytes`` / ``inter_sent_bytes`` (what this
        rank's chunk collectives sent so far within its shard group / across the replicas, ring algorithm)."""
        if self.kind != "zero":
            return None
        layout = self.model.layout
        r = self.optim.memory_report()
        return {"chunks": len(layout.chunks), "chunk_size": int(layout.chunk_size),
                "sharded_chunks": sum(not c.keep_gathered for c in layout.chunks),
                "shard_bytes": int(layout.shard_bytes(self.model.shard_rank)),
                "param_bytes": sum(c.size_bytes for c in layout.chunks),
                "model_state_bytes": int(r.model_state_bytes()), "peak_gathered_chunks": int(r.peak_gathered_chunks),
                "shard_group_size": int(self.model.shard_group_size), "replicas": int(self.model.replicas),
                **{k: int(v) for k, v in self.model.collective_stats.items() if k.endswith("_sent_bytes")}}

    def describe(self) -> str:
        """One line about the wrapping: chunks and chunk size for ZeroDDP."""
        layout = getattr(self.model, "layout", None)
        if layout is None:
            return f"engine {self.kind}"
        return (f"engine zero: {len(layout.chunks)} chunk(s) of {layout.chunk_size:,} elements, "
                f"shard per rank {sum(layout.shard_numel(c.index) for c in layout.chunks):,} elements")
