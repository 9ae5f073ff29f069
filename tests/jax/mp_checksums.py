"""One process of the multi-process checkpoint-checksum check (started by test_multiprocess.py through
chunkzero.workers.launch_processes): 2 processes × 2 CPU devices save a checkpoint (params and AdamW state)
at world size 4, restore it at 4 and at 3 devices (saved shards then straddle the processes), and once
process 0 flipped one byte of an optimizer-state array on disk, restore it again."""

import sys
from pathlib import Path

from chunkzero.workers import write_result

try:
    import jax
    import numpy as np

    from jax_backend.processes import all_gather_json, join_processes, process_mesh

    join_processes(2, 60.0)
    from jax.sharding import Mesh

    import jax_backend as jb
    from chunkzero import ChunkLayout, TensorSpec
    from chunkzero.checkpoint import CheckpointMeta, OptimizerMeta, chunk_key, read_meta
    from chunkzero.errors import CheckpointError
    from jax_backend.mesh import chunk_sharding

    root = Path(sys.argv[1])
    mesh = process_mesh()
    specs = [TensorSpec("a", (1000, 3)), TensorSpec("b", (37, 11)), TensorSpec("c", (7,))]
    layout = ChunkLayout.build(specs, 1200, 4, keep_gathered_below_numel=16)
    rng = np.random.default_rng(0)

    def whole(c):
        a = np.zeros(c.size, np.float32)
        a[:c.utilized] = rng.standard_normal(c.utilized).astype(np.float32)
        return a

    host = {("params", chunk_key(c.index)): whole(c) for c in layout.chunks}
    host.update({("optim", k, chunk_key(c.index)): np.abs(whole(c)) for k in ("exp_avg", "exp_avg_sq")
                 for c in layout.chunks if c.requires_grad})

    def on_mesh(path):
        c = layout.chunks[int(path[-1].split("_")[1])]
        a = host[path]
        return jax.make_array_from_callback(a.shape, chunk_sharding(mesh, c, "shard"), lambda i: a[i])

    chunks = {p[-1]: on_mesh(p) for p in host if p[0] == "params"}
    opt = {k: {p[-1]: on_mesh(p) for p in host if p[:2] == ("optim", k)} for k in ("exp_avg", "exp_avg_sq")}
    jb.save_checkpoint(root, chunks, layout, step=1, opt_state_chunks=opt,
                       optimizer_meta=OptimizerMeta("optax.adamw", {}, ["exp_avg", "exp_avg_sq"], 1))
    record = read_meta(root).checksums
    reference = CheckpointMeta(step=1, layout=layout).checksums_of_arrays(host)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    restored = {}
    for n in (4, 3):
        r = jb.restore_checkpoint(root, Mesh(np.array(devices[:n]), ("shard",)), with_optimizer=True)
        restored[n] = r.layout.world_size
    target = host[("optim", "exp_avg_sq", chunk_key(0))][700:704].tobytes()  # in saved shard 2 of 4
    all_gather_json(None)
    if jax.process_index() == 0:
        files = [f for f in (root / "1" / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
        hits = [(f, f.read_bytes().find(target)) for f in files]
        f, at = next((f, at) for f, at in hits if at >= 0)
        b = bytearray(f.read_bytes())
        b[at + 1] ^= 0x10
        f.write_bytes(bytes(b))
    all_gather_json(None)
    try:
        jb.restore_checkpoint(root, Mesh(np.array(devices[:3]), ("shard",)), with_optimizer=True)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    write_result({"status": "ok", "record_is_reference": record == reference, "restored": restored,
                  "refused": refused})
except Exception as e:  # the launcher shows this line
    write_result({"status": "error", "message": f"{type(e).__name__}: {e}"})
    raise
