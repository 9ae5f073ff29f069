"""An EMA of the weights, used for evaluation and saved with the checkpoint: python examples/ema.py."""
import torch

from torch_backend import ZeroDDP, ZeroEMA, ZeroOptimizer, save_checkpoint
from torch_backend.train.gpt import GPT, GPTConfig

torch.manual_seed(0)
model = ZeroDDP(GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32, dropout=0.0)))
optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3)
ema = ZeroEMA(optim, decay=0.99)                  # optim.ema is now this EMA
x = torch.randint(0, 256, (4, 32))
for _ in range(5):
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten())
    optim.backward(loss)
    optim.step()
    optim.zero_grad()
with ema.ema_weights():                           # the EMA in the live shards; the live weights back on exit,
    ema_logits = model(x)                         # also on an exception; optim.step() in here raises
    ema_state = model.state_dict()
save_checkpoint("runs/ema-demo", model, optim, step=5)   # saves the EMA too: its own arrays, decay, update count
print(optim.memory_report().total("ema"), "bytes of EMA on this rank; updates:", ema.update_count)
