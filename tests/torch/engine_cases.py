"""Workers of the engine tests: memory discipline (gathered chunks at every leaf-module boundary
against an oracle traced on the plain module), frozen chunks, prefetch and the recorded order.

The oracle: on an unwrapped copy of the module, a torch-function mode records which parameters each
torch call uses in forward and saved-tensor hooks record which parameters each unpack needs in
backward, interleaved with the leaf modules' forward and backward hook events. A chunk is *in use*
at an event if one of its tensors was used before it and one is used after it in the same pass
(forward, or backward); in forward also at the event just before its first use (the pre-hook of the
module that first reads it: a unit gathers its chunk there, Note [recorded units] in
``torch_backend/zero/units.py``). At every event a correct engine holds at most the chunks in use there plus
``prefetch``; an engine that never releases holds every chunk it ever gathered.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from zero_cases import (
    ADAMW,
    FP32,
    assert_state_within_noise,
    average_grads,
    gpt2_loss,
    hf_gpt2,
    micro,
    micro_batch_reference_run,
    reference_run,
    zero_run,
)


def gpt2(n_layer: int = 8, n_embd: int = 32, frozen_blocks: tuple[int, ...] = ()):
    return hf_gpt2(n_layer=n_layer, n_embd=n_embd, frozen_blocks=frozen_blocks)


class Reorderable(nn.Module):
    """A GPT-2 LM whose blocks can run in reverse order (another chunk use order, same parameters)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, batch, reverse: bool = False):
        h = self.lm.transformer
        x = h.wte(batch) + h.wpe(torch.arange(batch.shape[1]))
        for block in (reversed(h.h) if reverse else h.h):
            x = block(x)
        return nn.functional.cross_entropy(self.lm.lm_head(h.ln_f(x)).flatten(0, 1), batch.flatten())


def leaves(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in module.named_modules() if not list(m.children())]


def hook_events(module: nn.Module, on_event) -> list:
    """Call ``on_event(tag)`` at every leaf module's forward pre/post and backward pre/post hook."""
    handles = []
    for name, m in leaves(module):
        handles.append(m.register_forward_pre_hook(lambda *_, n=name: on_event(("fwd-pre", n))))
        handles.append(m.register_forward_hook(lambda *_, n=name: on_event(("fwd-post", n))))
        handles.append(m.register_full_backward_pre_hook(lambda *_, n=name: on_event(("bwd-pre", n))))
        handles.append(m.register_full_backward_hook(lambda *_, n=name: on_event(("bwd-post", n))))
    return handles


class _UseTracer(TorchFunctionMode):
    def __init__(self, by_id, trace):
        super().__init__()
        self.by_id, self.trace = by_id, trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in (*args, *(kwargs or {}).values()):
            for b in a if type(a) in (list, tuple) else (a,):
                name = self.by_id.get(id(b))
                if name is not None:
                    self.trace.append(("use", name))
        return func(*args, **(kwargs or {}))


