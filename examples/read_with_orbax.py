"""Read a chunkzero checkpoint (runs/ckpt) with plain Orbax, without chunkzero installed.
XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/read_with_orbax.py"""
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

mngr = ocp.CheckpointManager(os.path.abspath("runs/ckpt"), item_handlers={  # Orbax wants absolute paths
    "state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
step = mngr.latest_step()
meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
tree = mngr.item_metadata(step)["state"]  # shapes and dtypes only: {"params": {"chunk_0000": ...}, "optim": ...}

# as numpy
as_numpy = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
state = mngr.restore(step, args=ocp.args.Composite(
    state=ocp.args.PyTreeRestore(restore_args=as_numpy)))["state"]

# sharded over any number of devices (each chunk zero-padded to a multiple of it)
mesh = Mesh(np.array(jax.devices()), ("shard",))
def on_mesh(m):
    size = -(-m.shape[0] // mesh.size) * mesh.size
    return ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P("shard")), global_shape=(size,), strict=False)
sharded = mngr.restore(step, args=ocp.args.Composite(
    state=ocp.args.PyTreeRestore(restore_args=jax.tree.map(on_mesh, tree))))["state"]

# one tensor by name: the layout in meta gives its chunk and offset
t = next(t for t in meta["layout"]["tensors"] if t["name"] == "transformer.wte.weight")
wte = state["params"][f"chunk_{t['chunk']:04d}"][t["offset"]:][: np.prod(t["shape"])].reshape(t["shape"])
