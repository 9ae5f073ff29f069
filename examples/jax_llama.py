"""A Hugging Face Llama directory trained on the JAX engine, then resumed on torch at another world size:
python examples/jax_llama.py [DIR] (default runs/llama: the model in DIR/model, the run in DIR/run)."""
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/llama")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,  # tiny: seconds
                  num_attention_heads=4, num_key_value_heads=2,           # grouped-query: 2 query heads per K/V
                  max_position_embeddings=64, tie_word_embeddings=False,  # an untied head: lm_head.weight
                  bos_token_id=0, eos_token_id=0)                         # no tokenizer saved: bytes, 256 ids
LlamaForCausalLM(cfg).save_pretrained(root / "model", safe_serialization=True)  # stands in for a download


data = Path(sysconfig.get_paths()["stdlib"]) / "json"  # the json package's source: 46k bytes of text


def train(*args):  # the CLI, as a user runs it; both engines train the same stream from the same weights
    subprocess.run([sys.executable, "-m", "chunkzero.cli", "train", "--model", str(root / "model"),
                    "--data", str(data), "--seq-len", "32",
                    "--warmup", "2", "--eval-interval", "4", "--eval-batches", "2", "--sample-tokens", "16",
                    "--out", str(root / "run"), *args], check=True)


# 1. JAX: 1 process with 2 CPU devices (world size 2), 4 sequences each; checkpoints/4 under HF's tensor names
train("--backend", "jax", "--nproc", "1", "--devices-per-process", "2", "--batch-size", "4",
      "--steps", "4", "--save-interval", "4", "--overwrite")
# 2. torch ZeroDDP at world size 1: steps 5-8 from the JAX checkpoint, still 8 sequences a step (same stream)
train("--backend", "torch", "--nproc", "1", "--batch-size", "8", "--steps", "8", "--resume")
records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
print("train loss by step:", {step: round(loss, 3) for step, loss in losses.items()})
