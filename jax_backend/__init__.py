"""JAX/Flax backend: the chunk layout as sharded ``jax.Array`` s, chunkzero checkpoints through
Orbax on any device count, a Flax NNX GPT identical to the torch one, and the ZeRO-3 step in JAX.

```python
from jax_backend import make_mesh, restore_chunks, unflatten
mesh = make_mesh(4)                                    # 1-D mesh, axis "shard", AxisType.Auto
chunks, layout = restore_chunks("runs/ckpt/100", mesh) # 1-D chunk arrays, NamedSharding P('shard')
params = unflatten(chunks, layout)                     # nested dict of full-shaped arrays
```

Modules: ``mesh`` (the data-parallel mesh), ``layout`` (chunk arrays <-> tensors), ``optim`` (torch
AdamW state as optax state), ``checkpoint`` (save / restore), ``gpt`` (the Flax model), ``convert``
(torch names, chunks, checkpoints and Hugging Face GPT-2 -> the Flax model), ``blocks`` (models as
stages), ``schedule`` (the sharded step over gather units), ``zero`` (chunk ZeRO-3 on it), ``ema``
(an EMA of its master chunks, torch ``ZeroEMA``'s),
``baselines`` (per-parameter FSDP and DDP on it), ``analysis`` (the three measured against the cost
model).
"""

from .analysis import compare_layouts, count_collectives
from .baselines import DDPTrainer, FSDPTrainer
from .checkpoint import (
    RestoredCheckpoint,
    abstract_state,
    restore_checkpoint,
    restore_chunks,
    restore_optimizer_chunks,
    save_checkpoint,
)
from .convert import (
    check_layout,
    flax_to_torch,
    gpt_from_chunks,
    gpt_from_torch,
    hf_gpt2_config,
    hf_gpt2_to_flax,
    hf_gpt2_to_torch,
    load_hf_gpt2,
    param_specs,
    restore_gpt,
    torch_to_flax,
)
from .ema import ChunkEMA
from .gpt import GPT, GPT_CONFIGS, GPTConfig, gpt_config, init_gpt, logits
from .layout import flatten, flatten_optimizer, nest, shard_chunks, unflatten, unflatten_optimizer
from .mesh import DEFAULT_AXIS, chunk_sharding, make_mesh, mesh_world_size
from .optim import adam_state_from_chunks, adam_state_to_chunks, adamw_from_meta, adamw_meta, adamw_step
from .schedule import TrainState
from .zero import ZeroTrainer

__all__ = [
    "ChunkEMA",
    "DDPTrainer",
    "FSDPTrainer",
    "TrainState",
    "ZeroTrainer",
    "compare_layouts",
    "count_collectives",
    "DEFAULT_AXIS",
    "GPT",
    "GPTConfig",
    "GPT_CONFIGS",
    "RestoredCheckpoint",
    "abstract_state",
    "adam_state_from_chunks",
    "adam_state_to_chunks",
    "adamw_from_meta",
    "adamw_meta",
    "adamw_step",
    "check_layout",
    "chunk_sharding",
    "flatten",
    "flatten_optimizer",
    "flax_to_torch",
    "gpt_config",
    "gpt_from_chunks",
    "gpt_from_torch",
    "hf_gpt2_config",
    "hf_gpt2_to_flax",
    "init_gpt",
    "logits",
    "hf_gpt2_to_torch",
    "load_hf_gpt2",
    "make_mesh",
    "mesh_world_size",
    "nest",
    "param_specs",
    "restore_checkpoint",
    "restore_chunks",
    "restore_gpt",
    "restore_optimizer_chunks",
    "save_checkpoint",
    "shard_chunks",
    "torch_to_flax",
    "unflatten",
    "unflatten_optimizer",
]
