"""Every collective the torch backend issues, in one place (FSDP2's ``_fsdp_collectives`` style).

Chunks are flat 1-D buffers, so the only collectives needed are the flat ones:

- :func:`all_gather_flat` — gather a chunk from its shards (``all_gather_single`` on torch ≥ 2.13,
  ``all_gather_into_tensor`` before; the old name warns on 2.13, so the choice is made once here).
- :func:`reduce_scatter_avg` — reduce a chunk's gradient and keep this rank's shard
  (``reduce_scatter_single`` / ``reduce_scatter_tensor``; on gloo an all-to-all and a local sum),
  averaged over the world size.
- :func:`all_reduce_avg` — the same for keep-gathered chunks (plain data parallelism).
- :func:`reduce_hybrid` — hybrid sharding's two levels (:mod:`torch_backend.zero.sharding_groups`): the
  reduce-scatter (or all-reduce) over the shard group, then the all-reduce of the result over the
  replica group, the mean over both taken once.
- :func:`agree` — the engine's small vote all-reduce that keeps every rank's collectives in the same
  order (see :mod:`torch_backend.zero.schedule`), on :func:`agreement_group`.
- :func:`all_reduce_sum`, :func:`broadcast_from_first` — small helpers (norms, overflow flags, init).

The three chunk collectives take ``async_op``: with ``True`` they return at once a :class:`Pending`
whose :meth:`Pending.wait` completes them. On gloo the work runs on the process group's background
threads and the host waits for it (:func:`wait_on_host`: it polls, then blocks); on CUDA the
collective is issued from a dedicated communication stream that first waits for the compute stream
(everything queued where the inputs were written), and ``wait()`` makes the *current* stream wait for
it — FSDP2's pattern.

**Streams.** Every cross-stream hand-over goes through the stream layer of
:mod:`torch_backend.zero.streams` (re-exported here): a collective's buffers are allocated on the
compute stream and kept alive by its :class:`Pending` until :meth:`Pending.wait`, which makes the
*current* stream wait for the work.


Averaging is always ``SUM`` followed by an explicit division by the world size — never
``PREMUL_SUM`` or ``AVG``, which not every backend (gloo) or torch version (2.5–2.13) supports.
For fp16 the division happens *before* the reduction, so a sum of ``W`` large gradients cannot
overflow the fp16 range (the trick from ColossalAI Gemini's ``ZeroDDP`` reducer).

The process group's backend is whatever the caller created: NCCL for CUDA tensors, gloo for CPU
(:func:`default_backend`). A group of ``None`` means "no distributed run": every function is then
a single-rank no-op (gather copies, reductions leave the data as is).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .streams import (  # noqa: F401
    CudaStreams,
    compute_stream,
    free_after,
    hand_over,
    record_event,
    set_stream_layer,
    stream_layer,
    synchronize_event,
    uses_streams,
)
from .torch_internals import process_group_timeout

__all__ = [
    "Pending",
    "agree",
    "agreement_group",
    "all_gather_flat",
    "all_gather_json",
    "all_mean",
    "all_reduce_avg",
    "all_reduce_sum",
    "barrier",
    "broadcast_from_first",
    "broadcast_int",
    "CudaStreams",
    "communication_stream",
    "compute_stream",
    "default_backend",
    "free_after",
    "hand_over",
    "record_event",
    "stream_layer",
    "synchronize_event",
    "uses_streams",
    "reduce_hybrid",
    "reduce_scatter_avg",
    "wait_on_host",
    "world_group",
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


class Pending:
    """An issued collective. :meth:`wait` completes it once: it makes the current stream wait for the
    work (gloo: the host waits), runs the epilogue (a division, a copy-out) on the current stream, and
    drops the buffers it kept alive. Those were allocated on the compute stream: waited for there, their
    memory is reused only after the collective; waited for on another stream, call :meth:`free_after`
    that stream first (module docstring, **Streams**)."""

    __slots__ = ("_epilogue", "_issue_stream", "_keep", "_work")

    def __init__(self, work=None, epilogue: Callable[[], None] | None = None, keep: tuple = (), issue_stream=None):
        self._work, self._epilogue, self._keep = work, epilogue, keep
        self._issue_stream = issue_stream
        """The communication stream it was issued from (``None``: no streams, or issued synchronously)."""

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has run (a completed collective that was never waited for is not done)."""
        return self._work is None and self._epilogue is None

    def free_after(self, stream) -> None:
        """The buffers the collective uses are freed, when :meth:`wait` drops them, only after the work
        queued on ``stream`` by then (:func:`free_after` each: the stream that will wait for the
        collective, when it is not their allocation stream)."""
        for t in self._keep:
            free_after(t, stream)

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            if self._issue_stream is not None:
                stream_layer().wait_work(work, self._issue_stream)
            else:
                wait_on_host(work)
        epilogue, self._epilogue = self._epilogue, None
        if epilogue is not None:
            epilogue()
        self._keep = ()


