"""The settings of a ``chunkzero train`` run: plain data, the single source of the CLI's options.

:class:`TrainConfig` is a dataclass. Every user setting is a field made by :func:`option`, whose
:class:`Option` metadata holds what ``chunkzero train --help`` shows and what a value must satisfy:
help text, option group, flag, metavar, choices and lower bound. ``chunkzero.cli`` turns each such
field into one argparse argument (:func:`option_fields` lists them, :func:`option_kind` gives the
value's type, :func:`default_text` the default as ``--help`` names it), so a default, a help text or a
choice lives in this file only. The fields made by :func:`resolved` are not options: the torch
backend fills them in when it checks a run on the machine (``torch_backend.train.resolve.validate``).

:meth:`TrainConfig.check` raises for every value that is wrong whatever the machine (a choice not
offered, a number below its bound, two settings that exclude each other); the checks that need the
machine (devices, model, data) are the backend's. :func:`lr_at` is the learning-rate schedule, and
:func:`warn_schedule_change` what ``--resume`` says when it changes mid-run.

Defaults by device, in one place: ``--model``, ``--mixed-precision`` and ``--lr`` are ``None`` until the
run's device is known; :data:`CPU_DEFAULTS` and :data:`GPU_DEFAULTS` give their values and
:func:`with_device_defaults` fills them in (``torch_backend.train.resolve.validate`` calls it).

Imports the standard library only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
ENGINES = ("zero", "ddp")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("keep", "stretch")
BACKENDS = ("torch", "jax")

CPU_DEFAULTS = {"model": "gpt-mini", "mixed_precision": "fp32", "lr": 3e-3}
"""What ``--model``, ``--mixed-precision`` and ``--lr`` default to on a machine without a GPU: a byte-level
GPT of 1.7 M parameters (2 layers, width 256) that spans 8 chunks at the searched chunk size on 2 workers
(9 on 3), in fp32."""
GPU_DEFAULTS = {"model": "gpt2", "mixed_precision": "bf16", "lr": 6e-4}
"""... and with ``--device cuda`` (or ``auto`` on a machine with a GPU): the byte-level GPT-2 124M shape
(12 layers, width 768; 86 M parameters with the 256-token vocabulary) in bf16, at GPT-2's learning rate."""
SEED_MAX = 2**63 - 1
"""The largest ``--seed``: each rank seeds torch with ``seed + 1 + rank``, which must stay below 2**64."""
GROUPS = ("data", "model", "optimization", "workers", "reporting", "checkpoints")
"""The option groups of ``chunkzero train --help``, in order."""


