"""The memory plan of a `chunkzero train` run, from Python (a notebook's cell): each rank's predicted peak,
term by term, with and without activation checkpointing: python examples/memory_plan.py"""
from chunkzero.memory_plan import format_plan
from torch_backend.plan import plan

# the options are chunkzero train's, as keywords; activations are traced from the real model on fake tensors
p = plan("gpt2", nproc=2, batch_size=4, seq_len=256, device="cpu")
print(format_plan(p, "gpt2, 2 CPU ranks, 4 x 256 tokens each, fp32"))

ckpt = plan("gpt2", nproc=2, batch_size=4, seq_len=256, device="cpu", activation_checkpointing=True)
bf16 = plan("gpt2", nproc=2, batch_size=4, seq_len=256, device="cpu", mixed_precision="bf16", ema_decay=0.999)
for name, q in (("as above", p), ("activation checkpointing", ckpt), ("bf16 + EMA", bf16)):
    print(f"{name:26s} peak {q.peak_bytes_per_rank / 2**20:7,.0f} MiB per rank, "
          f"activations {q.host['activations'] / 2**20:5,.0f} MiB")
