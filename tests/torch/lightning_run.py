"""A tiny GPT trained by Lightning's Trainer through ZeroStrategy; run as a script by test_lightning.py,
so that Lightning's own launcher starts the other ranks (it re-runs this script for local rank 1).

    python lightning_run.py train OUT          # W = 2: 3 steps (2 micro-batches each), then save OUT/ckpt
    python lightning_run.py resume OUT         # W = 1: fit(ckpt_path=OUT/ckpt) to step 5
    python lightning_run.py hybrid4 OUT        # W = 4: 5 steps under ZeroStrategy(shard_group_size=2) with
                                               # ZeroEMACallback, validation on the EMA; OUT/hybrid_ckpt
    python lightning_run.py hybrid_resume2 OUT # W = 2 (flat): fit(ckpt_path=OUT/hybrid_ckpt) to step 6, then
                                               # trainer.validate
    python lightning_run.py manual1 OUT        # W = 1: 4 steps with automatic, then manual optimization

Each rank writes OUT/<phase>_rank<r>.pt: the weights (after fit and, for a resume, right after the
restore), the micro-batches it saw, its losses and learning rates; with the EMA, the EMA weights and the
validation losses (sample ids, loss).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # else Lightning picks cores // local ranks threads: one, as the references use

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from chunkzero.lightning import ZeroEMACallback, ZeroStrategy  # noqa: E402
from torch_backend.train.gpt import GPT, GPTConfig  # noqa: E402

CFG = dict(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
BATCH, ACCUM, SAMPLES = 2, 2, 24  # 24 samples = 3 steps x 2 micro-batches x 2 ranks x 2 sequences
LR, CLIP = 1e-2, 0.5
DECAY = 0.9
VAL_IDS = (1000, 1001, 1002, 1003)


def sample(i: int) -> torch.Tensor:
    """Sample ``i``: 16 token ids, a pure function of ``i``."""
    return torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(10_000 + i))


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


class Samples(Dataset):
    def __init__(self, ids=range(SAMPLES)):
        self.ids = list(ids)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], sample(self.ids[i])


def loss_of(model, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, 256), torch.roll(x, -1, 1).reshape(-1))


class TinyGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**CFG))
        self.seen: list[list[int]] = []
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.restored: dict | None = None
        self.vals: list[tuple[list[int], float]] = []

    def training_step(self, batch, batch_idx):  # noqa: ARG002 - Lightning hook signature
        ids, x = batch
        self.seen.append(ids.tolist())
        loss = loss_of(self.model, x)
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ARG002 - Lightning hook signature
        ids, x = batch
        self.vals.append((ids.tolist(), loss_of(self.model, x).item()))

    def on_train_start(self):  # after a resume's restore: what the checkpoint gave back
        strategy = self.trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            return
        self.restored = {"state": strategy.model.state_dict(), "global_step": self.trainer.global_step,
                         "lr": [g["lr"] for g in self.trainer.optimizers[0].param_groups],
                         "optim_steps": strategy.zero_optimizer.step_count}

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        other = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                lr=LR, eps=1e-6)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ManualGPT(TinyGPT):
    """TinyGPT under manual optimization: the same steps, taken by ``training_step`` itself."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()


def manual(out: Path) -> None:
    """The same 4 steps with automatic and with manual optimization, one process."""
    results = {}
    for name, cls in (("auto", TinyGPT), ("manual", ManualGPT)):
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(chunk_size=3000), max_steps=4, **QUIET)
        module = cls()
        trainer.fit(module, DataLoader(Samples(range(4 * BATCH)), batch_size=BATCH, shuffle=False))
        results[name] = {"losses": module.losses, "lrs": module.lrs, "state": trainer.strategy.model.state_dict(),
                         "global_step": trainer.global_step}
    torch.save(results, out / "manual1_rank0.pt")


QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
             num_sanity_val_steps=0)
PHASES = {  # phase: (devices, max_steps, samples, ZeroStrategy's options, EMA, checkpoint to resume)
    "train": (2, 3, SAMPLES, {}, False, None),
    "resume": (1, 5, SAMPLES, {}, False, "ckpt"),
    "hybrid4": (4, 5, 80, {"shard_group_size": 2}, True, None),  # 80 = 5 steps x 2 micro-batches x 4 ranks x 2
    "hybrid_resume2": (2, 6, 80, {}, True, "hybrid_ckpt"),
}
SAVES = {"train": "ckpt", "hybrid4": "hybrid_ckpt"}


def main(phase: str, out: Path) -> None:
    if phase == "manual1":
        return manual(out)
    devices, max_steps, samples, options, ema, resume = PHASES[phase]
    strategy = ZeroStrategy(chunk_size=3000, **options)
    callback = ZeroEMACallback(DECAY, validate_on_ema=True) if ema else None
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=[callback] if ema else None,
                         max_steps=max_steps, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, **QUIET)
    module = TinyGPT()
    loader = DataLoader(Samples(range(samples)), batch_size=BATCH, shuffle=False)
    val_loader = DataLoader(Samples(VAL_IDS), batch_size=BATCH, shuffle=False) if ema else None
    trainer.fit(module, loader, val_loader, ckpt_path=None if resume is None else str(out / resume))
    if ema and resume is not None:
        trainer.validate(module, val_loader, verbose=False)  # after fit, on the EMA again
    result = {"state": strategy.model.state_dict(), "seen": module.seen, "losses": module.losses, "lrs": module.lrs,
              "world_size": strategy.world_size, "global_step": trainer.global_step, "vals": module.vals,
              "mixed_precision": strategy.model.mixed_precision, "max_norm": strategy.zero_optimizer.max_norm,
              "restored": module.restored, "replicas": strategy.model.replicas}
    if ema:
        with callback.ema.ema_weights():
            result["ema_state"] = strategy.model.state_dict()
        result["ema_updates"] = callback.ema.update_count
    if phase in SAVES:
        trainer.save_checkpoint(out / SAVES[phase])
        if phase == "train":
            trainer.save_checkpoint(out / "ckpt")  # again at the same step: replaced (rank 0 decides), then resumed
    torch.save(result, out / f"{phase}_rank{strategy.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
