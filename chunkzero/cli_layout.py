"""``chunkzero layout``: chunk ZeRO-3 against per-parameter FSDP and DDP for a model and world size (the
cost model's prediction, ``--measure``'s compiled JAX steps, ``--nodes``' two-level network table)."""

from __future__ import annotations

import argparse
import sys

from chunkzero.cli_args import EXIT_OK, at_least, fail, nonneg_int, positive_int, value_type

LAYOUT_EPILOG = """\
examples:
  chunkzero layout --model hf-gpt2-medium --world-size 8               # the cost model's prediction
  chunkzero layout --model hf-gpt2-medium --world-size 8 --measure     # + compiled memory and HLO collectives
  chunkzero layout --model gpt-mini --world-size 2                     # the model chunkzero train trains by default
  chunkzero layout --model gpt-small --world-size 4 --measure --time-steps 3 --plot runs/layout.png
  chunkzero layout --model llama-7b --precision bf16 --nodes 16 --gpus-per-node 8 --inter-gbps 100
                                                      # flat ZeRO-3 vs hybrid (each S) vs hpZ vs DDP, two levels

--measure compiles each strategy's JAX training step for abstract inputs on W simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=W and JAX_PLATFORMS=cpu are set unless JAX_PLATFORMS
is already set); nothing is allocated. --time-steps runs real steps: small models only.

--nodes N --gpus-per-node G prints the two-level communication table instead (chunkzero.network_cost, no
framework imported): per step and rank, bytes on intra-node and inter-node links and the communication time
of flat ZeRO-3, hybrid sharding at every shard group size S dividing W = N*G (ZeroDDP(..., shard_group_size=S)),
ZeRO++ hpZ and DDP, and the tokens per GPU whose compute would hide it (H200 bf16 peak at --mfu).
"""


