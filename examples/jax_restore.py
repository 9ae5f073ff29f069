"""A checkpoint (runs/ckpt, e.g. from examples/train_loop.py) restored as JAX arrays on 4 devices.
On CPU, simulate the devices first: XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/jax_restore.py"""
from jax_backend import make_mesh, restore_chunks, unflatten

mesh = make_mesh(4)                                  # 1-D mesh, axis "shard" (AxisType.Auto)
chunks, layout = restore_chunks("runs/ckpt", mesh)   # chunk arrays, NamedSharding P('shard'), re-padded for 4
params = unflatten(chunks, layout)                   # params["transformer"]["wte"]["weight"]: (256, 64)