@dataclass(frozen=True)
class Option:
    """How one :class:`TrainConfig` field is offered on the command line.

    Attributes:
        help: what the option does; ``--help`` appends the default (see :func:`default_text`).
        group: one of :data:`GROUPS`.
        flag: the option's name (default ``--`` + the field name with ``-`` for ``_``).
        metavar: the value's placeholder in ``--help``.
        choices: the allowed values, if only some are.
        minimum: the smallest allowed value (inclusive), for numbers.
        maximum: the largest allowed value (inclusive), for numbers.
        above: the value must be greater than this (exclusive bound), for numbers.
        below: the value must be less than this (exclusive bound), for numbers.
        default_help: how ``--help`` names the default when the value alone would not say it
            (a ``None`` that means "searched", "one per GPU" ...).
    """

    help: str
    group: str
    flag: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    below: float | None = None
    default_help: str | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not allowed (``"must be >= 1, got 0"``), or ``None`` when it is."""
        if value is None or isinstance(value, bool):
            return None
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, got {value!r}"
        if self.minimum is not None and value < self.minimum:
            return f"must be >= {self.minimum}, got {value}"
        if self.maximum is not None and value > self.maximum:
            return f"must be <= {self.maximum}, got {value}"
        if self.above is not None and not value > self.above:
            return f"must be > {self.above}, got {value}"
        if self.below is not None and not value < self.below:
            return f"must be < {self.below}, got {value}"
        return None


def option(default: Any, help: str, group: str, **kwargs: Any) -> Any:
    """A :class:`TrainConfig` field offered as a ``chunkzero train`` option (``kwargs``: see :class:`Option`)."""
    return field(default=default, metadata={"option": Option(help, group, **kwargs)})


def resolved(help: str, default: Any = None) -> Any:
    """A :class:`TrainConfig` field that is no option: filled in when the run is checked on its machine."""
    return field(default=default, metadata={"resolved": help})


@dataclass
class TrainConfig:
    """Every setting of a run; the defaults are ``chunkzero train``'s.

    Units: ``batch_size`` is sequences per rank per micro-batch; ``seq_len`` tokens; one step is
    ``grad_accum`` micro-batches on every rank, i.e. ``world_size · grad_accum · batch_size · seq_len``
    tokens; ``chunk_size`` is in elements; ``timeout_s`` is the collective timeout in seconds.
    """

    # data
    data: list[str] | None = option(
        None, "text files, directories of them (searched recursively; binary files skipped), or one "
              "pre-tokenized uint16 .bin file (nanoGPT format; a train.bin uses a val.bin beside it)",
        "data", metavar="PATH", default_help="the *.py files of Python's standard library, about 12 MB")
    val_fraction: float = option(
        0.05, "fraction of files (by a hash of their path) held out for validation", "data", metavar="F", above=0,
        below=1)
    # model
    model: str | None = option(
        None, "byte-level GPT size (gpt-tiny, gpt-mini, gpt-small, gpt2, gpt2-medium) or a local Hugging Face "
              "causal-LM directory (config.json + safetensors; its tokenizer is used if present)",
        "model", metavar="NAME|DIR", default_help=f"{CPU_DEFAULTS['model']} on CPU, {GPU_DEFAULTS['model']} (the "
                                                  "GPT-2 124M shape) on a GPU")
    mixed_precision: str | None = option(
        None, "parameter/compute precision; bf16 and fp16 keep fp32 master chunks, fp16 adds dynamic loss "
              "scaling", "model", choices=PRECISIONS,
        default_help=f"{CPU_DEFAULTS['mixed_precision']} on CPU, {GPU_DEFAULTS['mixed_precision']} on a GPU "
                     "(fp16 on one older than compute capability 8.0)")
    chunk_size: int | None = option(
        None, "chunk size in elements", "model", metavar="NUMEL", minimum=1,
        default_help="searched to minimise padding")
    shard_group_size: int | None = option(
        None, "hybrid sharding: shard each chunk over groups of S consecutive workers (a node's GPUs) and "
              "replicate it across the world/S groups; must divide the world size; 1 is DDP with chunked "
              "buckets", "model", metavar="S", minimum=1, default_help="the world size: flat ZeRO-3")
    prefetch: int = option(1, "chunks gathered ahead of their use (ZeroDDP's prefetch)", "model", metavar="N",
                           minimum=0)
    offload_optim_frac: float = option(
        0.0, "on a GPU, the share of chunks whose fp32 master, gradient and optimizer state live on the host "
             "(ZeroDDP's static placement)", "model", metavar="F", minimum=0, maximum=1)
    offload_param_frac: float = option(
        0.0, "on a GPU, the share of chunks whose parameter shard lives on the host", "model", metavar="F", minimum=0,
        maximum=1)
    activation_checkpointing: bool = option(
        False, "recompute each transformer block's activations in backward (torch.utils.checkpoint; JAX: each "
               "stage of the step)", "model")
    engine: str = option(
        "zero", "zero: chunk ZeRO-3 (ZeroDDP + ZeroOptimizer); ddp: plain PyTorch DDP + AdamW in fp32, a "
                "baseline for comparison", "model", choices=ENGINES)
    # optimization
    steps: int = option(750, "optimizer steps", "optimization", metavar="N", minimum=1)
    batch_size: int = option(16, "sequences per worker per micro-batch", "optimization", metavar="N", minimum=1)
    seq_len: int = option(128, "tokens per sequence, at most the model's block size", "optimization",
                          metavar="N", minimum=1)
    grad_accum: int = option(1, "micro-batches per optimizer step", "optimization", metavar="N", minimum=1)
    lr: float | None = option(None, "peak learning rate of AdamW", "optimization", metavar="F", above=0,
                              default_help=f"{CPU_DEFAULTS['lr']:g} on CPU, {GPU_DEFAULTS['lr']:g} on a GPU")
    warmup: int = option(30, "linear warm-up steps, then cosine decay to lr × --min-lr-ratio", "optimization",
                         metavar="N", minimum=0)
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of --lr", "optimization", metavar="F",
                                 minimum=0, maximum=1)
    weight_decay: float = option(0.1, "AdamW weight decay", "optimization", metavar="F", minimum=0)
    max_norm: float = option(1.0, "gradient clipping by global norm; 0 disables", "optimization", metavar="F",
                             minimum=0)
    max_skipped_steps: int = option(
        10, "stop the run with an error after this many steps in a row skipped for non-finite gradients at the "
            "minimum loss scale (fp16 that cannot make progress; bf16 and fp32 always run at scale 1, their "
            "minimum); 0 never stops", "optimization", metavar="N", minimum=0)
    ema_decay: float | None = option(
        None, "keep an fp32 EMA of the weights with this decay (torch's ZeroEMA, JAX's ChunkEMA: sharded beside "
              "the optimizer state, checkpointed in one format both engines resume), evaluate it beside the live "
              "weights at each evaluation and plot both; with --resume this value replaces the checkpoint's "
              "decay (its EMA weights are kept), and without it the checkpoint's EMA is dropped",
        "optimization", metavar="F", minimum=0, below=1, default_help="no EMA")
    ema_warmup: bool = option(
        False, "with --ema-decay: warm the EMA up, using min(decay, (1 + n) / (10 + n)) at its n-th update (ZeroEMA's "
               "warmup=True), so the early weights, close to the random initialization, fade out fast",
        "optimization")
    seed: int = option(1337, "seed of the initialisation and the data stream; the same seed and world size give "
                             "the same loss sequence, bit for bit, on the same kind of machine (CPU model or GPU, "
                             "torch build)", "optimization", metavar="N", minimum=0, maximum=SEED_MAX)
    # workers
    nproc: int | None = option(None, "workers to launch on this machine (ignored under torchrun)", "workers",
                               metavar="N", minimum=1, default_help="one per GPU, or 2 on CPU")
    device: str = option("auto", "auto: CUDA when available, else CPU", "workers", choices=DEVICES)
    backend: str = option(
        "torch", "the engine: torch (ZeroDDP workers over gloo/NCCL) or jax (the same chunk ZeRO-3 step in JAX: "
                 "--nproc processes joined by jax.distributed, CPU only); both read and write the same checkpoints",
        "workers", choices=BACKENDS)
    devices_per_process: int = option(
        1, "--backend jax: CPU devices of each JAX process; the run's world size is --nproc × this", "workers",
        metavar="K", minimum=1)
    timeout_s: float = option(
        45.0,
        "collective timeout: a worker waiting longer for the others (in a collective, or in a checkpoint "
        "save's barriers and commit) gives up, so a dead worker ends the run",
        "workers",
        flag="--timeout",
        metavar="SECONDS",
        above=0,
    )
    force: bool = option(
        False, "start the run even where the memory plan (chunkzero plan) predicts that it does not fit this "
               "machine's available memory (or its GPU's free memory)", "workers")
    # reporting
    out: str | None = option(None, "output directory; refused if it holds another run unless --overwrite",
                             "reporting", metavar="DIR", default_help="a fresh runs/<YYYYmmdd-HHMMSS>")
    overwrite: bool = option(False, "replace the run already in --out (removes its metrics, plots, logs and "
                                    "checkpoints)", "reporting")
    eval_interval: int = option(100, "validation loss every K steps, and at step 0 and the last step",
                                "reporting", metavar="K", minimum=1)
    eval_batches: int = option(8, "validation micro-batches per worker at the run's first session: its set of N × "
                                  "--batch-size × workers sequences stays the run's at every resume, at any world "
                                  "size", "reporting", metavar="N", minimum=1)
    prompt: str = option("def ", "prompt of the text sample at the end", "reporting", metavar="TEXT")
    sample_tokens: int = option(200, "tokens to sample at the end; 0 skips the sample", "reporting", metavar="N",
                                minimum=0)
    temperature: float = option(0.8, "sampling temperature", "reporting", metavar="F", above=0)
    top_k: int | None = option(40, "sample among the K most likely tokens", "reporting", metavar="K", minimum=1)
    # checkpoints
    save_interval: int = option(
        0, "every N steps and at the last step, save an Orbax checkpoint (sharded, asynchronous) to "
           "--out/checkpoints/<step>, keeping the newest --keep; 0 saves none", "checkpoints", metavar="N", minimum=0)
    keep: int = option(3, "keep the newest N checkpoints, and the newest one saved with a finite loss however old",
                       "checkpoints", metavar="N", minimum=1)
    resume: bool = option(False, "continue the run in --out from its latest checkpoint: parameters, optimizer "
                                 "state, loss scaler, RNG states and data position (any world size); --steps is "
                                 "the total and must exceed the checkpoint's step", "checkpoints")
    schedule: str = option(
        "keep", "with --resume and a larger --steps: keep follows the checkpointed run's LR schedule (warm-up + "
                "cosine decay over its steps, then its final LR, constant; a schedule that ended inside its warm-up "
                "goes on to the peak and decays over the new --steps); stretch re-stretches the decay to the new "
                "--steps (the LR jumps up at the resumed step)", "checkpoints", choices=SCHEDULES)
    resume_step: int | None = option(
        None,
        "with --resume: resume from this checkpoint step instead of the latest (an older one; the later steps "
        "are moved to checkpoints/after-N/, kept)",
        "checkpoints",
        metavar="N",
        minimum=1,
        default_help="the latest",
    )
    allow_change: bool = option(
        False, "with --resume: accept settings that change the run's data stream or numbers (--data, --batch-size, "
               "--seq-len, --grad-accum, --mixed-precision, --seed, --val-fraction, or tokens per step through the "
               "world size), which are otherwise refused; each change is named, and recorded in metrics.jsonl and "
               "on loss.png", "checkpoints")
    # resolved on the machine (torch_backend.train.resolve.validate); a worker that finds ``validated`` skips the checks
    validated: bool = resolved("whether the run was checked on its machine (the launcher did)", False)
    world_size: int | None = resolved("workers of the run, all nodes together")
    model_kind: str | None = resolved('"gpt" (a byte-level GPT of torch_backend.train.gpt) or "hf" (a directory)')
    block_size: int | None = resolved("the model's longest sequence, in tokens")
    schedule_steps: int | None = resolved("the steps the LR schedule's warm-up + cosine decay span (``steps`` "
                                          "unless ``--resume --schedule keep`` kept a checkpoint's)")
    val_sequences: int | None = resolved("the run's validation set, in sequences: fixed at its first session "
                                         "(``chunkzero.resume_check.validation_sequences``)")
    planned_peak_bytes: int | None = resolved("the memory plan's predicted peak per rank (``chunkzero plan``), "
                                              "recorded in summary.json beside the measured one")
    resume_changes: list[str] | None = resolved("with ``--resume --allow-change``: each setting changed against the "
                                                "checkpointed run, as ``--seq-len 16 (was 32)``")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self) -> None:
        """Refuse a value that is wrong on any machine: a choice not offered, a number out of its
        bounds, or settings that exclude each other.

        Raises:
            ConfigError: one line naming the option at fault.
        """
        for f, opt in option_fields():
            value, kind = getattr(self, f.name), option_kind(f)
            accepted = {float: (float, int), list: (list, tuple)}.get(kind, kind)
            if value is not None and not isinstance(value, accepted):
                raise ConfigError(f"{flag_of(f)} must be {_KIND_NOUNS[kind]}, got {value!r}")
            why = opt.problem(value)
            if why is not None:
                raise ConfigError(f"{flag_of(f)} {why}")
        if self.engine == "ddp" and self.mixed_precision not in (None, "fp32"):
            raise ConfigError("--engine ddp (the plain-PyTorch baseline) trains in fp32 only")
        if self.engine == "ddp" and (self.save_interval or self.resume):
            raise ConfigError("--save-interval and --resume need --engine zero (chunk checkpoints of ZeroDDP)")
        if self.backend == "jax" and self.engine != "zero":
            raise ConfigError("--backend jax runs chunk ZeRO-3 only (--engine zero)")
        if self.backend == "jax" and self.mixed_precision == "fp16":
            raise ConfigError("--mixed-precision fp16 is not supported by --backend jax (it trains in fp32 or bf16, "
                              "without loss scaling)")
        if self.backend == "jax" and self.device == "cuda":
            raise ConfigError("--backend jax runs on CPU only (--device cpu or auto)")
        if self.backend == "torch" and self.devices_per_process != 1:
            raise ConfigError("--devices-per-process is for --backend jax (a torch worker drives one device)")
        if self.ema_decay is not None and self.engine == "ddp":
            raise ConfigError("--ema-decay needs --engine zero (the EMA is kept beside ZeroOptimizer's state)")
        if self.ema_warmup and self.ema_decay is None:
            raise ConfigError("--ema-warmup needs --ema-decay (it warms the EMA of the weights up)")
        zero_only = [flag for flag, on in (("--prefetch", self.prefetch != 1),
                                           ("--offload-optim-frac", self.offload_optim_frac),
                                           ("--offload-param-frac", self.offload_param_frac),
                                           ("--activation-checkpointing",
                                            self.activation_checkpointing and self.backend == "torch")) if on]
        if zero_only and (self.engine != "zero" or self.backend != "torch"):
            raise ConfigError(f"{zero_only[0]} is an option of the torch engine's ZeroDDP (--engine zero, "
                              "--backend torch)")
        if self.engine == "ddp" and self.shard_group_size is not None:
            raise ConfigError("--shard-group-size needs --engine zero (hybrid sharding of ZeroDDP)")
        if self.backend == "jax" and self.shard_group_size is not None:
            world = (self.nproc or 2) * self.devices_per_process  # jax_backend.train.run's world size
            if self.shard_group_size != world:
                raise ConfigError(
                    f"--shard-group-size {self.shard_group_size} (hybrid sharding) is for --backend torch: "
                    f"--backend jax trains flat ZeRO-3 over all {world} devices (jax_backend.hybrid is not wired "
                    f"into chunkzero train); drop the option or pass --shard-group-size {world}")
        for name, flag in (("resume_step", "--resume-step"), ("allow_change", "--allow-change")):
            if getattr(self, name) not in (None, False) and not self.resume:
                raise ConfigError(f"{flag} needs --resume (it says how to continue the run in --out)")
        if self.schedule != "keep" and not self.resume:
            raise ConfigError(f"--schedule {self.schedule} needs --resume (it says which LR schedule a resumed "
                              "run follows)")
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues the run in --out; it cannot be combined with --overwrite")


_KIND_NOUNS = {bool: "True or False", int: "a whole number", float: "a number", str: "a string",
               list: "a list of paths"}


def option_fields() -> list[tuple[dataclasses.Field, Option]]:
    """The :class:`TrainConfig` fields that are ``chunkzero train`` options, in ``--help`` order within
    each group, with their :class:`Option`."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(TrainConfig) if "option" in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of an option field (``--batch-size`` for ``batch_size``)."""
    return f.metadata["option"].flag or "--" + f.name.replace("_", "-")


