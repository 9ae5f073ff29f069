"""Every collective the torch backend issues, in one place (FSDP2's ``_fsdp_collectives`` style).

Chunks are flat 1-D buffers, so the only collectives needed are the flat ones:

- :func:`all_gather_flat` — gather a chunk from its shards (``all_gather_single`` on torch ≥ 2.13,
  ``all_gather_into_tensor`` before; the old name warns on 2.13, so the choice is made once here).
- :func:`reduce_scatter_avg` — reduce a chunk's gradient and keep this rank's shard
  (``reduce_scatter_single`` / ``reduce_scatter_tensor``), averaged over the world size.
- :func:`all_reduce_avg` — the same for keep-gathered chunks (plain data parallelism).
- :func:`all_reduce_sum`, :func:`broadcast_from_first` — small helpers (norms, overflow flags, init).

Averaging is always ``SUM`` followed by an explicit division by the world size — never
``PREMUL_SUM`` or ``AVG``, which not every backend (gloo) or torch version (2.5–2.13) supports.
For fp16 the division happens *before* the reduction, so a sum of ``W`` large gradients cannot
overflow the fp16 range (the trick from ColossalAI Gemini's ``ZeroDDP`` reducer).

The process group's backend is whatever the caller created: NCCL for CUDA tensors, gloo for CPU
(:func:`default_backend`). A group of ``None`` means "no distributed run": every function is then
a single-rank no-op (gather copies, reductions leave the data as is).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_flat",
    "all_reduce_avg",
    "all_reduce_sum",
    "broadcast_from_first",
    "default_backend",
    "reduce_scatter_avg",
]


def _pick(*names: str):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    return None


# torch 2.13 renamed the flat collectives; the old names still exist there but warn (FutureWarning).
_ALL_GATHER_FLAT = _pick("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
_REDUCE_SCATTER_FLAT = _pick("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")

# Backends found not to implement the flat reduce-scatter (old gloo); they fall back to all-reduce.
_NO_FLAT_REDUCE_SCATTER: set[str] = set()


def default_backend(device: torch.device | str) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group) -> None:
    """Gather equal 1-D shards from every rank into ``output`` (rank order).

    Args:
        output: 1-D, ``W * shard.numel()`` elements, same dtype and device as ``shard``; written.
        shard: 1-D, this rank's contiguous shard.
        group: process group, or ``None`` for a single process (``output`` becomes a copy of ``shard``).
    """
    if _world(group) == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return
    _ALL_GATHER_FLAT(output, shard.contiguous(), group=group)


def reduce_scatter_avg(output: torch.Tensor, full: torch.Tensor, group, *, divide_first: bool = False) -> None:
    """Average ``full`` over the ranks and keep this rank's shard in ``output``.

    Args:
        output: 1-D, ``full.numel() // W`` elements; written with the mean of rank ``r``'s slice.
        full: 1-D gradient chunk of ``W * output.numel()`` elements. With ``divide_first`` it is
            divided in place by ``W`` before the reduction (fp16: keeps the sum in range).
        group: process group, or ``None`` for a single process.
    """
    world = _world(group)
    if world == 1:
        if output.data_ptr() != full.data_ptr():
            output.copy_(full)
        return
    if divide_first:
        full.div_(world)
    backend = dist.get_backend(group)
    if backend not in _NO_FLAT_REDUCE_SCATTER:
        try:
            _REDUCE_SCATTER_FLAT(output, full, op=dist.ReduceOp.SUM, group=group)
        except (RuntimeError, NotImplementedError) as e:  # old gloo: flat reduce-scatter unsupported
            if "not supported" not in str(e).lower() and "unimplemented" not in str(e).lower():
                raise
            _NO_FLAT_REDUCE_SCATTER.add(backend)
    if backend in _NO_FLAT_REDUCE_SCATTER:
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
        rank = dist.get_rank(group)
        n = output.numel()
        output.copy_(full[rank * n : (rank + 1) * n])
    if not divide_first:
        output.div_(world)


def all_reduce_avg(tensor: torch.Tensor, group, *, divide_first: bool = False) -> None:
    """Average ``tensor`` over the ranks, in place (SUM then division; division first for fp16)."""
    world = _world(group)
    if world == 1:
        return
    if divide_first:
        tensor.div_(world)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    if not divide_first:
        tensor.div_(world)


def all_reduce_sum(tensor: torch.Tensor, group) -> None:
    """Sum ``tensor`` over the ranks, in place (used for squared norms and overflow flags)."""
    if _world(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def broadcast_from_first(tensor: torch.Tensor, group) -> None:
    """Overwrite ``tensor`` on every rank with the group's rank-0 copy (initial parameters)."""
    if _world(group) > 1:
        src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        dist.broadcast(tensor, src=src, group=group)


# ---------------------------------------------------------------- small host-side agreements
# Used by checkpoints: a port to agree on, per-rank JSON records, "did every rank succeed". Tensor
# collectives only (never torch's object collectives), so peer data is never unpickled.

__all__ += ["all_gather_json", "all_ranks_ok", "broadcast_int"]


def _control_device(group) -> torch.device:
    """Where a group's small control tensors live: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_int(value: int, group) -> int:
    """The group's first rank's ``value`` (an int64, e.g. a port number), on every rank."""
    if _world(group) == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_control_device(group))
    broadcast_from_first(t, group)
    return int(t.item())


def all_ranks_ok(ok: bool, group) -> bool:
    """Whether every rank of the group reports ``ok`` (one all-reduce of a failure flag)."""
    if _world(group) == 1:
        return bool(ok)
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=_control_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) == 0


def all_gather_json(obj, group) -> list:
    """Every rank's JSON-serializable ``obj``, in rank order.

    Two tensor all-gathers: each rank's byte length, then its UTF-8 JSON bytes padded to the longest;
    each is decoded with ``json.loads``, never unpickled.

    Raises:
        TypeError / ValueError: ``obj`` is not JSON-serializable (before any collective).
    """
    import json

    if _world(group) == 1:
        return [obj]
    data = json.dumps(obj).encode("utf-8")
    device = _control_device(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(_world(group))]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(out, buf, group=group)
    return [json.loads(bytes(o[: int(s.item())].cpu().numpy())) for o, s in zip(out, sizes)]
