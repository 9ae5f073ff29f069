"""The ``chunkzero`` command line. Each command imports its backend lazily.

Adding a command: write ``_add_<name>(sub)`` that creates its sub-parser and sets
``func=<handler>`` (a function ``(args) -> exit code``), then list it in :data:`COMMANDS`.
A handler reports bad input with :func:`fail` (one line on stderr, exit code 2).

This module imports no framework (torch, jax …) at import time, so ``chunkzero --help`` is fast
and ``import chunkzero`` stays framework-free.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr and exit code 2."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _outcome(results: list[dict]) -> tuple[int, str | None]:
    """The exit code and message of the workers' results (``torch_backend.train.worker.worker_main``): bad
    input (``"error"``, exit 2) first, then a run that could not go on (``"failed"``, exit 1)."""
    for status, code in (("error", EXIT_BAD_INPUT), ("failed", EXIT_FAILED)):
        for r in results:
            if r.get("status") == status:
                return code, r["message"]
    return EXIT_OK, None


def fail(prog: str, message: str) -> int:
    """Print ``<prog>: error: <message>`` as one line on stderr; return exit code 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _value_type(kind: type, problem: Callable[[Any], str | None]) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses ``kind`` (int or float) and refuses a value ``problem`` objects to
    (it returns why, e.g. ``"must be >= 1, got 0"``, or ``None``)."""
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        why = problem(v)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return v

    return parse


def _at_least(kind: type, minimum: float) -> Callable[[str], int | float]:
    """An argparse ``type=`` that parses ``kind`` and refuses values below ``minimum``."""
    return _value_type(kind, lambda v: None if v >= minimum else f"must be >= {minimum}, got {v}")


_positive_int = _at_least(int, 1)
_nonneg_int = _at_least(int, 0)


# ================================================================================================ train

def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One argument per option field of :class:`chunkzero.train_config.TrainConfig`, in its groups: the
    flag, default, choices, metavar and help come from the field (the help ends with the default), and
    numbers are checked against the field's bounds while parsing (``Option.problem``)."""
    from chunkzero.train_config import GROUPS, default_text, flag_of, option_fields, option_kind

    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for f, opt in option_fields():
        kind = option_kind(f)
        shown = default_text(f)
        text = opt.help.replace("%", "%%") + (f" (default: {shown.replace('%', '%%')})" if shown else "")
        kwargs: dict[str, Any] = {"dest": f.name, "help": text}
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(default=f.default, metavar=opt.metavar)
            if kind is list:
                kwargs["nargs"] = "+"
            elif opt.choices is not None:
                kwargs["choices"] = opt.choices
            elif kind in (int, float):
                kwargs["type"] = _value_type(kind, opt.problem)
        groups[opt.group].add_argument(flag_of(f), **kwargs)