HOST_SPIN_S = 1e-3
"""Seconds a host wait for a collective polls it before blocking (Note [spin, then block])."""

_yield_core = getattr(os, "sched_yield", lambda: time.sleep(0))


def wait_on_host(work) -> None:
    """Wait on this thread for ``work`` (a ``torch.distributed`` work handle): poll it for up to
    :data:`HOST_SPIN_S`, yielding the core between polls, then block in ``work.wait()``, which raises the
    collective's error or its process group's timeout (Note [spin, then block])."""
    deadline = time.perf_counter() + HOST_SPIN_S
    while not work.is_completed() and time.perf_counter() < deadline:
        _yield_core()
    work.wait()


# Note [spin, then block]. A gloo collective completes on gloo's own threads, which then wake the
# thread blocked in ``wait()``. Where cores go idle while every thread waits (a VM's halted vCPU),
# that wake-up is slow: at one chunk per GPT-2 block most of the engine's waits are on exchanges the
# peer has already sent. So a host wait first polls the work, yielding the core between polls (gloo's
# threads run on it meanwhile), and blocks only after HOST_SPIN_S: a long wait (a slow peer) costs
# at most that much CPU, and the process group's timeout still ends a wait that never completes
# (``benchmarks/bench_launch.py``; ``docs/benchmarks.md``, launch-bound step).


_DONE = Pending()


@contextlib.contextmanager
def _issue_context(tensor: torch.Tensor, async_op: bool, issued: list | None = None):
    """Where an async collective on ``tensor`` is issued: on a device with streams the communication
    stream, after it waits for everything the compute stream has queued so far; elsewhere (or sync)
    right here. ``issued`` receives the communication stream, for the :class:`Pending`."""
    if not async_op or not uses_streams(tensor):
        yield
        return
    device = tensor.device
    compute, comm = stream_layer().current(device), stream_layer().communication(device)
    stream_layer().wait_stream(comm, compute)
    if issued is not None:
        issued.append(comm)
    with stream_layer().enter(comm):
        yield


def communication_stream(tensor: torch.Tensor):
    """Context that runs on ``tensor``'s device's communication stream (a device with streams), after
    everything the compute stream has queued; elsewhere it does nothing."""
    return _issue_context(tensor, True)


def _finish(work, epilogue, keep, async_op: bool, issued: list | None = None) -> Pending:
    if async_op:
        return Pending(work, epilogue, keep, issued[0] if issued else None)
    if work is not None:
        work.wait()
    if epilogue is not None:
        epilogue()
    return _DONE


def _tracked(tensor: torch.Tensor, tracker, kind: str) -> torch.Tensor:
    """``tensor``, counted as ``kind`` by ``tracker`` (a :class:`~torch_backend.zero.memory.AllocationTracker`,
    or ``None``) for as long as it lives."""
    return tensor if tracker is None else tracker.track(tensor, kind)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group, *, async_op: bool = False,
                    tracker=None) -> Pending:
    """Gather equal 1-D shards from every rank into ``output`` (rank order).

    Args:
        output: 1-D, ``W * shard.numel()`` elements, same dtype and device as ``shard``; written.
        shard: 1-D, this rank's contiguous shard (kept alive until the gather is waited for). A shard
            on another device (the host, for a parameter-offloaded chunk) is first copied to
            ``output``'s device, on the communication stream on CUDA.
        group: process group, or ``None`` for a single process (``output`` becomes a copy of ``shard``).
        async_op: return before the data has arrived; ``output`` is valid after ``wait()``.
        tracker: counts the device copy of an off-device shard (``staging``); ``None``: not counted.
    """
    if _world(group) == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard, non_blocking=True)
        return _DONE
    copy_in = shard.device != output.device
    if not copy_in and _world(group) == 2 and output.device.type == "cpu" and dist.get_backend(group) == "gloo":
        return _exchange_halves(output, shard.contiguous(), group, async_op)
    # allocated here, on the compute stream, so that its memory is reused only after the wait
    source = (_tracked(torch.empty(shard.shape, dtype=shard.dtype, device=output.device), tracker, "staging")
              if copy_in else shard.contiguous())
    issued: list = []
    with _issue_context(output, async_op, issued):
        if copy_in:
            source.copy_(shard, non_blocking=True)  # the host→device copy runs on the communication stream
        work = _ALL_GATHER_FLAT(output, source, group=group, async_op=async_op)
    return _finish(work, None, (output, source, shard), async_op, issued)