def option_kind(f: dataclasses.Field) -> type:
    """The type of an option's value: ``bool`` (a switch), ``int``, ``float``, ``str`` or ``list`` (of ``str``)."""
    hint = typing.get_type_hints(TrainConfig)[f.name]
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    kind = typing.get_origin(kinds[0]) or kinds[0]
    if kind not in (bool, int, float, str, list):
        raise TypeError(f"TrainConfig.{f.name}: options hold bool, int, float, str or list[str], not {hint}")
    return kind


def default_text(f: dataclasses.Field) -> str | None:
    """The default as ``--help`` names it (``None`` for a switch, which is off)."""
    opt: Option = f.metadata["option"]
    if opt.default_help is not None:
        return opt.default_help
    if isinstance(f.default, bool):
        return None
    if isinstance(f.default, str) and f.default != f.default.strip():
        return repr(f.default)  # the space of "def " must show
    return str(f.default)


# ================================================================================ defaults by device

def device_defaults(device: str, *, bf16_supported: bool = True) -> dict[str, Any]:
    """The device-dependent fields (the keys of :data:`CPU_DEFAULTS`) on ``device`` (``"cpu"`` or
    ``"cuda"``): :data:`CPU_DEFAULTS`, or :data:`GPU_DEFAULTS` with fp16 instead of bf16 where the GPU
    has no bf16 (``bf16_supported=False``)."""
    if device != "cuda":
        return dict(CPU_DEFAULTS)
    return {**GPU_DEFAULTS, **({} if bf16_supported else {"mixed_precision": "fp16"})}


