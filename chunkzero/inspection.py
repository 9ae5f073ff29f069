"""What a checkpoint holds, read from its metadata alone (``chunkzero inspect``).

Framework-free: no array is read and neither torch nor JAX is imported, so inspecting a checkpoint
is instant whatever its size.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .checkpoint import META_FILENAME, META_ITEM, PARAMS_KEY, chunk_key, list_steps, read_meta, resolve_step_dir
from .dtypes import itemsize_bytes
from .run_dir import checkpoint_root


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def inspect_checkpoint(path: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """What a checkpoint holds, from its metadata only (no array is read).

    ``path``: a checkpoint root, one step's directory, or a ``chunkzero train`` run folder (its ``checkpoints/``).

    Returns:
        A JSON-ready dict: ``path``, ``steps`` (all committed steps of the root), ``step``,
        ``world_size`` (the layout's: under hybrid sharding the shard group size ``S``), ``replicas``
        (hybrid sharding's ``R``, the saving run having ``W = S · R`` ranks; 1 for flat ZeRO-3),
        ``mixed_precision``, ``format_version``, ``optimizer``, ``loss_scaler``, ``data_position``,
        ``model_config``, ``ema`` (decay, update count, warm-up; ``None`` without an EMA), ``bytes_on_disk``,
        ``chunks`` (per chunk: index, dtype, size, utilized, padding, keep_gathered, requires_grad, tensors,
        bytes) and ``tensors`` (per tensor: name, aliases, shape, dtype, numel, chunk, offset, bytes).

    Raises:
        CheckpointError / CheckpointFormatError: no such checkpoint or step, malformed metadata.
    """
    step_dir = resolve_step_dir(checkpoint_root(path), step)
    meta = read_meta(step_dir)
    doc = json.loads((step_dir / META_ITEM / META_FILENAME).read_text())
    layout = meta.layout
    expected = meta.expected_arrays()
    steps = list_steps(step_dir.parent)
    chunks = []
    for c in layout.chunks:
        saved_dtype = expected[(PARAMS_KEY, chunk_key(c.index))][1]
        chunks.append({
            "index": c.index, "key": chunk_key(c.index), "dtype": c.dtype, "saved_dtype": saved_dtype, "size": c.size,
            "utilized": c.utilized, "padding": c.padding, "keep_gathered": c.keep_gathered,
            "requires_grad": c.requires_grad, "tensors": len(c.tensor_names),
            "bytes": c.size * itemsize_bytes(saved_dtype),
        })
    tensors = [
        {"name": t.name, "aliases": list(t.aliases), "shape": list(t.shape), "dtype": t.dtype, "numel": t.numel,
         "chunk": t.chunk, "offset": t.offset, "requires_grad": t.requires_grad,
         "bytes": t.numel * itemsize_bytes(expected[(PARAMS_KEY, chunk_key(t.chunk))][1])}
        for t in layout.tensors
    ]
    opt = meta.optimizer
    return {
        "path": str(step_dir),
        "steps": steps,
        "step": meta.step,
        "format_version": doc.get("version"),
        "world_size": meta.world_size,
        "replicas": meta.replicas,
        "chunk_size": layout.chunk_size,
        "mixed_precision": meta.mixed_precision,
        "parameters": layout.utilized_numel,
        "padding": layout.padding_numel,
        "optimizer": None
        if opt is None
        else {
            "class_name": opt.class_name,
            "state_keys": list(opt.state_keys),
            "step": opt.step,
            "hyperparameters": opt.hyperparameters,
            "param_groups": None
            if opt.param_groups is None
            else [
                {"tensors": len(g["params"]), **{k: v for k, v in g.items() if k != "params"}} for g in opt.param_groups
            ],
            "tensor_steps": opt.tensor_steps,
        },
        "loss_scaler": meta.loss_scaler,
        "ema": None if meta.ema is None else meta.ema.to_dict(),
        "data_position": meta.data_position,
        "model_config": meta.model_config,
        "rng_states": None if meta.rng_states is None else len(meta.rng_states),
        "arrays": len(expected),
        "array_bytes": sum(math.prod(s) * itemsize_bytes(d) for s, d in expected.values()),
        "bytes_on_disk": _dir_bytes(step_dir),
        "chunks": chunks,
        "tensors": tensors,
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_value(v: Any) -> str:
    """A hyper-parameter for print: floats to 6 significant digits (``lr=0.0003``, not its binary noise)."""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(_fmt_value, v)) + "]"
    return str(v)


def _fmt_world(shard_group_size: int, replicas: int) -> str:
    """The saving run's ranks: flat ``world size W``, or hybrid ``S``, ``R`` and ``W = S · R``."""
    if replicas == 1:
        return f"world size {shard_group_size}"
    return (f"hybrid sharding: shard group size S = {shard_group_size}, R = {replicas} replicas, world size "
            f"W = S·R = {shard_group_size * replicas} (each shard saved once)")


def format_inspection(info: dict[str, Any], *, max_tensors: int | None = None) -> str:
    """Human-readable text of :func:`inspect_checkpoint`'s result."""
    lines = [
        f"checkpoint {info['path']}",
        f"  step {info['step']} (steps here: {', '.join(map(str, info['steps'])) or '-'}), format version "
        f"{info['format_version']}",
        f"  {_fmt_world(info['world_size'], info.get('replicas', 1))}, chunk size {info['chunk_size']:,} elements, "
        f"{info['mixed_precision']}",
        f"  {info['parameters']:,} parameter elements (+{info['padding']:,} padding) in {len(info['chunks'])} chunks, "
        f"{len(info['tensors'])} tensors; {info['arrays']} arrays, {_fmt_bytes(info['array_bytes'])} "
        f"({_fmt_bytes(info['bytes_on_disk'])} on disk)",
    ]
    opt = info["optimizer"]
    if opt:
        lines.append(
            f"  optimizer {opt['class_name']} step {opt['step']}, states {', '.join(opt['state_keys']) or '-'}; "
            + ", ".join(f"{k}={_fmt_value(v)}" for k, v in opt["hyperparameters"].items())
        )
        first = opt["param_groups"][0] if opt["param_groups"] else {}
        for i, g in enumerate(opt["param_groups"] or []):
            differs = {k: v for k, v in g.items() if k != "tensors" and (i == 0 or first.get(k) != v)}
            lines.append(f"    param group {i}: {g['tensors']} tensor(s)" + "".join(
                f", {k}={_fmt_value(v)}" for k, v in differs.items() if i > 0 or k in ("lr", "weight_decay")))
        if opt["tensor_steps"]:
            lines.append(f"    {len(opt['tensor_steps'])} tensor(s) at another step (0: no state yet): "
                         + ", ".join(f"{n}={s}" for n, s in list(opt["tensor_steps"].items())[:5]))
    else:
        lines.append("  no optimizer state")
    if info.get("ema"):
        e = info["ema"]
        lines.append(f"  EMA of the weights: decay {e['decay']:g}, {e['update_count']} updates"
                     + (", with warm-up" if e["warmup"] else ""))
    if info["loss_scaler"]:
        lines.append(f"  loss scaler: scale {info['loss_scaler'].get('scale')}")
    if info["data_position"] is not None:
        lines.append(f"  data position: {json.dumps(info['data_position'])}")
    if info["model_config"] is not None:
        lines.append(f"  model config: {json.dumps(info['model_config'], sort_keys=True)[:200]}")
    lines.append("")
    lines.append("  chunk  dtype     saved     size        utilized    kind           tensors  bytes")
    for c in info["chunks"]:
        kind = ("keep-gathered" if c["keep_gathered"] else "sharded") + ("" if c["requires_grad"] else ",frozen")
        lines.append(f"  {c['index']:>5}  {c['dtype']:<9} {c['saved_dtype']:<9} {c['size']:<11,} {c['utilized']:<11,} "
                     f"{kind:<14} {c['tensors']:>7}  {_fmt_bytes(c['bytes'])}")
    lines.append("")
    lines.append("  tensor                                              shape            dtype     chunk  offset")
    shown = info["tensors"] if max_tensors is None else info["tensors"][:max_tensors]
    for t in shown:
        alias = f"  (= {', '.join(t['aliases'])})" if t["aliases"] else ""
        lines.append(
            f"  {t['name']:<51} {tuple(t['shape'])!s:<16} {t['dtype']:<9} {t['chunk']:>5}  {t['offset']:,}{alias}"
        )
    if len(shown) < len(info["tensors"]):
        lines.append(f"  … {len(info['tensors']) - len(shown)} more (--all)")
    return "\n".join(lines)