def _exchange_halves(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool) -> Pending:
    """gloo's all-gather at two ranks (Note [gather as an exchange]): this rank's shard is copied into
    its half of ``output`` and the other half is received straight into place, one all-to-all."""
    rank, n = dist.get_rank(group), shard.numel()
    other = output.narrow(0, (1 - rank) * n, n)
    splits = [0, n] if rank == 0 else [n, 0]
    issued: list = []
    with _issue_context(output, async_op, issued):
        work = dist.all_to_all_single(other, shard, output_split_sizes=splits, input_split_sizes=splits,
                                      group=group, async_op=async_op)
        output.narrow(0, rank * n, n).copy_(shard)
    return _finish(work, None, (output, shard), async_op, issued)


# Note [gather as an exchange]. At two ranks an all-gather is one exchange: each rank sends its shard
# and receives the other's. gloo's all-gather takes about 1.5x the wall time and 1.8x the CPU of the same
# bytes through its all-to-all (`benchmarks/bench_collectives.py`, `zero all_gather_flat` against
# `gloo all_gather_single`): so on gloo at W = 2 the gather is an all-to-all whose output is the other
# rank's half of the buffer (contiguous) and this rank's half is a local copy — the same bytes land,
# nothing is allocated. Every rank takes the same path (it depends on the group only), so the ranks
# still issue the same collective. At W > 2 the shard would have to be sent W − 1 times from one
# contiguous input (a copy per peer), so gloo's all-gather stays.


