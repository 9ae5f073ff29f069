"""Lightning with hybrid sharding and a sharded EMA: python examples/lightning_ema.py trains at 4 CPU ranks
(each chunk sharded over 2 of them, replicated twice), validating on the EMA weights, and saves; then
python examples/lightning_ema.py resume resumes it, EMA included, at 2 ranks (flat)."""
import sys

import lightning.pytorch as pl
import torch
from lightning_gpt import LitGPT  # examples/lightning_gpt.py
from torch.utils.data import DataLoader

from chunkzero.lightning import ZeroEMACallback, ZeroStrategy


class LitGPTWithVal(LitGPT):
    def validation_step(self, x, batch_idx):
        self.log("val_loss", self.training_step(x, batch_idx), sync_dist=True)

if __name__ == "__main__":
    resume = sys.argv[1:] == ["resume"]
    tokens = torch.randint(0, 256, (80, 33), generator=torch.Generator().manual_seed(0))
    train, val = DataLoader(tokens[:64], batch_size=4), DataLoader(tokens[64:], batch_size=4)
    ema = ZeroEMACallback(decay=0.9, validate_on_ema=True)  # validation runs on the EMA weights
    strategy = ZeroStrategy() if resume else ZeroStrategy(shard_group_size=2)  # 4 ranks = 2 shards x 2 replicas
    trainer = pl.Trainer(accelerator="cpu", devices=2 if resume else 4, strategy=strategy, callbacks=[ema],
                         max_steps=6 if resume else 4, val_check_interval=2, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(LitGPTWithVal(), train, val, ckpt_path="runs/lit-ema.ckpt" if resume else None)
    if trainer.is_global_zero:
        print(f"step {trainer.global_step}: EMA validation loss {trainer.callback_metrics['val_loss']:.4f}")
    if not resume:
        trainer.save_checkpoint("runs/lit-ema.ckpt")  # runs/lit-ema.ckpt/4/: the weights, Adam, the EMA
