"""A plain LightningModule (no strategy, one process) from a chunkzero checkpoint, through an export:
python examples/lightning_gpt.py
chunkzero export runs/lit.ckpt --format safetensors runs/lit-export   # runs/lit-export/model.safetensors
python examples/lightning_load_export.py"""
import safetensors.torch
from lightning_gpt import LitGPT  # examples/lightning_gpt.py

lit = LitGPT()
lit.load_state_dict(safetensors.torch.load_file("runs/lit-export/model.safetensors"))  # all keys matched