def reduce_scatter_avg(output: torch.Tensor, full: torch.Tensor, group, *, divide_first: bool = False,
                       async_op: bool = False, tracker=None, divisor: int | None = None) -> Pending:
    """Average ``full`` over the ranks and keep this rank's shard in ``output``.

    Args:
        output: 1-D, ``full.numel() // W`` elements; written with the mean of rank ``r``'s slice.
        full: 1-D gradient chunk of ``W * output.numel()`` elements. With ``divide_first`` it is
            divided in place by ``W`` before the reduction (fp16: keeps the sum in range).
        group: process group, or ``None`` for a single process.
        async_op: return at once; ``output`` holds the mean after ``wait()``.
        tracker: counts the receive buffer of gloo's all-to-all (``exchange_buffers``); ``None``: not counted.
        divisor: what the sum is divided by (default: ``W``; ``1``: the plain sum).
    """
    world = _world(group)
    if world == 1:
        if output.data_ptr() != full.data_ptr():
            output.copy_(full)
        return _DONE
    divisor = world if divisor is None else divisor
    if divide_first and divisor != 1:
        full.div_(divisor)
    epilogue = None if divide_first or divisor == 1 else (lambda: output.div_(divisor))
    backend = dist.get_backend(group)
    if backend == "gloo" and full.device.type == "cpu":
        return _exchange_and_sum(output, full, group, world, epilogue, async_op, tracker)
    issued: list = []
    if backend not in _NO_FLAT_REDUCE_SCATTER:
        try:
            with _issue_context(output, async_op, issued):
                work = _REDUCE_SCATTER_FLAT(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
            return _finish(work, epilogue, (output, full), async_op, issued)
        except (RuntimeError, NotImplementedError) as e:  # old gloo: flat reduce-scatter unsupported
            if "not supported" not in str(e).lower() and "unimplemented" not in str(e).lower():
                raise
            _NO_FLAT_REDUCE_SCATTER.add(backend)
    rank = dist.get_rank(group)
    n = output.numel()

    def copy_out():
        output.copy_(full[rank * n : (rank + 1) * n])
        if epilogue is not None:
            epilogue()

    issued.clear()
    with _issue_context(output, async_op, issued):
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _finish(work, copy_out, (output, full), async_op, issued)


def _exchange_and_sum(output, full, group, world: int, epilogue, async_op: bool, tracker=None) -> Pending:
    """gloo's reduce-scatter: an all-to-all (rank ``r`` receives every rank's slice ``r``) and a local
    sum in rank order. gloo implements the flat reduce-scatter as a whole all-reduce, which moves twice
    the bytes and sums the whole chunk on its own threads; this moves ``(W-1)/W`` of the chunk and sums
    only this rank's slice (half the CPU time of gloo's reduce-scatter on 2 ranks:
    ``benchmarks/bench_collectives.py``). Issued like the other collectives (a no-op context on a
    plain CPU; the communication stream under a stand-in stream layer).

    At 2 ranks nothing is allocated: each rank sends only the other's slice and receives the other's
    slice straight into ``output`` (uneven splits, the own slice sent to itself with size 0), then adds
    its own slice (``a + b == b + a`` exactly, so the result is the rank-order sum). With more ranks the
    own slice sits between the others', which one contiguous all-to-all input cannot skip: a receive
    buffer of the whole chunk holds every rank's slice (``exchange_buffers`` in ``tracker``)."""
    issued: list = []
    if world == 2:
        rank, n = dist.get_rank(group), output.numel()
        mine, other = full.narrow(0, rank * n, n), full.narrow(0, (1 - rank) * n, n)
        splits = [0, n] if rank == 0 else [n, 0]
        with _issue_context(output, async_op, issued):
            work = dist.all_to_all_single(output, other, output_split_sizes=splits, input_split_sizes=splits,
                                          group=group, async_op=async_op)

        def add_own():
            output.add_(mine)
            if epilogue is not None:
                epilogue()

        return _finish(work, add_own, (output, full), async_op, issued)
    received = _tracked(torch.empty_like(full), tracker, "exchange_buffers")
    with _issue_context(output, async_op, issued):
        work = dist.all_to_all_single(received, full, group=group, async_op=async_op)

    def sum_slices():
        torch.sum(received.view(world, -1), dim=0, out=output)
        if epilogue is not None:
            epilogue()

    return _finish(work, sum_slices, (output, full, received), async_op, issued)


def all_reduce_avg(tensor: torch.Tensor, group, *, divide_first: bool = False, async_op: bool = False,
                   divisor: int | None = None) -> Pending:
    """Average ``tensor`` over the ranks, in place (SUM then division; division first for fp16).

    ``divisor``: what the sum is divided by (default: the group's size; ``1``: the plain sum)."""
    world = _world(group)
    if world == 1:
        return _DONE
    divisor = world if divisor is None else divisor
    if divide_first and divisor != 1:
        tensor.div_(divisor)
    epilogue = None if divide_first or divisor == 1 else (lambda: tensor.div_(divisor))
    issued: list = []
    with _issue_context(tensor, async_op, issued):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _finish(work, epilogue, (tensor,), async_op, issued)


class _Then(Pending):
    """A collective followed by a second one issued when the first is waited for (the second reads the
    first's result: on gloo the reduce-scatter's local sum, on NCCL another group's stream)."""

    __slots__ = ("_first", "_then")

    def __init__(self, first: Pending, then: Callable[[], Pending]):
        super().__init__()
        self._first, self._then = first, then

    @property
    def done(self) -> bool:
        return self._first is None

    def free_after(self, stream) -> None:
        if self._first is not None:
            self._first.free_after(stream)

    def wait(self) -> None:
        first, self._first = self._first, None
        if first is None:
            return
        first.wait()
        self._then().wait()


def reduce_hybrid(output: torch.Tensor, full: torch.Tensor, shard_group, replica_group, *, world_size: int,
                  divide_first: bool = False, async_op: bool = False, tracker=None) -> Pending:
    """Hybrid sharding's gradient reduction: the mean of ``full`` over all ``world_size = S · R`` ranks,
    this rank's shard of it in ``output``.

    ``full`` is reduce-scattered (summed) over ``shard_group`` (``S`` ranks), or all-reduced there when
    ``output`` is ``full`` itself (a keep-gathered chunk); the result is then all-reduced (summed) over
    ``replica_group`` (``R`` ranks) and divided by ``world_size`` — or, with ``divide_first`` (fp16),
    ``full`` is divided by it before both. The replica all-reduce is issued when the first collective is
    waited for (with ``async_op`` it is the first that overlaps the computation).

    Args:
        output: 1-D, ``full.numel() // S`` elements (or ``full`` itself); holds the mean after ``wait()``.
        full: 1-D gradient chunk.
        shard_group, replica_group: process groups (:class:`~torch_backend.zero.sharding_groups.ShardingGroups`).
    """
    if divide_first:
        full.div_(world_size)
    rest = 1 if divide_first else world_size
    if output is full:
        first = all_reduce_avg(full, shard_group, async_op=async_op, divisor=1)
    else:
        first = reduce_scatter_avg(output, full, shard_group, async_op=async_op, tracker=tracker, divisor=1)

    def then() -> Pending:
        return all_reduce_avg(output, replica_group, divisor=rest)

    if not async_op:
        first.wait()
        return then()
    return _Then(first, then)


def agreement_group(group, *, timeout=None):
    """The group on which :func:`agree` runs: ``group`` itself on gloo, else a gloo group over the same
    ranks (votes are read on the host, so they must not queue behind the device's work). Collective
    over ``group`` only: every rank of it calls it, in the same order; ranks outside it (another
    data-parallel group of a larger job) need not (``use_local_synchronization``).

    ``timeout`` (``datetime.timedelta``) bounds every vote of the new group; by default the timeout
    ``group`` itself was created with (a job's ``--timeout``), never torch's 30-minute default."""
    if group is None or dist.get_backend(group) == "gloo":
        return group
    if timeout is None:
        timeout = process_group_timeout(group)
    kwargs = {} if timeout is None else {"timeout": timeout}
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True,
                          **kwargs)


