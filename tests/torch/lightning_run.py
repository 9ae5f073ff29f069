"""A tiny GPT trained by Lightning's Trainer through ZeroStrategy; run as a script by test_lightning.py,
so that Lightning's own launcher starts the other ranks (it re-runs this script for local rank 1).

    python lightning_run.py train OUT    # W = 2: 3 steps (2 micro-batches each), then save OUT/ckpt
    python lightning_run.py resume OUT   # W = 1: fit(ckpt_path=OUT/ckpt) to step 5

Each rank writes OUT/<phase>_rank<r>.pt: the weights (after fit and, for resume, right after the
restore), the micro-batches it saw, its losses and learning rates.
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

from chunkzero.lightning import ZeroStrategy  # noqa: E402
from torch_backend.train.gpt import GPT, GPTConfig  # noqa: E402

CFG = dict(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
BATCH, ACCUM, SAMPLES = 2, 2, 24  # 24 samples = 3 steps x 2 micro-batches x 2 ranks x 2 sequences
LR, CLIP = 1e-2, 0.5


def sample(i: int) -> torch.Tensor:
    """Sample ``i``: 16 token ids, a pure function of ``i``."""
    return torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(10_000 + i))


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


class Samples(Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return i, sample(i)


class TinyGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**CFG))
        self.seen: list[list[int]] = []
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.restored: dict | None = None

    def training_step(self, batch, batch_idx):
        ids, x = batch
        self.seen.append(ids.tolist())
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, 256), torch.roll(x, -1, 1).reshape(-1))
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def on_train_start(self):  # after a resume's restore: what the checkpoint gave back
        strategy = self.trainer.strategy
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


def main(phase: str, out: Path) -> None:
    devices, max_steps = (2, 3) if phase == "train" else (1, 5)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=ZeroStrategy(chunk_size=3000),
                         max_steps=max_steps, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    module = TinyGPT()
    loader = DataLoader(Samples(), batch_size=BATCH, shuffle=False)
    trainer.fit(module, loader, ckpt_path=None if phase == "train" else str(out / "ckpt"))
    strategy = trainer.strategy
    result = {"state": strategy.model.state_dict(), "seen": module.seen, "losses": module.losses, "lrs": module.lrs,
              "world_size": strategy.world_size, "mixed_precision": strategy.model.mixed_precision,
              "max_norm": strategy.zero_optimizer.max_norm, "global_step": trainer.global_step}
    if phase == "train":
        trainer.save_checkpoint(out / "ckpt")
        trainer.save_checkpoint(out / "ckpt")  # again at the same step: replaced (rank 0 decides), then resumed
    else:
        result["restored"] = module.restored
    torch.save(result, out / f"{phase}_rank{strategy.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
