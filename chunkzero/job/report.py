"""What a run reports: ``metrics.jsonl``, the progress bar, the log, and at the end ``loss.png``,
``sample.txt``, ``summary.json`` and ``summary.txt`` (rank 0, all in ``--out``).

``metrics.jsonl`` holds one JSON line per step ``{"kind": "train", "step", "loss", "lr", "loss_scale",
"grad_norm", "skipped", "tokens", "tokens_per_s", "time_s"}`` and per evaluation ``{"kind": "val",
"step", "val_loss"}`` (with ``--ema-decay`` also ``"ema_val_loss"``, the EMA weights' validation loss);
``tokens`` and ``time_s`` (training seconds) count the whole run, every session at its own world size. It
is strict JSON: a non-finite number (a NaN loss) is written ``null``, with ``"non_finite": true`` in its
record, and ``loss.png`` marks those steps. A resumed run rewrites it with the earlier session's records up to its
checkpoint first, so it holds the whole run once per step. :class:`Report` is the loop's one handle on
all of it; ranks other than 0 keep the same counters and write nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Protocol

from chunkzero.errors import DataError
from chunkzero.run_dir import CHECKPOINT_DIR
from chunkzero.train_config import TrainConfig

from . import data as data_mod

log = logging.getLogger("chunkzero.train")


class Adapter(Protocol):
    """What the report reads of an engine (torch's ``TorchAdapter``, JAX's ``JaxAdapter``)."""

    loss_scale: float
    last_grad_norm: float | None
    skipped_steps: int

    def describe(self) -> str: ...

    def memory_report(self) -> dict | None: ...


class Report:
    """One run's reporting, on every rank (rank 0 writes). Counts the run's tokens and training time
    (cumulative over every session of the run, whatever the world size of each), this session's tokens
    and training time (for tokens/s), and skipped steps.

    Args:
        cfg: the resolved config (``out`` set).
        rank, world_size: this worker and the run's workers; ``device_type``: this worker's (``"cpu"``, ``"cuda"``).
        backend: the process group's backend (``"gloo"``, ``"nccl"``, ``"none"``).
        start: the first step this session trains (1, or the step after a resumed checkpoint).
        tokens_per_step: ``world_size · grad_accum · batch_size · seq_len``.
        counters: a resumed run's :meth:`counters` at its checkpoint. Without them (a checkpoint
            written before they were saved) the earlier session's last ``metrics.jsonl`` record up to
            the checkpoint gives them on rank 0, else ``(start - 1) · tokens_per_step``.
    """

    def __init__(self, cfg: TrainConfig, *, rank: int, world_size: int, device_type: str, backend: str,
                 start: int, tokens_per_step: int, counters: dict | None = None):
        self.cfg, self.rank, self.world_size, self.device_type, self.backend = (
            cfg,
            rank,
            world_size,
            device_type,
            backend,
        )
        self.is_main = rank == 0
        self.start, self.tokens_per_step = start, tokens_per_step
        path = Path(cfg.out) / "metrics.jsonl"
        history = None
        if self.is_main and cfg.resume:
            history, damage = read_metrics_history(path, start - 1)
            if damage:  # the file is rewritten below with what can be read: the original is kept beside it
                kept = path.with_name(f"{path.name}.before-resume-{start - 1}")
                if not kept.exists():  # (a retried resume keeps the first copy, the untouched one)
                    shutil.copy2(path, kept)
                log.warning("warning: %s of the run's %s: the run's history goes on without them; the file as it "
                            "was is kept as %s", damage, path.name, kept.name)
        if history is not None:  # an earlier try of this same resume is replaced by this session's record
            history = [r for r in history if not (r.get("kind") == "session" and r["step"] == start - 1)]
        self.metrics = Metrics(path if self.is_main else None, history)
        if self.is_main:  # where each session (the first, every resume) began, and on how many workers
            self.metrics.write({"kind": "session", "step": start - 1, "world_size": world_size,
                                **({"changes": cfg.resume_changes} if cfg.resume_changes else {})})
        if counters is None:
            last = next((r for r in reversed(history or []) if r.get("kind") == "train" and r["step"] == start - 1), {})
            counters = {"tokens": last.get("tokens", (start - 1) * tokens_per_step),
                        "train_time_s": last.get("time_s", 0.0)}
        self.tokens = int(counters.get("tokens", 0))
        self.run_train_time_s = float(counters.get("train_time_s", 0.0))
        self.session_tokens = 0
        self.train_time_s = 0.0
        self.pbar = None

    def counters(self) -> dict:
        """The run's cumulative counters after the last recorded step: ``{"tokens", "train_time_s"}``
        (saved with each checkpoint, so a resumed run continues them)."""
        return {"tokens": self.tokens, "train_time_s": round(self.run_train_time_s, 4)}

    def begin(self, params: int, corpus: data_mod.Corpus, adapter: Adapter) -> None:
        """Log the run's set-up (rank 0)."""
        if not self.is_main:
            return
        cfg = self.cfg
        log.info("model %s: %s parameters, %s, engine %s; %d worker(s) on %s (%s); %s tokens per step",
                 cfg.model, f"{params:,}", cfg.mixed_precision, cfg.engine, self.world_size, self.device_type,
                 self.backend, f"{self.tokens_per_step:,}")
        log.info("data %s: %s train / %s val tokens (%s)", corpus.description, f"{corpus.train.size:,}",
                 f"{corpus.val.size:,}", "; ".join(corpus.notes))
        log.info("%s", adapter.describe())

    def open_progress(self) -> None:
        """Show the progress bar of the steps (rank 0, on stderr)."""
        if not self.is_main:
            return
        from tqdm import tqdm

        tty = sys.stderr.isatty()  # in a log file, a refresh every 30 s instead of every 0.5 s
        self.pbar = tqdm(total=self.cfg.steps, initial=self.start - 1, desc="train", unit="step",
                         dynamic_ncols=True, file=sys.stderr,
                         mininterval=0.5 if tty else 30.0, maxinterval=10.0 if tty else 60.0)

    def train_step(self, step: int, loss: float, lr: float, adapter: Adapter, applied: bool, dt_s: float) -> None:
        """Record optimizer step ``step``: its loss (the mean over ranks), learning rate, whether the update
        was ``applied`` (not skipped for non-finite gradients) and its time ``dt_s`` in seconds."""
        self.train_time_s += dt_s
        self.run_train_time_s += dt_s
        self.tokens += self.tokens_per_step
        self.session_tokens += self.tokens_per_step
        scale = adapter.loss_scale
        self.metrics.write({"kind": "train", "step": step, "loss": loss, "lr": lr, "loss_scale": scale,
                            "grad_norm": adapter.last_grad_norm, "skipped": not applied, "tokens": self.tokens,
                            "tokens_per_s": self.tokens_per_step / dt_s, "time_s": round(self.run_train_time_s, 4)})
        if self.pbar is not None:
            self.pbar.set_postfix_str(f"loss {loss:.4f} | {self.session_tokens / self.train_time_s:,.0f} tok/s | "
                                      f"lr {lr:.2e} | scale {scale:g}", refresh=False)
            self.pbar.update(1)

    def val(
        self, step: int, val_loss: float, train_loss: float | None = None, ema_val_loss: float | None = None
    ) -> None:
        """Record the validation loss after step ``step`` (and log it with the step's ``train_loss``),
        and the EMA weights' (``ema_val_loss``) when the run keeps an EMA."""
        record = {"kind": "val", "step": step, "val_loss": val_loss}
        if ema_val_loss is not None:
            record["ema_val_loss"] = ema_val_loss
        self.metrics.write(record)
        ema = "" if ema_val_loss is None else f", EMA val loss {ema_val_loss:.4f}"
        if self.is_main and train_loss is None:
            log.info("step %d: val loss %.4f%s", step, val_loss, ema)
        elif self.is_main:
            log.info("step %d: train loss %.4f, val loss %.4f%s", step, train_loss, val_loss, ema)

    def close_progress(self) -> None:
        if self.pbar is not None:
            self.pbar.close()

    def summary(self, *, params: int, corpus: data_mod.Corpus, adapter: Adapter, val_loss: float, memory: list[dict],
                chunks: list[dict | None], prompt: str, sample: str, wall_time_s: float) -> dict:
        """The run's ``summary.json``: first and last losses of the whole run (all sessions, from
        ``metrics.jsonl``; on ranks other than 0, of this session) with their steps, tokens, times, peak
        ``memory`` and ``chunks`` (:meth:`Adapter.chunk_report`) per rank and the ``sample``.
        ``val_loss``: the last evaluation's. ``sample``: ``None`` with ``--sample-tokens 0`` (no sample drawn)."""
        cfg, nan = self.cfg, float("nan")
        m = self.metrics
        (t0_step, first), (t1_step, last) = (m.train[0], m.train[-1]) if m.train \
            else ((self.start, nan), (cfg.steps, nan))
        (v0_step, val0), (v1_step, val_loss) = (m.val[0], m.val[-1]) if m.val \
            else ((self.start - 1, nan), (cfg.steps, val_loss))
        return {
            "model": cfg.model, "params": params, "mixed_precision": cfg.mixed_precision, "engine": cfg.engine,
            "chunk_size_searched": cfg.chunk_size is None,
            "world_size": self.world_size, "device": self.device_type, "backend": self.backend,
            "data": corpus.summary(), "steps": cfg.steps,
            "skipped_steps": adapter.skipped_steps,
            "tokens_per_step": self.tokens_per_step, "tokens": self.tokens,
            "train_loss_first": first, "train_loss_last": last,
            "train_loss_first_step": t0_step, "train_loss_last_step": t1_step,
            "val_loss_step0": val0, "val_loss_final": val_loss, "val_ratio": val_loss / val0 if val0 else nan,
            "val_loss_first_step": v0_step, "val_loss_final_step": v1_step,
            # the EMA's loss at the final evaluation only: a resume without --ema-decay dropped the EMA, and an
            # earlier session's EMA loss is not this step's
            "ema_val_loss_final": m.ema_val[-1][1] if m.ema_val and m.ema_val[-1][0] == v1_step else None,
            "wall_time_s": wall_time_s, "train_time_s": self.train_time_s,
            "tokens_per_s": self.session_tokens / self.train_time_s if self.train_time_s else 0.0,
            "peak_memory": memory, "memory_report": adapter.memory_report(), "chunks": chunks,
            # the memory plan's predicted peak per rank (chunkzero plan), beside the measured peak_memory
            "planned_peak_bytes_per_rank": getattr(cfg, "planned_peak_bytes", None),
            "out": str(cfg.out),
            "sample": {"prompt": prompt, "text": sample} if cfg.sample_tokens and sample is not None else None,
        }

    def finish(self, summary: dict) -> None:
        """Rank 0: close ``metrics.jsonl``; write ``sample.txt`` (unless ``--sample-tokens 0``), ``loss.png``,
        ``summary.txt`` and ``summary.json``; log the sample and the summary table."""
        if not self.is_main:
            return
        cfg, out = self.cfg, Path(self.cfg.out)
        self.metrics.close()
        if summary["sample"] is not None:  # --sample-tokens 0 draws none, and leaves an earlier sample.txt as it is
            (out / "sample.txt").write_text(summary["sample"]["text"] + "\n", encoding="utf-8")
        sizes = sorted({w for _, w in self.metrics.sessions} | {self.world_size})
        workers = (f"{self.world_size}" if len(sizes) == 1 else "/".join(map(str, sizes)))
        plot_loss(out / "loss.png", self.metrics,
                  f"{cfg.model} · {workers} × {self.device_type} · {cfg.mixed_precision} · seed {cfg.seed}")
        table = summary_table(summary)
        (out / "summary.txt").write_text(table + "\n", encoding="utf-8")
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        if summary["sample"] is not None:
            log.info("sample (prompt %r):\n%s\n", summary["sample"]["prompt"], summary["sample"]["text"])
        log.info("%s", table)


