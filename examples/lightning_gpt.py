"""Lightning with ZeroStrategy: python examples/lightning_gpt.py (2 CPU ranks: Lightning starts the second),
then python examples/lightning_gpt.py resume (1 rank, from the 2-rank checkpoint)."""
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from chunkzero.lightning import ZeroStrategy
from torch_backend.train.gpt import GPT, gpt_config


class LitGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT(gpt_config("gpt-tiny"))

    def training_step(self, x, batch_idx):  # noqa: ARG002 (Lightning's signature)
        logits = self.model(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

if __name__ == "__main__":
    resume = sys.argv[1:] == ["resume"]
    data = DataLoader(torch.randint(0, 256, (64, 33), generator=torch.Generator().manual_seed(0)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1 if resume else 2, strategy=ZeroStrategy(), precision="bf16-mixed",
                         max_steps=6 if resume else 4, accumulate_grad_batches=2, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(LitGPT(), data, ckpt_path="runs/lit.ckpt" if resume else None)  # resume: world size 2 -> 1
    if not resume:
        trainer.save_checkpoint("runs/lit.ckpt")  # a directory, sharded: runs/lit.ckpt/4/
