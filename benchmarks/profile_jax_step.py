"""Where ``chunkzero train --backend jax``'s step spends its time: the step's pieces jitted and timed apart.

Builds the run's :class:`jax_backend.train.adapter.JaxAdapter` (gpt-mini, fp32, 16 × 128 tokens per
device, the defaults) on this process's mesh and times, per step (median of ``--repeats`` rounds of every
piece once, interleaved, after one warm-up call each; each call ``block_until_ready``):

- ``step``: the jitted ZeRO-3 step alone (``trainer.step_fn``, state donated), and the same with the
  other ``remat`` (a second trainer: each stage recomputed in backward, or not);
- ``loop step``: what the loop does per step: the batch built on the host and placed
  (``adapter.global_batch``), the step, the loss and gradient norm fetched (``adapter.step``);
- ``batch``: ``adapter.global_batch`` alone; ``fetch``: a float fetch of a step's output;
- ``compute floor``: forward + backward of the full (replicated) model on each device's batch, no
  collective, no optimizer (``jax.grad(program.loss_sum)`` in a ``shard_map``);
- ``gathers``: the all-gathers of one step (every sharded chunk, twice: forward and backward);
- ``reduce-scatters``: the reduce-scatters of one step (every sharded chunk's gradient buffer once);
- ``optimizer``: the AdamW update on the local fp32 shards (``tx.update`` + ``apply_updates``).

``--remat``: the step with each stage recomputed in backward (``--activation-checkpointing``; the JAX
step before issue 28). One process of ``--devices`` devices, or (under ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, see ``--spawn``) one of several. ``--threads N`` bounds
XLA:CPU's threads per process (:func:`jax_backend.processes.bound_cpu_threads`; 0: XLA's default).

    PYTHONPATH=. .venv/bin/python benchmarks/profile_jax_step.py --devices 2           # 1 process × 2 devices
    PYTHONPATH=. .venv/bin/python benchmarks/profile_jax_step.py --spawn 2             # 2 processes × 1 device
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _time_interleaved(pieces: dict, repeats: int) -> dict[str, list[float]]:
    """Each piece's seconds per call, ``repeats`` rounds of one call of every piece (after one warm-up call
    each), so a shared machine's drifting load hits all pieces alike."""
    for fn in pieces.values():
        fn()
    out: dict[str, list[float]] = {k: [] for k in pieces}
    for _ in range(repeats):
        for k, fn in pieces.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


