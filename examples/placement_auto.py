"""Gemini's auto placement: a warm-up step traces the memory, then parameter shards move between host and
device by farthest next use within the budget. python examples/placement_auto.py (on CPU the budget is
simulated: host and device are the same memory, and the bytes a move would copy are counted)."""
import torch
import torch.nn.functional as F

from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend.train.gpt import GPT, gpt_config

torch.manual_seed(0)
model = ZeroDDP(GPT(gpt_config("gpt-tiny")), chunk_size=16384,  # small chunks: several to move
                placement="auto",                # Gemini's auto policy
                device_memory_bytes=None,        # default: the CUDA device's total memory (CPU: the RAM)
                steady_device_cap_ratio=0.9)     # share of it the plan may use
optim = ZeroOptimizer(model, torch.optim.AdamW, lr=3e-3)
ap = model.auto_placement
for step in range(4):
    x = torch.randint(0, 256, (4, 32))
    optim.backward(F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()))
    optim.step()
    optim.zero_grad()
    if step == 0:                                # traced: now give it room for half the parameter shards
        ap.budget_bytes = ap.budget_for_fraction(0.5)
print(f"budget {ap.budget_bytes:,} B; bytes moved per step: {ap.step_bytes_moved}")