def with_device_defaults(cfg: TrainConfig, device: str, *, bf16_supported: bool = True) -> TrainConfig:
    """``cfg`` with every device-dependent field the user left unset (``None``) filled in for ``device``
    (:func:`device_defaults`); ``--engine ddp`` (fp32 only) defaults to fp32 everywhere. A copy; the
    fields already set are kept."""
    defaults = device_defaults(device, bf16_supported=bf16_supported)
    if cfg.engine == "ddp":
        defaults["mixed_precision"] = "fp32"
    return dataclasses.replace(cfg, **{k: v for k, v in defaults.items() if getattr(cfg, k) is None})


# ================================================================================ learning-rate schedule

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine decay to
    ``lr · min_lr_ratio`` at step ``schedule_steps - 1`` (default ``steps``; nanoGPT's ``get_lr``); after
    that step, the LR it had, constant (also when the warm-up had not ended there)."""
    step = min(step, max(1, cfg.schedule_steps or cfg.steps) - 1)
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / (cfg.warmup + 1)
    min_lr = cfg.lr * cfg.min_lr_ratio
    span = max(1, (cfg.schedule_steps or cfg.steps) - 1 - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


SCHEDULE_KEYS = ("steps", "warmup", "lr", "min_lr_ratio")
"""The settings of :func:`lr_at` a checkpoint records (with ``schedule_steps``): changing one at ``--resume``
may change the LR schedule mid-run."""


def saved_schedule_steps(previous: dict) -> int | None:
    """The steps the checkpointed run's schedule spans: its ``schedule_steps``, else its ``steps``."""
    for key in ("schedule_steps", "steps"):
        if isinstance(previous.get(key), int) and not isinstance(previous.get(key), bool):
            return previous[key]
    return None


def ends_in_warmup(schedule_steps: int, warmup: int) -> bool:
    """Whether a schedule over ``schedule_steps`` never decays: its last step is still in (or ends) the
    ``warmup``-step warm-up, so keeping it would hold the LR below (or at) its peak for good."""
    return schedule_steps - 1 <= warmup


def resumed_schedule_steps(cfg: TrainConfig, previous: dict | None) -> int:
    """``schedule_steps`` of a run resumed from a checkpoint with settings ``previous`` (its ``extra``, or
    the run's ``config.json``): with ``--schedule keep``, the checkpoint's, unless that schedule ends in its
    warm-up (:func:`ends_in_warmup`), which keep then continues to the peak and decays over ``--steps``;
    with ``stretch`` (or unknown settings), ``--steps``."""
    saved = saved_schedule_steps(previous or {})
    if cfg.schedule != "keep" or saved is None or ends_in_warmup(saved, cfg.warmup):
        return cfg.steps
    return saved


def warn_schedule_change(previous: dict | None, source: str, cfg: TrainConfig, step: int) -> None:
    """Say (logger ``chunkzero.train``) what ``--resume`` at ``step`` does to the LR schedule when its
    settings (``--steps``, ``--warmup``, ``--lr``, ``--min-lr-ratio``) differ from the checkpointed run's
    ``previous`` ones, read from ``source``. With ``--schedule keep`` and only ``--steps`` grown the LR
    goes on as saved (an info line, naming the choice); a warning when the LR of step ``step + 1`` differs
    from what the saved schedule gives it (``stretch`` after the warm-up, or another changed setting),
    when keep continues a saved schedule that ended in its warm-up (:func:`ends_in_warmup`), or when keep
    follows a saved schedule longer than the new ``--steps`` (the run ends before its decay does). Silent when
    nothing changed or ``previous`` is unknown."""
    if not previous:
        return
    changed = [f"--{k.replace('_', '-')} {getattr(cfg, k):g} (was {previous[k]:g})" for k in SCHEDULE_KEYS
               if isinstance(previous.get(k), (int, float)) and previous[k] != getattr(cfg, k)]
    if not changed:
        return
    old = dataclasses.replace(cfg, **{k: previous[k] for k in SCHEDULE_KEYS if k in previous},
                              schedule_steps=saved_schedule_steps(previous))
    before = lr_at(step - 1, old) if step >= 1 else 0.0
    after = lr_at(step, cfg)
    span = cfg.schedule_steps or cfg.steps
    saved = old.schedule_steps or old.steps
    continued = cfg.schedule == "keep" and span != saved and ends_in_warmup(saved, cfg.warmup)
    cut_short = cfg.schedule == "keep" and cfg.steps < span  # the run ends before the kept decay does
    if continued:
        choice = (f"--schedule keep: the saved schedule over {saved} steps ends inside its {cfg.warmup}-step warm-up, "
                  f"so the warm-up goes on to the peak {cfg.lr:g} and the cosine decay spans the new {cfg.steps} steps")
    elif cut_short:
        choice = (f"--schedule keep: the LR follows the saved warm-up + cosine decay over {span} steps, so the run "
                  f"ends at step {cfg.steps} with the LR still at {lr_at(cfg.steps - 1, cfg):.3g}, before that decay "
                  f"ends (--schedule stretch would re-stretch the decay to {cfg.steps} steps)")
    elif cfg.schedule == "keep":
        choice = (f"--schedule keep: the LR follows the saved warm-up + cosine decay over {span} steps"
                  + (f", then stays at its final {lr_at(span - 1, cfg):.3g} to step {cfg.steps}"
                     if cfg.steps > span else "")
                  + f" (--schedule stretch would re-stretch the decay to {cfg.steps} steps)")
    else:
        choice = (f"--schedule stretch: the LR schedule (warm-up + cosine decay) is re-stretched to the new total "
                  f"of {cfg.steps} steps (--schedule keep would follow the saved one)")
    warn = continued or cut_short or not math.isclose(lr_at(step, old), after, rel_tol=0.05)  # step + 1's LR too
    logging.getLogger("chunkzero.train").log(
        logging.WARNING if warn else logging.INFO,
        "%s--resume with %s differs from the checkpointed run's settings (%s); %s: the LR goes from %.3g at step %d "
        "to %.3g at step %d", "warning: " if warn else "", ", ".join(changed), source, choice, before, step, after,
        step + 1)