TRAIN_EPILOG = """\
examples:
  chunkzero train                                   # the default run: stdlib source, gpt-mini, 2 CPU workers
  chunkzero train --data notes/ --steps 2000 --out runs/notes
  chunkzero train --model gpt-small --mixed-precision bf16 --nproc 8   # one worker per GPU
  chunkzero train --data train.bin --model ./my-hf-model               # nanoGPT tokens, a local HF model
  torchrun --nproc-per-node 8 -m chunkzero.cli train --model gpt2      # under torchrun: no relaunch
  torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST --master-port 29500 \\
      -m chunkzero.cli train --model gpt2                              # (and --node-rank 1 on the other)

defaults by device: --model, --mixed-precision and --lr default to one set of values on CPU and another on a
GPU (see each option above; both sets are chunkzero.train_config.CPU_DEFAULTS and GPU_DEFAULTS).
workers: one per GPU with NCCL, else 2 CPU processes with gloo (--nproc: at most one per GPU; on CPU more
workers than cores run oversubscribed with a warning, each with max(1, cores // workers) threads, up to 8
per core). Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) the command runs as that worker and --nproc is
ignored.
outputs in --out: metrics.jsonl, loss.png, sample.txt, summary.txt/.json, config.json, train.log.
exit codes: 0 done, 1 a worker failed (the message names the rank), a checkpoint save failed (a full disk:
the message names the step) or the run cannot make progress (--max-skipped-steps), 2 bad input, 130 interrupted.
"""


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model with chunk ZeRO-3 data parallelism (the main job)",
        description="Train a causal language model with chunk-based ZeRO-3 data parallelism on real text:\n"
                    "by default a byte-level GPT on the Python standard library's source, with 2 CPU workers\n"
                    "(or one per GPU). Every option is a field of chunkzero.train_config.TrainConfig.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_options(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace, *, on_step_end: Sequence[Callable] = ()) -> int:
    """``chunkzero train``: validate, then launch the workers (or be one, under torchrun).
    ``on_step_end``: hooks each worker's loop calls after every step (``torch_backend.train.loop.StepEnd``);
    they must be picklable to reach launched workers."""
    from chunkzero.errors import ChunkZeroError
    from chunkzero.train_config import TrainConfig, option_fields

    if getattr(args, "backend", "torch") == "jax":  # the JAX engine has its own launcher (no step hooks)
        from jax_backend.train.run import main as train_jax

        return train_jax(TrainConfig(**{f.name: getattr(args, f.name) for f, _ in option_fields()}))
    prog = "chunkzero train"
    from torch_backend.train import launch as launcher  # lazily: imports torch
    from torch_backend.train.process_exit import exit_without_finalization_at_exit
    from torch_backend.train.resolve import validate
    from torch_backend.train.worker import launched_worker, worker_main

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f, _ in option_fields()})
    hooks = tuple(on_step_end)

    if launcher.running_under_torchrun():
        import os

        code, message = _outcome([worker_main(cfg, hooks)])
        if code != EXIT_OK and os.environ.get("RANK") == "0":
            fail(prog, message)
        exit_without_finalization_at_exit(code)  # gloo's threads may still run: no finalization under them
        return code

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("chunkzero.cli")
    t0 = time.perf_counter()
    try:
        cfg, corpus = validate(cfg)
        if cfg.engine == "zero":  # the memory plan, before any worker starts and before --out is touched
            from torch_backend.plan import refuse_if_too_big

            planned, refused = refuse_if_too_big(cfg)
            if refused is not None and not cfg.force:
                return fail(prog, refused)
            cfg.planned_peak_bytes = planned.peak_bytes_per_rank
    except ChunkZeroError as e:
        return fail(prog, str(e))
    del corpus
    from pathlib import Path

    out = Path(cfg.out).resolve()  # the real folder, whatever the working directory
    log.info("chunkzero train: %d %s worker(s), output in %s", cfg.nproc, cfg.device, out)
    from chunkzero.workers import Stopped, signals_raise_stopped, stopped_message

    try:
        with signals_raise_stopped():  # until torch's agent installs its own (raising SignalException)
            results = launcher.launch(launched_worker, (cfg, hooks), cfg.nproc, timeout_s=cfg.timeout_s)
    except launcher.WorkerFailure as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Stopped as e:
        print(f"\n{prog}: {e}", file=sys.stderr)  # on a line of its own, after a progress bar
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # torch's SignalException: its agent stopped the workers on a signal
        if type(e).__name__ == "SignalException":
            print(f"\n{prog}: {stopped_message(int(e.sigval))}", file=sys.stderr)
            return 128 + int(e.sigval)
        raise
    code, message = _outcome(list(results.values()))
    if code != EXIT_OK:
        fail(prog, message)
        return code
    log.info("chunkzero train: done in %.1f s (including start-up); outputs in %s",
             time.perf_counter() - t0, out)
    return EXIT_OK


# ================================================================================================ plan

