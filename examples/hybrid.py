"""Hybrid sharding: torchrun --nproc-per-node 4 examples/hybrid.py (2 shard groups of 2 ranks, gloo on CPU)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from chunkzero.process_exit import exit_without_finalization
from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend.train.gpt import GPT, gpt_config

dist.init_process_group("gloo")
torch.manual_seed(0)
model = ZeroDDP(GPT(gpt_config("gpt-tiny")), shard_group_size=2)
optim = ZeroOptimizer(model, torch.optim.AdamW, lr=3e-3)
for _ in range(3):
    x = torch.randint(0, 256, (4, 32))
    optim.backward(F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()))
    optim.step()
    optim.zero_grad()
stats = model.collective_stats
print(f"rank {dist.get_rank()}: S={model.shard_group_size} R={model.replicas} "
      f"intra {stats['intra_sent_bytes']:,} B, inter {stats['inter_sent_bytes']:,} B sent")
dist.destroy_process_group()
# gloo's threads outlive the group and can abort an interpreter that finalizes under them (chunkzero.process_exit)
exit_without_finalization(0)
