"""Memory figures of the real-model recipes under ZeroDDP: activation checkpointing, LoRA, meta-device init.

Three cases, each run in a child process of its own (own process group, killed past ``--timeout``)
that spawns ``--world-size`` gloo ranks (CPU):

- ``ckpt`` — HF GPT-2 (``--ckpt-layers`` layers of GPT-2 small's width, vocabulary 50257), batch
  ``--ckpt-batch`` x ``--ckpt-seq`` tokens per rank, one AdamW step under ZeroDDP (fp32) after one
  warm-up step, with and without ``gradient_checkpointing_enable()`` (non-reentrant). Two measures of
  the step's peak, the same for both runs: *peak bytes alive* — the running sum of the torch CPU
  allocator's allocation and free events (``torch.profiler`` with ``profile_memory=True``, kineto
  memory events in time order) from the start of the step, i.e. the most tensor bytes the step held
  at once beyond what was alive before it; and *peak RSS* — the kernel's ``VmHWM`` after resetting it
  (``/proc/self/clear_refs``) at the start of the step, minus ``VmRSS`` then. The cases run with
  ``MALLOC_MMAP_THRESHOLD_=65536``, so glibc unmaps large freed blocks and RSS follows the bytes
  alive (with its default dynamic threshold, freed heap pages of the warm-up step stay resident).
- ``lora`` — HF GPT-2 small (124M parameters), model-state bytes per rank (parameters, gradients,
  fp32 master, optimizer states, right after ``step()``) from ``optim.memory_report()`` for full
  fine-tuning and for peft LoRA (rank ``--lora-rank`` on ``c_attn``, ``c_proj``, ``c_fc``), fp32 and
  bf16, against plain torch (one process, no wrapper: every tensor of the module, its ``.grad`` and
  the AdamW state; DDP holds the same on every rank, plus its gradient buckets).
- ``meta`` — HF GPT-2 of ``--meta-layers`` layers, width ``--meta-width`` (~200M parameters), wrapped
  by ``ZeroDDP`` (fp32, chunk size from the core search) three ways: built under
  ``torch.device("meta")`` and initialized per submodule (``param_init_fn`` = HF's ``_init_weights``);
  built under meta, left uninitialized and streamed from a safetensors file by ``load_pretrained``;
  and built eagerly before wrapping. Per rank: peak RSS while building and wrapping (``VmHWM`` reset
  before the model is built, minus ``VmRSS`` then) against the bound "this rank's shards plus one
  chunk" computed from the layout (sum of ``shard_numel`` x 4 bytes, plus the largest chunk x 4).
  A sampling thread (every 5 ms) splits the peak into anonymous memory and file-backed pages
  (``RssAnon`` / ``RssFile``: the safetensors file is memory-mapped, and the pages a rank reads stay
  mapped until ``load_pretrained`` closes it; they are page cache, reclaimable).

Prints one markdown table per case, with the command, date, machine and load average.

    .venv/bin/python benchmarks/bench_recipes.py                      # all three cases, W = 2
    .venv/bin/python benchmarks/bench_recipes.py --cases lora --world-size 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MiB = 2**20


# ---------------------------------------------------------------------------------------- measuring
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; returns the RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """This process's peak RSS (``VmHWM``) since the last :func:`reset_peak_rss`, bytes."""
    return _status_kib("VmHWM") * 1024


