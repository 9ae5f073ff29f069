"""Fine-tune from a checkpoint into a model with a new head: python examples/load_modes.py."""
import torch
from torch import nn

from torch_backend import ZeroDDP, load_checkpoint, save_checkpoint
from torch_backend.train.gpt import GPT, gpt_config


class GPTWithHead(GPT):  # the pre-trained GPT plus a new classification head (SAT's mixin)
    def __init__(self, config, classes=3):
        super().__init__(config)
        self.cls_head = nn.Linear(config.n_embd, classes)

cfg = gpt_config("gpt-tiny")
torch.manual_seed(0)
pretrained = ZeroDDP(GPT(cfg))                                 # stands in for a pre-training run
save_checkpoint("runs/pretrained", pretrained, None, step=0)
model = ZeroDDP(GPTWithHead(cfg))
missing, unexpected = load_checkpoint("runs/pretrained", model, mode="finetune")  # any world size, chunk size
print(missing)  # ['cls_head.weight', 'cls_head.bias']: their init kept, the rest equals the checkpoint exactly
