"""ZeroDDP in your own training loop: python examples/train_loop.py (one process),
or torchrun --nproc-per-node N examples/train_loop.py (N ranks, each holding 1/N of every chunk)."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_backend import ZeroDDP, ZeroOptimizer, save_checkpoint
from torch_backend.train.gpt import GPT, gpt_config

if "RANK" in os.environ:
    dist.init_process_group()  # under torchrun: one process per rank (gloo on CPU, NCCL on GPUs)
torch.manual_seed(int(os.environ.get("RANK", 0)))  # each rank its own batches; ZeroDDP starts from rank 0's weights
model = ZeroDDP(GPT(gpt_config("gpt-tiny")), mixed_precision="bf16")  # chunk size searched (core)
no_decay = [p for p in model.module.parameters() if p.dim() < 2]        # biases, LayerNorm
optim = ZeroOptimizer(model, torch.optim.AdamW, lr=3e-3, max_norm=1.0,  # a torch.optim.Optimizer
                      param_groups=[{"params": no_decay, "weight_decay": 0.0}])  # the rest: the defaults
sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=3)
for step in range(1, 4):
    x = torch.randint(0, 256, (8, 64))                 # this rank's micro-batch
    loss = F.cross_entropy(model(x).float().flatten(0, 1), x.roll(-1, 1).flatten())
    optim.backward(loss)                               # the optimizer's backward: it scales an fp16 loss
    optim.step()
    optim.zero_grad()
    sched.step()
    print(f"step {step}: loss {loss.item():.3f}")
print(optim.memory_report())                          # bytes per device per kind on this rank
save_checkpoint("runs/ckpt", model, optim, step=3)    # every rank writes only its own shards
