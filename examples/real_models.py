"""Real models: full fine-tuning from pretrained weights built on the meta device, then LoRA.
python examples/real_models.py (one process), or torchrun --nproc-per-node N examples/real_models.py."""
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import GPT2Config, GPT2LMHeadModel

from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend.checkpoint.pretrained import load_pretrained

if "RANK" in os.environ:
    dist.init_process_group()  # under torchrun: one process per rank
cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512,  # tiny, runs in seconds; GPT2Config(): GPT-2 small
                 bos_token_id=511, eos_token_id=511)             # special tokens inside the small vocabulary
if int(os.environ.get("RANK", 0)) == 0:
    GPT2LMHeadModel(cfg).save_pretrained("runs/gpt2")  # stands in for a downloaded checkpoint directory
if dist.is_initialized():
    dist.barrier()
ids = torch.randint(0, cfg.vocab_size, (4, 64))     # this rank's micro-batch

# 1. Full fine-tuning from pretrained weights, without ever building the whole model on a rank
with torch.device("meta"):
    hf = GPT2LMHeadModel(cfg)                         # shapes only, no memory
hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model = ZeroDDP(hf, device="cpu", param_init_fn=lambda m: None)  # materialized chunk by chunk, left empty
load_pretrained(model, "runs/gpt2")                   # each rank reads only the ranges its shards hold
decay = [p for p in hf.parameters() if p.dim() >= 2]  # nanoGPT: weight decay on matrices only
other = [p for p in hf.parameters() if p.dim() < 2]   # biases and LayerNorm: no decay, half the LR
optim = ZeroOptimizer(model, torch.optim.AdamW, lr=3e-4, eps=1e-6, param_groups=[
    {"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": 1.5e-4}])
sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 100))  # warm-up
for _ in range(3):
    optim.backward(model(input_ids=ids, labels=ids).loss)
    optim.step()
    optim.zero_grad()
    sched.step()

# 2. LoRA: peft freezes the base, whose chunks then keep only their shard, in the dtype the base came in
lora = get_peft_model(GPT2LMHeadModel.from_pretrained("runs/gpt2"), LoraConfig(
    r=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))  # GPT-2's Conv1D is (in, out)
lora.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
lora_model = ZeroDDP(lora, mixed_precision="bf16")
lora_optim = ZeroOptimizer(lora_model, torch.optim.AdamW, lr=1e-3)  # steps the adapters only
for _ in range(3):
    lora_optim.backward(lora_model(input_ids=ids, labels=ids).loss)
    lora_optim.step()
    lora_optim.zero_grad()
print(lora_optim.memory_report())                   # no fp32 master, gradient or state for the base
adapters = get_peft_model_state_dict(lora, state_dict=lora_model.state_dict())  # full fp32, every rank