def reference_trace(module: nn.Module, loss_fn, batch) -> list:
    """The event sequence of one forward+backward of the plain ``module``: ``("use", param name)`` and
    the hook events of :func:`hook_events`, with ``("phase", "backward")`` between the passes."""
    trace: list = []
    names = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    storages = {p.untyped_storage()._cdata: n for n, p in module.named_parameters()}

    def pack(t):
        name = names.get(id(t))
        if name is None and isinstance(t, torch.Tensor):
            try:
                name = storages.get(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                name = None
        return (t, name)

    def unpack(x):
        t, name = x
        if name is not None:
            trace.append(("use", name))
        return t

    handles = hook_events(module, trace.append)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _UseTracer(names, trace):
            loss = loss_fn(module, batch)
        trace.append(("phase", "backward"))
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    module.zero_grad(set_to_none=True)
    return trace


def in_use_bounds(trace: list, chunk_of: dict[str, int]) -> list[int]:
    """Per hook event of ``trace``: how many chunks are in use there (see the module docstring)."""
    split = trace.index(("phase", "backward"))
    bounds = []
    for lo, hi in ((0, split), (split + 1, len(trace))):
        part = trace[lo:hi]
        first, last = {}, {}
        for i, (kind, what) in enumerate(part):
            if kind == "use":
                c = chunk_of[what]
                first.setdefault(c, i)
                last[c] = i
        early = 1 if lo == 0 else 0  # forward: from the event before the first use (a unit's pre-hook)
        for i, (kind, _) in enumerate(part):
            if kind != "use":
                bounds.append(sum(1 for c in first if first[c] - early <= i < last[c]))
    return bounds


def gathered_at_events(model, loss_fn, batch) -> list[int]:
    counts: list[int] = []
    handles = hook_events(model.module, lambda tag: counts.append(len(model.gathered_chunks())))
    try:
        loss_fn(model, batch).backward()
    finally:
        for h in handles:
            h.remove()
    return counts


def check_discipline(model, reference_module, batch, prefetch: int) -> dict:
    """Run ``model`` (a ZeroDDP) and compare its gathered chunks at every leaf boundary with the bound."""
    chunk_of = {}
    for t in model.layout.tensors:
        for n in t.names:
            chunk_of[n] = t.chunk
    trace = reference_trace(reference_module, gpt2_loss, batch)
    bounds = in_use_bounds(trace, chunk_of)
    counts = gathered_at_events(model, gpt2_loss, batch)
    model.zero_grad()
    assert len(counts) == len(bounds), (len(counts), len(bounds))
    over = [(i, c, b + prefetch) for i, (c, b) in enumerate(zip(counts, bounds)) if c > b + prefetch]
    assert not over, f"gathered chunks above in-use + prefetch at (event, gathered, bound): {over[:8]}"
    return {"max_gathered": max(counts), "max_bound": max(bounds) + prefetch, "events": len(counts)}


def worker_memory_discipline(rank: int, world: int):
    """Issue 11's memory check: an 8-layer GPT-2 spanning ≥ 8 chunks, prefetch=1, W ranks; and a
    never-release engine fails the same check."""
    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.zero.chunks import Chunk

    out = {}
    for name, frozen in (("trainable", ()), ("half-frozen", (0, 2, 4, 6))):
        module = gpt2(frozen_blocks=frozen)
        ref = copy.deepcopy(module)
        model = ZeroDDP(module, chunk_size=6000, prefetch=1)
        sharded = [c for c in model.layout.chunks if not c.keep_gathered]
        assert len(sharded) >= 8, model.layout.summary()
        optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
        g = torch.Generator().manual_seed(3)
        batch = torch.randint(0, 64, (2 * world, 8), generator=g)
        mine = micro(batch, rank, world)
        for _ in range(2):  # record the order, then run with it
            optim.backward(gpt2_loss(model, mine))
            optim.step()
            optim.zero_grad()
        stats = check_discipline(model, ref, mine, prefetch=1)
        assert stats["max_gathered"] <= 4, stats
        frozen_chunks = [c for c in model.chunks if not c.requires_grad]
        assert bool(frozen) == bool(frozen_chunks)
        assert all(c.master is None and c.gradient is None for c in frozen_chunks)
        report = optim.memory_report()
        assert report.total("fp32_master") == 0  # fp32: the master is the parameter shard; frozen: none
        out[name] = stats

    # the mutant: an engine that never releases a chunk fails the same check
    original = Chunk.release
    Chunk.release = lambda self: False
    try:
        module = gpt2()
        ref = copy.deepcopy(module)
        model = ZeroDDP(module, chunk_size=6000, prefetch=1)
        batch = micro(torch.randint(0, 64, (2 * world, 8), generator=torch.Generator().manual_seed(3)), rank, world)
        try:
            check_discipline(model, ref, batch, prefetch=1)
        except AssertionError as e:
            out["never-release"] = str(e)[:200]
        else:
            raise AssertionError("a never-releasing engine passed the memory check")
    finally:
        Chunk.release = original
    return out


def worker_prefetch_order(rank: int, world: int):
    """Prefetch follows the recorded order (no misses once recorded), is re-recorded when the order
    changes, and prefetch 0, 1 and 2 train to the same values as the single-process reference."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    data = [torch.randint(0, 64, (2 * world, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    results = {}
    for prefetch in (0, 1, 2):
        module = gpt2(n_layer=4)
        ref, ref_other = copy.deepcopy(module), copy.deepcopy(module)
        model = ZeroDDP(module, chunk_size=6000, prefetch=prefetch)
        optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
        zero_run(model, optim, gpt2_loss, data[:2], rank, world)
        before = model.collective_stats
        zero_run(model, optim, gpt2_loss, data[2:], rank, world)
        after = model.collective_stats
        misses = after["misses"] - before["misses"]
        if prefetch > 0 and world > 1:  # only the forward's first chunk: nothing runs before it
            assert misses == 1, (prefetch, before, after)
            # and every other gather was issued before the chunk's use, so it overlapped computation
            assert after["late_gathers"] == before["late_gathers"], (prefetch, before, after)
        else:
            assert misses == after["gathers"] - before["gathers"], (before, after)  # every gather on demand
        reference_run(ref, gpt2_loss, data, torch.optim.AdamW, ADAMW)
        micro_batch_reference_run(ref_other, gpt2_loss, data, world, torch.optim.AdamW, ADAMW)
        assert_state_within_noise(model.state_dict(), ref.state_dict(), ref_other.state_dict(), **FP32)
        results[prefetch] = after
        # right after a backward (reductions maybe still in flight) grad_shard is the complete gradient
        optim.backward(gpt2_loss(model, micro(data[0], rank, world)))
        shards = [model.grad_shard(c.index) for c in model.chunks]
        assert all(g is not None for g in shards), (prefetch, [g is None for g in shards])
        shards = [g.clone() for g in shards]
        model.finish_gradients()
        for c, g in zip(model.chunks, shards):
            assert torch.equal(g, c.master.grad), (prefetch, c.index)
        optim.zero_grad()

    # another order: the blocks run in reverse in step 2; the order is re-recorded and stays exact
    module = Reorderable(gpt2(n_layer=4))
    ref, ref_other = copy.deepcopy(module), copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=6000, prefetch=1)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    other_opt = torch.optim.AdamW(ref_other.parameters(), **ADAMW)
    for step, reverse in enumerate((False, True, True)):
        recorded = model.collective_stats["order_recordings"]
        optim.backward(model(micro(data[step], rank, world), reverse=reverse))
        optim.step()
        optim.zero_grad()
        if step == 1 and world > 1:  # at world size 1 every chunk is resident: nothing to order
            assert model.collective_stats["order_recordings"] > recorded
        ref(data[step], reverse=reverse).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for r in range(world):
            ref_other(micro(data[step], r, world), reverse=reverse).backward()
        average_grads(list(ref_other.parameters()), world)
        other_opt.step()
        other_opt.zero_grad()
    assert_state_within_noise(model.state_dict(), ref.state_dict(), ref_other.state_dict(), **FP32)
    results["reordered"] = model.collective_stats
    return results