def prompt_ids(corpus: data_mod.Corpus, cfg: TrainConfig) -> list[int]:
    """The sample's prompt as token ids: ``--prompt`` encoded (its last ``block_size`` tokens) or, for
    pre-tokenized data without a tokenizer, the first 16 validation tokens. Each engine samples after it
    in its own framework, seeded from ``cfg.seed``."""
    try:
        ids = list(corpus.tokenizer.encode(cfg.prompt.encode("utf-8")))
    except DataError:
        ids = []
    if not ids:  # pre-tokenized data without a tokenizer: prompt with the first validation tokens
        ids = [int(t) for t in corpus.val[:16]]
    return [int(t) for t in ids[-cfg.block_size:]]


def peak_memory_mib() -> dict:
    """This process's peak resident set, ``{"peak_rss_mib": float}`` (an engine adds its device's peak)."""
    return {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}  # KiB on Linux


def read_metrics_history(path: Path, upto_step: int) -> tuple[list[dict], str | None]:
    """The records of an earlier session's ``metrics.jsonl`` up to step ``upto_step`` (a resumed run's
    checkpoint step), in file order, and what is wrong with the file (``None`` when nothing is). Later
    records belong to steps that the resumed run trains again (the earlier session outlived its last
    checkpoint) and are dropped; so are unreadable lines. A last line cut short (a kill) is expected; other
    unreadable lines, or steps up to ``upto_step`` without their ``train`` record (a truncated or edited
    file), are what is wrong."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return records, None
    unreadable = []
    for number, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
        except ValueError:
            if line.strip() and number < len(lines):
                unreadable.append(number)
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= upto_step:
            records.append(r)
    trained = {r["step"] for r in records if r.get("kind") == "train"}
    missing = [step for step in range(1, upto_step + 1) if step not in trained]
    problems = []
    if unreadable:
        problems.append(f"line(s) {_ranges(unreadable)} cannot be read")
    if missing:
        problems.append(f"step(s) {_ranges(missing)} have no record")
    return records, "; ".join(problems) or None


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class Metrics:
    """``metrics.jsonl`` (rank 0): one JSON object per line, flushed at once. ``history``: a resumed run's
    earlier records (:func:`read_metrics_history`); the file is rewritten with exactly those first, so it
    holds the whole run once per step, and :attr:`train` / :attr:`val` cover the whole run."""

    def __init__(self, path: Path | None, history: list[dict] | None = None):
        self.path = path
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        self.ema_val: list[tuple[int, float]] = []
        """``(step, validation loss of the EMA weights)``, with ``--ema-decay``."""
        self.sessions: list[tuple[int, int]] = []  # (step the session began after, world size)
        self.changes: dict[int, list[str]] = {}  # step a session began after: what --allow-change accepted
        for r in history or ():
            self._record(r)
        if path is not None and history is not None:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(strict_record(r), allow_nan=False) + "\n" for r in history),
                           encoding="utf-8")
            os.replace(tmp, path)
        self.f = open(path, "a", buffering=1) if path is not None else None

    def _record(self, record: dict) -> None:
        if record.get("kind") == "train" and "loss" in record:
            self.train.append((record["step"], _number(record["loss"])))
        elif record.get("kind") == "val" and "val_loss" in record:
            self.val.append((record["step"], _number(record["val_loss"])))
            if isinstance(record.get("ema_val_loss"), (int, float)):
                self.ema_val.append((record["step"], record["ema_val_loss"]))
        elif record.get("kind") == "session" and isinstance(record.get("world_size"), int):
            self.sessions.append((record["step"], record["world_size"]))
            if isinstance(record.get("changes"), list):
                self.changes[record["step"]] = [str(c) for c in record["changes"]]

    def val_at(self, step: int) -> float | None:
        """The logged validation loss at ``step``, if any."""
        return next((v for s, v in self.val if s == step), None)

    def write(self, record: dict) -> None:
        """Append ``record``; a non-finite number (inf/nan) is written as ``null``, with ``"non_finite": true``
        (strict JSON: no bare ``NaN``/``Infinity``)."""
        self._record(record)
        if self.f is not None:
            self.f.write(json.dumps(strict_record(record), allow_nan=False) + "\n")

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _number(value) -> float:
    """A logged loss as a float: ``null`` (a non-finite value, :func:`strict_record`) reads as nan."""
    return float("nan") if value is None else value


def strict_record(record: dict) -> dict:
    """``record`` with each non-finite float replaced by ``None`` and ``"non_finite": True`` added when there was
    one."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    return {**record, **dict.fromkeys(bad), "non_finite": True} if bad else record