PLAN_EPILOG = """\
examples:
  chunkzero plan --model gpt2 --nproc 2 --batch-size 4 --seq-len 256          # each rank's peak, term by term
  chunkzero plan --model gpt2 --nproc 2 --batch-size 4 --seq-len 256 --json   # the same as JSON
  chunkzero plan --model gpt2-medium --device cuda --nproc 8 --batch-size 64 --seq-len 1024 --fit --memory 80GiB

The options are chunkzero train's (the data options are not used). Activations come from one micro-batch's
forward and backward of the real model on fake tensors (torch FakeTensorMode: no memory allocated).
--fit searches the batch (with gradient accumulation, the tokens per step kept), activation checkpointing,
the offload fractions (GPU) and more ranks for the fastest predicted step whose peak per rank fits --memory.
"""


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="predict each rank's peak memory of a chunkzero train run, term by term",
        description="Predict each rank's peak memory of `chunkzero train` with the same options: the interpreter "
                    "baseline, the parameter, gradient, master, optimizer and EMA shards, the gathered chunks, the "
                    "gradient buffers in flight, the activations (traced from the real model), the communication "
                    "buffers and the allocator's overhead; host memory, and device memory on a GPU.",
        epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_options(p)
    g = p.add_argument_group("plan")
    g.add_argument("--json", action="store_true", help="print the plan as JSON (with peak_bytes_per_rank)")
    g.add_argument("--fit", action="store_true",
                   help="search the settings for the fastest predicted step that fits --memory per rank")
    g.add_argument("--memory", metavar="SIZE", help="with --fit: the memory of one rank, e.g. 80GiB or 16GB")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """``chunkzero plan``: print the memory plan (or, with ``--fit``, the fastest setting that fits)."""
    import json

    from chunkzero.errors import ChunkZeroError
    from chunkzero.memory_plan import format_plan, parse_bytes
    from chunkzero.train_config import TrainConfig, option_fields

    prog = "chunkzero plan"
    if args.fit != (args.memory is not None):
        return fail(prog, "--fit and --memory go together (--fit --memory 80GiB)")
    try:
        budget = parse_bytes(args.memory) if args.memory is not None else None
    except ChunkZeroError as e:
        return fail(prog, f"--memory: {e}")
    if args.engine != "zero" or args.backend != "torch":
        return fail(prog, "the memory plan is ZeroDDP's: --engine zero --backend torch")
    try:
        from torch_backend.plan import fit_settings, plan_config, resolve_for_plan  # lazily: imports torch

        cfg = resolve_for_plan(TrainConfig(**{f.name: getattr(args, f.name) for f, _ in option_fields()}))
        plan = plan_config(cfg)
        best = None
        if budget is not None:
            best, _ = fit_settings(cfg, lambda q: q.peak_bytes_per_rank <= budget, max_world_size=cfg.world_size)
    except ChunkZeroError as e:
        return fail(prog, str(e))
    title = (f"{cfg.model} on {cfg.world_size} x {cfg.device}, {cfg.mixed_precision}, batch {cfg.batch_size} x "
             f"{cfg.seq_len}" + (f" x {cfg.grad_accum} micro-batches" if cfg.grad_accum > 1 else "")
             + (", activation checkpointing" if cfg.activation_checkpointing else "")
             + (", EMA" if cfg.ema_decay is not None else ""))
    if budget is None:
        print(json.dumps({"model": cfg.model, **plan.as_dict()}, indent=2) if args.json else format_plan(plan, title))
        return EXIT_OK
    if best is None:
        return fail(prog, f"no setting tried fits --memory {args.memory} per rank (the plan as given: "
                          f"{plan.peak_bytes_per_rank / 2**30:.2f} GiB)")
    if args.json:
        print(json.dumps({"model": cfg.model, "memory_bytes": budget, "step_time_s": best.step_time_s,
                          "zero_ddp": best.zero_ddp_kwargs(), "train_flags": best.describe(plan.settings),
                          **best.plan.as_dict()}, indent=2))
        return EXIT_OK
    print(format_plan(best.plan, title + f"; fastest setting within {args.memory} per rank: "
                                         f"{best.describe(plan.settings)}"))
    kwargs = ", ".join(f"{k}={v!r}" for k, v in best.zero_ddp_kwargs().items())
    print(f"\npredicted step {best.step_time_s:.3g} s; ZeroDDP(module, {kwargs})")
    return EXIT_OK


# ================================================================================================ export, inspect

