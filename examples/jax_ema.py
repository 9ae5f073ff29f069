"""An EMA of the weights on the JAX ZeRO-3 step (jax_backend.ChunkEMA, torch ZeroEMA's twin), saved in the
checkpoint format torch resumes with its ZeroEMA. On CPU, simulate the devices first:
XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/jax_ema.py"""
import optax

from chunkzero import ChunkLayout
from jax_backend import ChunkEMA, ZeroTrainer, adamw_meta, gpt_config, make_mesh, restore_chunks, unflatten
from jax_backend.blocks import gpt_program, random_batch

program = gpt_program(gpt_config("gpt-tiny"))
layout = ChunkLayout.build(program.specs, 40_000, 4)             # chunks of 40k elements, sharded over 4 devices
hyper = dict(learning_rate=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
trainer = ZeroTrainer(program, layout, make_mesh(4), optax.adamw(**hyper), optimizer_meta=adamw_meta(**hyper))
state = trainer.init(program.init(0))
ema = ChunkEMA(trainer, state, decay=0.99, warmup=True)          # fp32, sharded as the master chunks
for i in range(5):
    state, loss = trainer.step(state, random_batch(program, 8, 32, seed=i))
    ema.update(state)                                            # after each applied step: ZeroEMA's update
ema_params = unflatten(ema.weights(state), layout)               # the EMA weights as a parameter tree
trainer.save_checkpoint("runs/jax-ema", state, step=5, ema=ema)  # the "ema" item, as torch's ZeroEMA saves it
ema_chunks, _ = restore_chunks("runs/jax-ema", make_mesh(2), item="ema")  # on any device count