def plot_loss(path: Path, metrics: Metrics, title: str) -> None:
    """Write :func:`loss_figure` to ``path`` (``loss.png``)."""
    fig = loss_figure(metrics, title)
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)


def loss_figure(metrics: Metrics, title: str):
    """The loss curve (a matplotlib figure, Agg): training loss per step (and its running mean) and validation loss
    points (of the live weights, and of the EMA weights when the run keeps an EMA); a dashed line where each resumed
    session began, labelled with its world size (and the first session's) and the settings ``--allow-change`` changed
    there; a red cross at the foot of the plot at each step whose training or validation loss was not finite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    finite = [(s, v) for s, v in metrics.train if math.isfinite(v)]
    non_finite = sorted({s for s, v in (*metrics.train, *metrics.val) if not math.isfinite(v)})
    if finite:
        steps, losses = zip(*finite)
        ax.plot(steps, losses, lw=0.7, alpha=0.45, color="tab:blue", label="train (per step)")
        k = max(1, len(losses) // 50)
        smooth = [
            sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1]) for i in range(len(losses))
        ]
        if k > 1:  # a mean of 1 is the per-step curve again
            ax.plot(steps, smooth, lw=1.6, color="tab:blue", label=f"train (mean of {k})")
    if non_finite:
        plural = "s" if len(non_finite) != 1 else ""
        ax.scatter(non_finite, [0.03] * len(non_finite), transform=ax.get_xaxis_transform(), marker="x", s=18,
                   color="tab:red", zorder=3, label=f"non-finite loss ({len(non_finite)} step{plural})")
    if metrics.val:
        vs, vl = zip(*metrics.val)
        ax.plot(
            vs,
            vl,
            "o-",
            color="tab:orange",
            lw=1.4,
            ms=4,
            label="validation" if not metrics.ema_val else "validation (live weights)",
        )
    if metrics.ema_val:
        es, el = zip(*metrics.ema_val)
        ax.plot(es, el, "s--", color="tab:green", lw=1.4, ms=4, label="validation (EMA weights)")
    for step, world in sorted(metrics.sessions):
        label = f"{world} worker{'s' if world != 1 else ''}"
        if step > 0:  # a resume from the checkpoint of ``step``
            ax.axvline(step + 0.5, color="0.35", ls="--", lw=0.9)
            label = f"resume at {step}: {label}" + "".join(f"; {c}" for c in metrics.changes.get(step, ()))
        label = "\n".join(textwrap.wrap(label, 48))  # vertical columns that stay inside the axes
        ax.annotate(label, xy=(step + 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                    textcoords="offset points", ha="left", va="top", fontsize=7, color="0.25", rotation=90)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left" if metrics.sessions else "best", fontsize=8)
    fig.tight_layout()
    return fig


def _fmt_time(s: float) -> str:
    m, s = divmod(s, 60)
    return f"{int(m)}m {s:04.1f}s" if m else f"{s:.1f}s"


def _fmt_count(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def _fmt_mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _per_rank(values: list, fmt) -> str:
    """``fmt(v)`` once when every rank has the same value, else ``rank r: fmt(v)`` for each."""
    shown = [fmt(v) for v in values]
    if len(set(shown)) == 1:
        return shown[0]
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))


def chunk_rows(s: dict) -> list[tuple[str, str]]:
    """The summary rows of chunk ZeRO-3 (none for ``--engine ddp``): the chunk count and size, the
    parameter shard each rank holds against the whole model, its model state and the peak number of
    chunks gathered at once."""
    chunks = [c for c in s.get("chunks") or [] if c]
    if not chunks:
        return []
    c, w = chunks[0], s["world_size"]
    how = "searched" if s.get("chunk_size_searched", True) else "--chunk-size"
    shard = _per_rank([x["shard_bytes"] for x in chunks], _fmt_mib)
    state = _per_rank([x["model_state_bytes"] for x in chunks], _fmt_mib)
    peak = _per_rank([x["peak_gathered_chunks"] for x in chunks], str)
    s_, r_ = c.get("shard_group_size", w), c.get("replicas", 1)
    if w == 1:
        over = f"{c['sharded_chunks']} kept whole on the one rank"
    elif s_ == 1:  # every rank holds every chunk whole: DDP with chunked buckets
        over = (f"{c['sharded_chunks']} replicated on each of the {w} rank(s) "
                "(shard group size 1: DDP with chunked buckets)")
    elif r_ == 1:
        over = f"{c['sharded_chunks']} sharded over {w} rank(s)"
    else:
        over = (f"{c['sharded_chunks']} sharded over S = {s_} rank(s) per shard group, replicated R = {r_} times "
                f"(hybrid, W = {w})")
    rows = [
        (
            "chunks",
            f"{c['chunks']}, chunk size {c['chunk_size']:,} elements ({how}; a larger tensor gets a chunk of its own), "
            f"{over}",
        ),
        (
            "shard per rank",
            f"{shard} of the {_fmt_mib(c['param_bytes'])} {s['mixed_precision']} parameters; "
            f"model state {state} (with gradients, fp32 masters, optimizer state)",
        ),
        ("peak gathered", f"{peak} of {c['sharded_chunks']} sharded chunks at once"),
    ]
    if "intra_sent_bytes" in c:
        intra = _per_rank([x.get("intra_sent_bytes", 0) for x in chunks], _fmt_mib)
        inter = _per_rank([x.get("inter_sent_bytes", 0) for x in chunks], _fmt_mib)
        if s_ == 1:
            both = _per_rank([x.get("intra_sent_bytes", 0) + x.get("inter_sent_bytes", 0) for x in chunks], _fmt_mib)
            text = f"each rank sent {both} (gradient all-reduces of whole chunks, ring algorithm, this session)"
        elif r_ > 1:
            text = (f"S = {s_}, R = {r_}: each rank sent {intra} within its shard group and {inter} across the "
                    "replicas (chunk collectives, ring algorithm, this session)")
        else:
            text = f"each rank sent {intra} (chunk collectives, ring algorithm, this session)"
        rows.append(("collectives", text))
    return rows


def _checkpoints_listed(out: str) -> str:
    """``", checkpoints/ (steps 10, 20)"`` when the run folder ``out`` holds checkpoints, else ``""``."""
    steps = sorted(int(d.name) for d in (Path(out) / CHECKPOINT_DIR).glob("*") if d.name.isdigit())
    if not steps:
        return ""
    listed = ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]} … {steps[-1]}, {len(steps)} in all"
    return f", {CHECKPOINT_DIR}/ (steps {listed})"


def summary_table(s: dict) -> str:
    mem = "; ".join(
        f"rank {r}: " + ", ".join(f"{v:,.0f} MiB {k.replace('peak_', '').replace('_mib', '').replace('_', ' ')}"
                                  for k, v in m.items())
        for r, m in enumerate(s["peak_memory"]))
    if s.get("planned_peak_bytes_per_rank"):
        mem += f" (planned {s['planned_peak_bytes_per_rank'] / 2**20:,.0f} MiB per rank)"
    v0, v1 = s["val_loss_step0"], s["val_loss_final"]
    rows = [
        ("model", f"{s['model']} ({_fmt_count(s['params'])} parameters), {s['mixed_precision']}, engine {s['engine']}"),
        ("workers", f"{s['world_size']} × {s['device']} ({s['backend']})"),
        ("data", f"{s['data']['source']}: {_fmt_count(s['data']['train_tokens'])} train / "
                 f"{_fmt_count(s['data']['val_tokens'])} val tokens"),
        ("steps", f"{s['steps']} × {s['tokens_per_step']:,} tokens" if s["tokens"] == s["steps"] * s["tokens_per_step"]
                  else f"{s['steps']} ({s['tokens_per_step']:,} tokens per step at this run's world size)"),
        ("tokens", f"{s['tokens']:,}"),
        ("train loss", f"{s['train_loss_first']:.4f} (step {s.get('train_loss_first_step', 1)}) → "
                       f"{s['train_loss_last']:.4f} (step {s.get('train_loss_last_step', s['steps'])})"),
        ("val loss", f"{v0:.4f} (step {s.get('val_loss_first_step', 0)}) → "
                     f"{v1:.4f} (step {s.get('val_loss_final_step', s['steps'])}), ratio {v1 / v0:.3f}"),
        *([("EMA val loss", f"{s['ema_val_loss_final']:.4f} (step {s.get('val_loss_final_step', s['steps'])})")]
          if s.get("ema_val_loss_final") is not None else []),
        ("wall time", f"{_fmt_time(s['wall_time_s'])} (training {_fmt_time(s['train_time_s'])})"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}"),
        *chunk_rows(s),
        ("peak memory", mem),
        ("outputs", f"{s['out']}/ (metrics.jsonl, loss.png, {'sample.txt, ' if s.get('sample') else ''}summary.txt, "
                    f"summary.json, config.json, train.log{_checkpoints_listed(s['out'])})"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["chunkzero train — summary", "-" * 25] + [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


class _TqdmHandler(logging.StreamHandler):
    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover  # noqa: BLE001 - logging's emit contract: handleError reports it
            self.handleError(record)


class _EarlyRecords(logging.Handler):
    """What rank 0 logs before ``--out`` may be written (the data, the model, what a resume loaded): kept, and
    written into ``train.log`` when it opens (:func:`setup_logging`)."""

    def __init__(self, records: list[logging.LogRecord] | None = None):
        super().__init__()
        self.records = records if records is not None else []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def setup_logging(rank: int, out: Path | None) -> None:
    """This process's log: rank 0's INFO lines on the console (through the progress bar), other ranks'
    warnings prefixed with their rank; with ``out`` (rank 0, once ``--out`` may be written), also
    ``out/train.log``, which starts with what rank 0 logged before (``None``: kept until then)."""
    root = logging.getLogger()
    early = next((h.records for h in root.handlers if isinstance(h, _EarlyRecords)), [])
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if rank == 0 and out is None:
        root.addHandler(_EarlyRecords(early))
    if rank == 0 and out is not None:
        fh = logging.FileHandler(out / "train.log")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for record in early:
            fh.handle(record)
        root.addHandler(fh)
    for name in ("torch.distributed", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Orbax logs through absl: INFO lines on every save ("Created BasePyTreeCheckpointHandler", "Closing
    # _NonBlockingMetadataStore", "[wait_until_finished] ...") would flood the console and train.log (a short
    # run with checkpoints logs no absl WARNING). JAX's distributed service announces itself at INFO.
    for name in ("absl", "jax._src.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