def _add_export(sub) -> None:
    p = sub.add_parser(
        "export", help="chunk checkpoint -> Orbax parameter tree or Hugging Face safetensors (streaming)",
        description="Write a chunk checkpoint's parameters as full-shaped tensors named by module path, reading "
                    "one chunk at a time: an Orbax checkpoint of the nested parameter tree (restore it with "
                    "orbax.checkpoint.StandardCheckpointer().restore), or Hugging Face safetensors "
                    "(model.safetensors, or shards + model.safetensors.index.json; config.json for HF models).",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint root (latest step), one step's directory, or a "
                   "chunkzero train run folder (its checkpoints/)")
    p.add_argument("--format", required=True, choices=("orbax-params", "safetensors"), help="output format")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist, or be empty)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast floating tensors (default: as saved, fp32 masters)")
    p.add_argument("--step", type=_nonneg_int, help="step under a checkpoint root (default: the latest)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="safetensors: split into shards above this size, e.g. 5GB, 500MB (default %(default)s)")
    p.add_argument("--ema", action="store_true",
                   help="write the EMA weights a ZeroEMA saved (trainable tensors; frozen ones as saved)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """``chunkzero export``: stream a checkpoint's parameters to OUT."""
    from chunkzero.errors import ChunkZeroError

    try:
        from chunkzero.checkpoint.export import export_checkpoint  # lazily: imports orbax and tensorstore
        from chunkzero.run_dir import checkpoint_root

        t0 = time.perf_counter()
        r = export_checkpoint(checkpoint_root(args.checkpoint), args.out, format=args.format, dtype=args.dtype,
                              step=args.step, max_shard_size=args.max_shard_size, ema=args.ema)
    except ChunkZeroError as e:
        return fail("chunkzero export", str(e))
    print(
        f"exported step {r.step}{' (EMA weights)' if r.ema else ''}: {r.tensors} tensors, {r.total_bytes:,} bytes, "
        f"{r.format} -> {r.out} "
        f"({len(r.files)} files, {time.perf_counter() - t0:.1f} s)"
    )
    return EXIT_OK


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect", help="what a checkpoint holds (step, world size, chunks, tensors), without loading its arrays",
        description="Describe a chunk checkpoint from its metadata: step, world size, chunk size, optimizer, "
                    "chunks and tensors with dtypes and sizes. No array is read.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint root (latest step), one step's directory, or a "
                   "chunkzero train run folder (its checkpoints/)")
    p.add_argument("--step", type=_nonneg_int, help="step under a checkpoint root (default: the latest)")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.add_argument("--all", action="store_true", help="list every tensor (default: the first 50)")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``chunkzero inspect``: print a checkpoint's description."""
    import json

    from chunkzero.errors import ChunkZeroError

    try:
        from chunkzero.inspection import format_inspection, inspect_checkpoint

        info = inspect_checkpoint(args.checkpoint, args.step)
    except ChunkZeroError as e:
        return fail("chunkzero inspect", str(e))
    print(json.dumps(info, indent=2) if args.json else format_inspection(info, max_tensors=None if args.all else 50))
    return EXIT_OK


# ================================================================================================ layout

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


def _add_layout(sub) -> None:
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
    p.add_argument("--world-size", type=_positive_int, metavar="W",
                   help="data-parallel devices (default 8; with --nodes, N x G)")
    p.add_argument("--chunk-size", type=_positive_int, metavar="NUMEL",
                   help="chunk capacity in elements (default: searched to minimise padding and waste)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="parameter/gradient precision; fp32 masters and AdamW states either way (default %(default)s)")
    p.add_argument("--measure", action="store_true",
                   help="compile each strategy's step on W simulated devices and add the measured columns")
    p.add_argument("--batch-size", type=_positive_int, metavar="N",
                   help="global batch of the measured step, divisible by W (default: W)")
    p.add_argument("--seq-len", type=_positive_int, default=128, metavar="N",
                   help="tokens per sequence of the measured step (default %(default)s)")
    p.add_argument("--time-steps", type=_nonneg_int, default=0, metavar="N",
                   help="with --measure, also time N real steps (allocates the model: small models only)")
    p.add_argument("--plot", metavar="FILE", help="write the chunk map and per-device memory bars (PNG, PDF, SVG …)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    net = p.add_argument_group("two-level network (--nodes)")
    net.add_argument("--nodes", type=_positive_int, metavar="N", help="nodes: print the two-level communication table")
    net.add_argument(
        "--gpus-per-node", type=_positive_int, default=8, metavar="G", help="GPUs per node (default %(default)s)"
    )
    net.add_argument("--intra-gbps", type=_at_least(float, 1e-9), default=3600.0, metavar="GBIT",
                     help="intra-node bandwidth per GPU and direction, Gbit/s (default %(default)s: NVLink 450 GB/s)")
    net.add_argument("--inter-gbps", type=_at_least(float, 1e-9), default=400.0, metavar="GBIT",
                     help="inter-node bandwidth per GPU (its NIC) and direction, Gbit/s (default %(default)s)")
    net.add_argument("--intra-latency-us", type=_at_least(float, 0), default=1.0, metavar="US",
                     help="latency of one intra-node message step, µs (default %(default)s)")
    net.add_argument("--inter-latency-us", type=_at_least(float, 0), default=5.0, metavar="US",
                     help="latency of one inter-node message step, µs (default %(default)s)")
    net.add_argument("--algorithm", choices=("ring", "hierarchical"), default="ring",
                     help="all-gather / reduce-scatter algorithm; all-reduces are rings (default %(default)s)")
    net.add_argument("--tokens-per-gpu", type=_positive_int, metavar="N",
                     help="tokens per GPU per step: say whether each strategy is communication-bound there")
    net.add_argument("--mfu", type=_value_type(float, lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}"),
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


# ================================================================================================ parser

COMMANDS: list[Callable] = [_add_train, _add_plan, _add_export, _add_inspect, _add_layout]
"""Sub-command registrars, in ``--help`` order."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="chunkzero",
        description="Chunk-based ZeRO-3 training for PyTorch, with the sharded state shared exactly with JAX "
                    "through Orbax checkpoints.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from chunkzero import __version__

    parser.add_argument("--version", action="version", version=f"chunkzero {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` or a pager that quit: not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
