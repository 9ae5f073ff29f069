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

from chunkzero.cli_args import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    OneLineParser,
    fail,
    nonneg_int,
    value_type,
)
from chunkzero.cli_layout import add_layout


def _outcome(results: list[dict]) -> tuple[int, str | None]:
    """The exit code and message of the workers' results (``torch_backend.train.worker.worker_main``): bad
    input (``"error"``, exit 2) first, then a run that could not go on (``"failed"``, exit 1)."""
    for status, code in (("error", EXIT_BAD_INPUT), ("failed", EXIT_FAILED)):
        for r in results:
            if r.get("status") == status:
                return code, r["message"]
    return EXIT_OK, None


# ================================================================================================ train

TORCHRUN_REPORT_GRACE_S = 1.0
"""Under torchrun, how long a rank other than 0 waits before it exits with the run's error (every rank has it, from
the ranks' exchange of verdicts): torchrun's agent stops the other ranks as soon as one exits with an error, and rank 0
prints the run's one line."""


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
                kwargs["type"] = value_type(kind, opt.problem)
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


def _without_torch(prog: str, what: str, error: ImportError) -> int:
    """The one-line error of a command part that needs torch when torch cannot be imported."""
    return fail(prog, f"{what} needs torch, which cannot be imported ({error}); "
                      "`chunkzero train --backend jax`, `inspect` and `layout` run without it")


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
    try:
        from torch_backend.train import launch as launcher  # lazily: imports torch
        from torch_backend.train.process_exit import exit_without_finalization_at_exit
        from torch_backend.train.resolve import validate
        from torch_backend.train.worker import launched_worker, worker_main
    except ImportError as e:
        return _without_torch(prog, "--backend torch", e)

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f, _ in option_fields()})
    hooks = tuple(on_step_end)

    if launcher.running_under_torchrun():
        import os

        code, message = _outcome([worker_main(cfg, hooks)])
        if code != EXIT_OK:
            if os.environ.get("RANK") == "0":
                fail(prog, message)
            else:  # torchrun's agent stops every rank once one exits with an error: rank 0 prints first
                time.sleep(TORCHRUN_REPORT_GRACE_S)
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
    from chunkzero.run_dir import stopped_run_checkpoints
    from chunkzero.workers import Stopped, signals_raise_stopped, stopped_message

    try:
        with signals_raise_stopped():  # until torch's agent installs its own (raising SignalException)
            results = launcher.launch(launched_worker, (cfg, hooks), cfg.nproc, timeout_s=cfg.timeout_s)
    except launcher.WorkerFailure as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Stopped as e:  # on a line of its own, after a progress bar
        print(f"\n{prog}: {stopped_message(e.signum, stopped_run_checkpoints(out))}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # torch's SignalException: its agent stopped the workers on a signal
        if type(e).__name__ == "SignalException":
            print(f"\n{prog}: {stopped_message(int(e.sigval), stopped_run_checkpoints(out))}", file=sys.stderr)
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

The options are chunkzero train's, so a train command line can be planned as it is; those a plan does not
use are accepted and not checked: the data options, --out, --resume and the run's reporting. --nproc is
the world size to plan for, on any number of nodes. Activations come from one micro-batch's
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
    except ImportError as e:
        return _without_torch(prog, "the memory plan (it traces the torch model)", e)
    try:
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
    p.add_argument("--step", type=nonneg_int, help="step under a checkpoint root (default: the latest)")
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
    p.add_argument("--step", type=nonneg_int, help="step under a checkpoint root (default: the latest)")
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


# ================================================================================================ parser

COMMANDS: list[Callable] = [_add_train, _add_plan, _add_export, _add_inspect, add_layout]
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
    """Run one sub-command; returns its exit status. A Ctrl-C that comes before a command handles its own
    stop signals (while torch or a checkpoint is still being imported) ends it with one line and 130."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` or a pager that quit: not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"\nchunkzero {args.command}: stopped by SIGINT (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