class RssSampler:
    """Samples this process's anonymous and file-backed RSS (``RssAnon`` / ``RssFile``) every
    ``interval_s`` seconds in a thread; :attr:`peak` is the largest of each seen (bytes)."""

    def __init__(self, interval_s: float = 0.005):
        import threading

        self.interval_s, self.peak = interval_s, {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        for key in self.peak:
            self.peak[key] = max(self.peak[key], _status_kib(key) * 1024)

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def peak_alive_bytes(prof) -> int:
    """The most tensor bytes alive at once during a ``torch.profiler`` run beyond those alive at its
    start: the running sum of the allocator's memory events (+ alloc, - free) in time order."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    alive = peak = 0
    for _, n in events:
        alive += n
        peak = max(peak, alive)
    return peak


def gpt2(n_layer: int, n_embd: int, n_head: int, *, meta: bool = False, n_positions: int = 1024):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return GPT2LMHeadModel(cfg)
    return GPT2LMHeadModel(cfg)


def _tokens(rank: int, batch: int, seq: int):
    import torch

    return torch.randint(0, 50257, (batch, seq), generator=torch.Generator().manual_seed(100 + rank))


# ---------------------------------------------------------------------------------------- workers
def worker_ckpt(rank: int, world: int, checkpointing: bool, cfg: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from torch_backend import ZeroDDP, ZeroOptimizer

    module = gpt2(cfg["ckpt_layers"], 768, 12)
    if checkpointing:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module.train()
    model = ZeroDDP(module)
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, eps=1e-6)
    ids = _tokens(rank, cfg["ckpt_batch"], cfg["ckpt_seq"])

    def step():
        optim.backward(model(input_ids=ids, labels=ids).loss)
        optim.step()
        optim.zero_grad()

    step()  # warm-up: optimizer state created, prefetch order recorded
    torch.distributed.barrier()
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    seconds = time.perf_counter() - t0
    return {"peak_alive": peak_alive_bytes(prof), "peak_rss": peak_rss() - rss0, "seconds": seconds,
            "n_params": sum(p.numel() for p in module.parameters()), "chunks": len(model.chunks)}


def _lora(module, rank_r: int):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(module, LoraConfig(r=rank_r, lora_alpha=2 * rank_r, lora_dropout=0.0, fan_in_fan_out=True,
                                             target_modules=["c_attn", "c_proj", "c_fc"]))


def _torch_model_state_bytes(module, optimizer) -> int:
    total = 0
    for p in module.parameters():
        total += p.numel() * p.element_size() + (0 if p.grad is None else p.grad.numel() * p.grad.element_size())
    for st in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if hasattr(v, "numel"))
    return total


def worker_lora(rank: int, world: int, engine: str, lora: bool, precision: str, cfg: dict) -> dict:
    import torch

    module = gpt2(12, 768, 12)
    n_params = sum(p.numel() for p in module.parameters())
    if lora:
        module = _lora(module, cfg["lora_rank"])
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    ids = _tokens(rank, 1, cfg["lora_seq"])
    if engine == "zero":
        from torch_backend import ZeroDDP, ZeroOptimizer

        model = ZeroDDP(module, mixed_precision=precision)
        optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, eps=1e-6)
        optim.backward(model(input_ids=ids, labels=ids).loss)
        optim.step()
        state = optim.memory_report().model_state_bytes()
    else:
        optim = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4, eps=1e-6)
        module(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        state = _torch_model_state_bytes(module, optim)
    return {"state": state, "n_params": n_params, "trainable": trainable}


def _wrap(how: str, shape: tuple[int, int, int], weights: str | None):
    """Build HF GPT-2 of ``shape`` (layers, width, heads) the ``how`` way and wrap it in ZeroDDP."""
    from torch_backend import ZeroDDP
    from torch_backend.checkpoint.pretrained import load_pretrained

    if how == "eager":
        return ZeroDDP(gpt2(*shape))
    module = gpt2(*shape, meta=True)
    model = ZeroDDP(
        module, device="cpu", param_init_fn=module._init_weights if how == "meta-init" else (lambda m: None)
    )
    if how == "meta-load" and weights is not None:
        report = load_pretrained(model, weights)
        assert not report.missing_keys and not report.unexpected_keys, report
    return model


def worker_meta(rank: int, world: int, how: str, weights: str, cfg: dict) -> dict:
    import torch

    _wrap(how, (1, 64, 1), None)  # warm-up on a tiny model: imports and first-use allocations not counted
    torch.distributed.barrier()
    anon0, file0 = _status_kib("RssAnon") * 1024, _status_kib("RssFile") * 1024
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    with RssSampler() as sampler:
        model = _wrap(how, (cfg["meta_layers"], cfg["meta_width"], cfg["meta_width"] // 64), weights)
    seconds = time.perf_counter() - t0
    peak = peak_rss() - rss0
    layout = model.layout
    shards = sum(layout.shard_numel(c.index) for c in layout.chunks) * 4
    largest = max(c.size for c in layout.chunks) * 4
    n_params = sum(math.prod(t.shape) for t in layout.tensors)
    return {
        "peak_rss": peak,
        "peak_anon": sampler.peak["RssAnon"] - anon0,
        "peak_file": sampler.peak["RssFile"] - file0,
        "shards": shards,
        "chunk": largest,
        "n_params": n_params,
        "chunks": len(layout.chunks),
        "seconds": seconds,
    }


def save_weights(path: str, cfg: dict) -> None:
    """A pretrained stand-in: the eager model's weights as one safetensors file (HF's layout)."""
    gpt2(cfg["meta_layers"], cfg["meta_width"], cfg["meta_width"] // 64).save_pretrained(path)


# ---------------------------------------------------------------------------------------- cases
def run_case(case: str, cfg: dict) -> list[dict]:
    from torch_backend._testing import run_distributed

    world, timeout = cfg["world_size"], cfg["timeout"]
    rows = []
    if case == "ckpt":
        for on in (False, True):
            res = run_distributed(worker_ckpt, world, on, cfg, timeout=timeout)
            rows.append({"checkpointing": on, "ranks": res})
    elif case == "lora":
        for engine, lora, precision in (("torch", False, "fp32"), ("torch", True, "fp32"), ("zero", False, "fp32"),
                                        ("zero", True, "fp32"), ("zero", False, "bf16"), ("zero", True, "bf16")):
            if engine == "torch":
                res = [worker_lora(0, 1, engine, lora, precision, cfg)]
            else:
                res = run_distributed(worker_lora, world, engine, lora, precision, cfg, timeout=timeout)
            rows.append({"engine": engine, "lora": lora, "precision": precision, "ranks": res})
    elif case == "meta":
        with tempfile.TemporaryDirectory(prefix="bench-recipes-") as tmp:
            save_weights(tmp, cfg)
            for how in ("meta-init", "meta-load", "eager"):
                res = run_distributed(worker_meta, world, how, tmp, cfg, timeout=timeout)
                rows.append({"how": how, "ranks": res})
    else:
        raise ValueError(case)
    return rows


def _table(caption: str, columns: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A caption and a markdown table; the first ``left`` columns are left-aligned, the rest right."""
    align = ["---"] * left + ["---:"] * (len(columns) - left)
    return [caption + "\n", "| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def _worst(r: dict, key: str) -> float:
    return max(x[key] for x in r["ranks"])


def table_ckpt(rows, cfg) -> str:
    r0 = rows[0]["ranks"][0]
    caption = (f"HF GPT-2, {cfg['ckpt_layers']} layers of width 768 ({r0['n_params'] / 1e6:.1f}M parameters, tied), "
               f"dropout 0.1, ZeroDDP fp32 ({r0['chunks']} chunks) at W = {cfg['world_size']}, batch "
               f"{cfg['ckpt_batch']}x{cfg['ckpt_seq']} tokens per rank, one AdamW step after a warm-up step; "
               "the larger rank's figure.")
    body = [
        [
            "`gradient_checkpointing_enable()` (non-reentrant)" if r["checkpointing"] else "off",
            f"{_worst(r, 'peak_alive') / MiB:.0f}",
            f"{_worst(r, 'peak_rss') / MiB:.0f}",
            f"{_worst(r, 'seconds'):.1f}",
        ]
        for r in rows
    ]
    out = _table(caption, ["gradient checkpointing", "peak bytes alive in the step (MiB)", "peak RSS in the step (MiB)",
                           "step (s)"], body)
    off, on = (_worst(r, "peak_alive") for r in rows)
    out.append(f"\nSaved: {(off - on) / MiB:.0f} MiB of peak bytes alive ({100 * (off - on) / off:.0f}%).")
    return "\n".join(out)


def table_lora(rows, cfg) -> str:
    r0 = rows[1]["ranks"][0]
    caption = (f"HF GPT-2 small ({r0['n_params'] / 1e6:.1f}M parameters, tied); LoRA rank {cfg['lora_rank']} on "
               f"c_attn, c_proj, c_fc: {r0['trainable'] / 1e6:.2f}M trainable parameters "
               f"({100 * r0['trainable'] / r0['n_params']:.2f}%); AdamW; bytes right after `step()`.")
    base = rows[0]["ranks"][0]["state"]
    body = [["plain torch (1 process)" if r["engine"] == "torch" else f"ZeroDDP, W = {cfg['world_size']}",
             "LoRA" if r["lora"] else "full", r["precision"], f"{_worst(r, 'state') / MiB:.1f}",
             f"{_worst(r, 'state') / base:.3f}"] for r in rows]
    return "\n".join(_table(caption, ["engine", "fine-tuning", "precision", "model-state bytes per rank (MiB)",
                                      "vs plain torch full"], body, left=3))


def table_meta(rows, cfg) -> str:
    r0 = rows[0]["ranks"][0]
    caption = (f"HF GPT-2, {cfg['meta_layers']} layers, width {cfg['meta_width']} ({r0['n_params'] / 1e6:.1f}M "
               f"parameters, {r0['n_params'] * 4 / MiB:.0f} MiB in fp32), ZeroDDP fp32, chunk size from the core "
               f"search ({r0['chunks']} chunks), W = {cfg['world_size']}. Peak RSS while building and wrapping, above "
               "the RSS before; bound = this rank's shards + one (the largest) chunk, fp32, from the layout; the "
               "larger rank.")
    names = {"meta-init": "`torch.device(\"meta\")`, `param_init_fn=model._init_weights`",
             "meta-load": "`torch.device(\"meta\")`, uninitialized, then `load_pretrained(model, safetensors)`",
             "eager": "eager (the whole model built on each rank, then wrapped)"}
    body = []
    for r in rows:
        worst = max(r["ranks"], key=lambda x: x["peak_rss"])
        bound = worst["shards"] + worst["chunk"]
        body.append([names[r["how"]], f"{worst['peak_rss'] / MiB:.0f}",
                     f"{worst['peak_anon'] / MiB:.0f} / {worst['peak_file'] / MiB:.0f}", f"{bound / MiB:.0f}",
                     f"{worst['peak_rss'] / bound:.2f}", f"{_worst(r, 'seconds'):.1f}"])
    return "\n".join(_table(caption, ["construction", "peak RSS per rank (MiB)",
                                      "of it: anonymous / file-backed (MiB, sampled)", "shards + one chunk (MiB)",
                                      "peak / bound", "time (s)"], body))


TABLES = {"ckpt": table_ckpt, "lora": table_lora, "meta": table_meta}


def run_child(case: str, argv: list[str], timeout: float) -> list[dict]:
    """Run one case in a child process in its own process group; kill the group past ``timeout``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, *argv]
    # glibc: allocations of 64 KiB and more are mmap'ed and unmapped when freed (no dynamic threshold),
    # so that RSS follows the bytes alive instead of keeping freed heap pages resident
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"case {case} exceeded {timeout}s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="ckpt,lora,meta")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--ckpt-layers", type=int, default=4)
    ap.add_argument("--ckpt-batch", type=int, default=2)
    ap.add_argument("--ckpt-seq", type=int, default=512)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-seq", type=int, default=64)
    ap.add_argument("--meta-layers", type=int, default=12)
    ap.add_argument("--meta-width", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per case")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = {k: v for k, v in vars(args).items() if k not in ("child", "cases")}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        print(json.dumps(run_case(args.child, cfg)), flush=True)
        return
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]
    import torch

    command = " ".join([".venv/bin/python benchmarks/bench_recipes.py", *argv])
    print(f"Command: `{command}`")
    load = os.getloadavg()
    print(
        f"{datetime.date.today().isoformat()} · {platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, "
        f"gloo; load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)\n"
    )
    for case in args.cases.split(","):
        rows = run_child(case, forwarded, args.timeout)
        print(TABLES[case](rows, cfg) + "\n", flush=True)
    load = os.getloadavg()
    print(f"load average at end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")


if __name__ == "__main__":
    main()