def agree(votes: torch.Tensor, group, *, async_op: bool = False) -> Pending:
    """Sum a small CPU int tensor of votes over ``group``'s ranks, in place; with ``async_op`` the sum
    is there after ``wait()``."""
    if _world(group) == 1:
        return _DONE
    work = dist.all_reduce(votes, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if async_op:
        return Pending(work, None, (votes,))
    wait_on_host(work)
    return _DONE


def all_reduce_sum(tensor: torch.Tensor, group) -> None:
    """Sum ``tensor`` over the ranks, in place (used for squared norms and overflow flags)."""
    if _world(group) == 1:
        return
    if tensor.device.type != "cpu":  # queued on the device's stream: the host does not wait
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return
    wait_on_host(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True))


def broadcast_from_first(tensor: torch.Tensor, group) -> None:
    """Overwrite ``tensor`` on every rank with the group's rank-0 copy (initial parameters)."""
    if _world(group) > 1:
        src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        dist.broadcast(tensor, src=src, group=group)


# ============================================================================ small host-side agreements
# Used by checkpoints and the training run: a scalar mean, a port to agree on, per-rank JSON records,
# "did every rank succeed", a barrier. Tensor collectives only (never torch's object collectives), so
# peer data is never unpickled. ``group`` follows this module's rule: ``None`` means no distributed run.


def world_group():
    """The default process group when one is initialised (``torch.distributed.group.WORLD``), else ``None``."""
    return dist.group.WORLD if dist.is_initialized() else None


def _control_device(group) -> torch.device:
    """Where a group's small control tensors live: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_mean(value: float | torch.Tensor, group) -> float:
    """The mean of a scalar over the ranks of ``group`` (``float(value)`` for ``None``); float64 on gloo,
    float32 on NCCL. Every rank must call it: it is also a synchronisation point."""
    if _world(group) == 1:
        return float(value)
    device = _control_device(group)
    dtype = torch.float32 if device.type == "cuda" else torch.float64
    t = torch.as_tensor(value, dtype=dtype, device=device).detach().clone().reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return float(t / dist.get_world_size(group))


def broadcast_int(value: int, group) -> int:
    """The group's first rank's ``value`` (an int64, e.g. a port number), on every rank."""
    if _world(group) == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_control_device(group))
    broadcast_from_first(t, group)
    return int(t.item())


def all_gather_json(obj, group) -> list:
    """Every rank's JSON-serializable ``obj``, in rank order (``[obj]`` for ``None``); tuples come back
    as lists.

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


def barrier(group) -> None:
    """Wait until every rank of ``group`` arrives (nothing for ``None``)."""
    if _world(group) > 1:
        dist.barrier(group=group)