def profile(devices: int, repeats: int, threads: int | None, model: str, remat: bool) -> dict:
    from jax_backend.processes import join_processes, process_mesh, process_place

    place = process_place()
    join_processes(devices, 120.0, place, threads=threads)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from chunkzero.train_config import CPU_DEFAULTS, TrainConfig
    from jax_backend.collectives import reduce_scatter_sum
    from jax_backend.train.adapter import JaxAdapter

    cfg = TrainConfig(**{**CPU_DEFAULTS, "model": model}, device="cpu", devices_per_process=devices,
                      activation_checkpointing=remat)
    mesh = process_mesh()
    adapter = JaxAdapter(cfg, mesh)
    tr = adapter.trainer
    axis = tr.axis
    world = int(mesh.devices.size)
    rng = np.random.default_rng(place.process_id)

    shape = (cfg.batch_size, cfg.seq_len)

    def rows():
        return {r: (rng.integers(0, 256, shape), rng.integers(0, 256, shape)) for r, _ in adapter.local_ranks}

    batch = adapter.global_batch(rows())
    pieces = {}

    def step_only(a=adapter):
        a.state, losses, norm = a.trainer.step_fn(a.state, batch)
        jax.block_until_ready((a.state, losses, norm))

    pieces["step"] = step_only
    other = JaxAdapter(dataclasses.replace(cfg, activation_checkpointing=not remat), mesh)
    pieces["step, remat " + ("off" if remat else "on")] = lambda: step_only(other)
    pieces["loop step"] = lambda: adapter.step(1, adapter.global_batch(rows()))
    pieces["batch"] = lambda: jax.block_until_ready(adapter.global_batch(rows()))
    _, losses, _norm = other.trainer.step_fn(jax.tree.map(jnp.copy, other.state), batch)
    pieces["fetch"] = lambda: float(np.asarray(adapter._sum(losses).addressable_data(0)))

    # compute floor: the full model replicated, grads of the local batch, no collective
    every = adapter.full_params()  # a collective
    full = jax.device_put({n: np.asarray(every[n]) for n in tr.unit_of}, NamedSharding(mesh, P()))
    prog = tr.program

    def floor_body(params, b):
        loss, g = jax.value_and_grad(prog.loss_sum)(params, b)
        return loss.reshape(1), g

    floor = jax.jit(jax.shard_map(floor_body, mesh=mesh, in_specs=(P(), {"idx": P(axis), "targets": P(axis)}),
                                  out_specs=(P(axis), P()), check_vma=False))
    pieces["compute floor"] = lambda: jax.block_until_ready(floor(full, batch))

    sharded = [k for k, u in tr.units.items() if u.sharded]
    master = {k: jnp.copy(adapter.state.master[k]) for k in sharded}  # the steps donate the state's own
    specs = {k: P(axis) for k in sharded}

    def gathers(m):  # each sharded chunk twice, as the step (forward and backward)
        out = {}
        for k, v in m.items():
            a = jax.lax.all_gather(v, axis, tiled=True)
            b = jax.lax.all_gather(v + a[0] * 0, axis, tiled=True)
            out[k] = (a[:1] + b[:1])
        return out

    g_fn = jax.jit(jax.shard_map(gathers, mesh=mesh, in_specs=(specs,), out_specs={k: P(axis) for k in sharded},
                                 check_vma=False))
    pieces["gathers"] = lambda: jax.block_until_ready(g_fn(master))

    def scatters(m):
        return {k: reduce_scatter_sum(jnp.tile(v, world), axis) for k, v in m.items()}

    rs_fn = jax.jit(jax.shard_map(scatters, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False))
    pieces["reduce-scatters"] = lambda: jax.block_until_ready(rs_fn(master))

    trainable = {k: jnp.copy(adapter.state.master[k]) for k in tr.trainable}
    grads = jax.tree.map(lambda x: x * 1e-3, trainable)
    opt_state = jax.tree.map(jnp.copy, adapter.state.opt_state)

    def opt(g, s, p):
        u, s = tr.tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    o_fn = jax.jit(opt)
    pieces["optimizer"] = lambda: jax.block_until_ready(o_fn(grads, opt_state, trainable))
    res = _time_interleaved(pieces, repeats)
    return {"process": place.process_id, "processes": jax.process_count(), "devices": devices, "world": world,
            "threads": threads, "remat": remat, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "tokens_per_step": world * cfg.batch_size * cfg.seq_len,
            "chunks": len(tr.units), "sharded_chunks": len(sharded),
            "ms": {k: [round(1000 * t, 2) for t in v] for k, v in res.items()}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1, help="CPU devices in this process")
    ap.add_argument("--spawn", type=int, default=0, help="start this many processes of --devices each and print theirs")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="bound XLA:CPU's threads per process (0: JAX's default)")
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--remat", action="store_true",
                    help="recompute each stage in backward (--activation-checkpointing)")
    args = ap.parse_args(argv)
    if args.spawn:
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES=str(args.spawn),
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, __file__, "--devices", str(args.devices), "--repeats", str(args.repeats), "--threads",
               str(args.threads), "--model", args.model] + (["--remat"] if args.remat else [])
        procs = [subprocess.Popen(cmd, env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE, text=True)
                 for i in range(args.spawn)]
        outs = [p.communicate(timeout=900)[0] for p in procs]
        for o in outs:
            print(o.strip().splitlines()[-1] if o.strip() else "{}")
        return max(p.returncode for p in procs)
    r = profile(args.devices, args.repeats, args.threads or None, args.model, args.remat)
    r["load"] = os.getloadavg()[0]
    r["median_ms"] = {k: round(statistics.median(v), 1) for k, v in r["ms"].items()}
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