def add_layout(sub) -> None:
    p = sub.add_parser(
        "layout", help="compare chunk ZeRO-3 vs per-parameter FSDP vs DDP for a model and world size",
        description="Per-device memory, collectives, bytes sent and padding of chunk-based ZeRO-3, per-parameter "
                    "FSDP and DDP for one model and world size: the cost model's prediction, and with --measure "
                    "the compiled JAX training steps' memory_analysis() and HLO collectives next to it.",
        epilog=LAYOUT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from chunkzero.configs import GPT_CONFIGS, MODEL_CONFIGS

    byte_level = ", ".join(GPT_CONFIGS)
    others = ", ".join(n for n in MODEL_CONFIGS if n not in GPT_CONFIGS)
    p.add_argument("--model", default="hf-gpt2-medium", metavar="NAME",
                   help=f"a size-only model config of chunkzero.configs: {byte_level} (the byte-level GPTs, vocab "
                        f"256, as chunkzero train --model builds them), or {others} (Hugging Face GPT-2 small, medium "
                        "and XL, vocab 50257; Llama-style 1B, and the Llama 2 7B and 70B shapes) (default %(default)s)")
    p.add_argument("--world-size", type=positive_int, metavar="W",
                   help="data-parallel devices (default 8; with --nodes, N x G)")
    p.add_argument("--chunk-size", type=positive_int, metavar="NUMEL",
                   help="chunk capacity in elements (default: searched to minimise padding and waste)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="parameter/gradient precision; fp32 masters and AdamW states either way (default %(default)s)")
    p.add_argument("--measure", action="store_true",
                   help="compile each strategy's step on W simulated devices and add the measured columns")
    p.add_argument("--batch-size", type=positive_int, metavar="N",
                   help="global batch of the measured step, divisible by W (default: W)")
    p.add_argument("--seq-len", type=positive_int, default=128, metavar="N",
                   help="tokens per sequence of the measured step (default %(default)s)")
    p.add_argument("--time-steps", type=nonneg_int, default=0, metavar="N",
                   help="with --measure, also time N real steps (allocates the model: small models only)")
    p.add_argument("--plot", metavar="FILE", help="write the chunk map and per-device memory bars (PNG, PDF, SVG …)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    net = p.add_argument_group("two-level network (--nodes)")
    net.add_argument("--nodes", type=positive_int, metavar="N", help="nodes: print the two-level communication table")
    net.add_argument(
        "--gpus-per-node", type=positive_int, default=8, metavar="G", help="GPUs per node (default %(default)s)"
    )
    net.add_argument("--intra-gbps", type=at_least(float, 1e-9), default=3600.0, metavar="GBIT",
                     help="intra-node bandwidth per GPU and direction, Gbit/s (default %(default)s: NVLink 450 GB/s)")
    net.add_argument("--inter-gbps", type=at_least(float, 1e-9), default=400.0, metavar="GBIT",
                     help="inter-node bandwidth per GPU (its NIC) and direction, Gbit/s (default %(default)s)")
    net.add_argument("--intra-latency-us", type=at_least(float, 0), default=1.0, metavar="US",
                     help="latency of one intra-node message step, µs (default %(default)s)")
    net.add_argument("--inter-latency-us", type=at_least(float, 0), default=5.0, metavar="US",
                     help="latency of one inter-node message step, µs (default %(default)s)")
    net.add_argument("--algorithm", choices=("ring", "hierarchical"), default="ring",
                     help="all-gather / reduce-scatter algorithm; all-reduces are rings (default %(default)s)")
    net.add_argument("--tokens-per-gpu", type=positive_int, metavar="N",
                     help="tokens per GPU per step: say whether each strategy is communication-bound there")
    net.add_argument("--mfu", type=value_type(float, lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}"),
                     default=0.4, help="model FLOPs utilization of the H200's 989 TFLOP/s bf16 (default %(default)s)")
    p.set_defaults(func=cmd_layout)


def cmd_layout_network(args: argparse.Namespace) -> int:
    """``chunkzero layout --nodes N``: the two-level communication table (core only, no framework)."""
    import json

    from chunkzero.configs import model_specs
    from chunkzero.errors import ChunkZeroError
    from chunkzero.network_cost import H200_HBM_BYTES, Topology, compare_network, format_network_table
    from chunkzero.search import build_layout

    prog = "chunkzero layout"
    for flag, value in (("--measure", args.measure), ("--plot", args.plot), ("--time-steps", args.time_steps)):
        if value:
            return fail(prog, f"{flag} does not go with --nodes (the two-level table is a prediction only)")
    topo = Topology.from_gbps(args.nodes, args.gpus_per_node, args.intra_gbps, args.inter_gbps,
                              args.intra_latency_us, args.inter_latency_us)
    w = topo.world_size
    if args.world_size is not None and args.world_size != w:
        return fail(prog, f"--world-size {args.world_size} is not --nodes {args.nodes} x --gpus-per-node "
                          f"{args.gpus_per_node} = {w}")
    try:
        specs = model_specs(args.model)
        layout = build_layout(specs, w, args.chunk_size)
        rows = compare_network(specs, topo, layout=layout, precision=args.precision, algorithm=args.algorithm)
    except ChunkZeroError as e:
        return fail(prog, str(e))
    psi = layout.utilized_numel
    if args.json:
        print(json.dumps({"model": args.model, "topology": vars(topo) | {"world_size": w}, "precision": args.precision,
                          "algorithm": args.algorithm, "chunk_size": layout.chunk_size, "param_numel": psi,
                          "rows": [{"strategy": r.name, "shard_group_size": r.shard_group_size, "replicas": r.replicas,
                                    "intra_bytes": r.intra_bytes, "inter_bytes": r.inter_bytes, "time_s": r.time_s,
                                    "model_state_bytes": r.model_state_bytes,
                                    "collectives": sum(c.count for c in r.calls)} for r in rows]}, indent=2))
        return EXIT_OK
    print(
        f"{args.model} ({psi:,} parameters, {args.precision}), {args.nodes} x {args.gpus_per_node} GPUs = {w}, "
        f"chunk size {layout.chunk_size:,} ({len(layout.chunks)} chunks), {args.algorithm} all-gather/reduce-scatter; "
        f"intra {args.intra_gbps:g} Gbit/s {args.intra_latency_us:g} us, inter {args.inter_gbps:g} Gbit/s "
        f"{args.inter_latency_us:g} us per GPU; bytes per rank per step\n"
    )
    print(format_network_table(rows, psi, tokens_per_gpu=args.tokens_per_gpu, mfu=args.mfu, hbm_bytes=H200_HBM_BYTES))
    print(f"\n✗: model states above the H200's {H200_HBM_BYTES / 1e9:.0f} GB. tokens/GPU to hide: per step, at "
          f"{args.mfu:g} MFU of 989 TFLOP/s, 6 FLOPs per parameter and token.")
    return EXIT_OK


def _layout_argv(args: argparse.Namespace) -> list[str]:
    argv = ["layout", "--model", args.model, "--world-size", str(args.world_size), "--precision", args.precision,
            "--seq-len", str(args.seq_len), "--time-steps", str(args.time_steps)]
    for flag, value in (("--chunk-size", args.chunk_size), ("--batch-size", args.batch_size), ("--plot", args.plot)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--measure"] if args.measure else []) + (["--json"] if args.json else [])


def _simulated_devices_env(world_size: int, env: dict) -> dict:
    """``env`` with ``--xla_force_host_platform_device_count=world_size`` in XLA_FLAGS (replacing any
    other count) and JAX_PLATFORMS=cpu unless set."""
    import re

    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    env = dict(env)
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={world_size}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _unwritable_file(path: str) -> str | None:
    """Why file ``path`` cannot be written (its parents are created), or ``None``."""
    import os
    from pathlib import Path

    target = Path(path)
    if target.is_dir():
        return "is a directory"
    existing = next(p for p in target.absolute().parents if p.exists())
    if not existing.is_dir():
        return f"cannot be created: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"cannot be written: no write permission on {target if target.exists() else existing}"
    return None


def cmd_layout(args: argparse.Namespace) -> int:
    """``chunkzero layout``: print the comparison table (and measure / plot)."""
    import json
    import os
    import subprocess

    from chunkzero.configs import MODEL_CONFIGS
    from chunkzero.errors import ChunkZeroError

    prog = "chunkzero layout"
    if args.model not in MODEL_CONFIGS:
        return fail(prog, f"unknown model {args.model!r}; known: {', '.join(MODEL_CONFIGS)}")
    if args.nodes is not None:
        return cmd_layout_network(args)
    if args.world_size is None:
        args.world_size = 8
    if args.time_steps and not args.measure:
        return fail(prog, "--time-steps needs --measure")
    if args.batch_size is not None and args.batch_size % args.world_size:
        return fail(prog, f"--batch-size {args.batch_size} is not divisible by --world-size {args.world_size}")
    if args.plot and (why := _unwritable_file(args.plot)):
        return fail(prog, f"--plot {args.plot}: {why}")  # before any table is printed
    if args.measure:
        if "jax" in sys.modules:  # jax already initialised (e.g. called in-process): measure in a fresh process
            import jax

            if jax.device_count() < args.world_size:
                env = _simulated_devices_env(args.world_size, os.environ)
                return subprocess.run([sys.executable, "-m", "chunkzero.cli", *_layout_argv(args)], env=env).returncode
        else:
            os.environ.update(_simulated_devices_env(args.world_size, os.environ))
    try:
        from jax_backend.analysis import compare_layouts  # lazily: imports jax

        cmp = compare_layouts(args.model, args.world_size, chunk_size=args.chunk_size, precision=args.precision,
                              measure=args.measure, batch_size=args.batch_size, seq_len=args.seq_len,
                              time_steps=args.time_steps)
    except ChunkZeroError as e:
        return fail(prog, str(e))
    if args.json:
        print(json.dumps({"model": cmp.model, "world_size": cmp.world_size, "precision": cmp.precision,
                          "chunk_size": cmp.layout.chunk_size, "num_chunks": len(cmp.layout.chunks),
                          "batch_size": cmp.batch_size, "seq_len": cmp.seq_len,
                          "rows": [r.as_dict() for r in cmp.rows]}, indent=2))
    else:
        print(cmp.table())
    if args.plot:
        try:
            from pathlib import Path

            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)  # runs/layout.png on a fresh clone
            cmp.plot(args.plot)
        except (OSError, ValueError) as e:
            return fail(prog, f"cannot write plot {args.plot!r}: {e}")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return EXIT_OK
