"""The engine's memory is counted where it is allocated (``AllocationTracker``, ``memory_report``'s
``allocated`` / ``peak_allocated``) and bounded: during a backward, no more full gradient chunks are
alive than the chunks still accumulating plus the reductions in flight (issue "Memory true at scale":
a chunk released in the middle of its backward lost its tensors' READY_FOR_REDUCE states, so it was
reduced only at the end of the backward, and every chunk's gradient buffer stayed alive until then)."""

from __future__ import annotations

import gc

import memory_cases
import pytest
import torch
from memory_cases import LAYER_NUMEL, Stack, backward_peaks, chunk_bytes

from torch_backend import ZeroDDP
from torch_backend._testing import run_distributed
from torch_backend.zero.memory import AllocationTracker

FULL_GRADIENT_KINDS = ("gradient_buffers", "reduce_inputs")


def test_tracker_counts_current_and_peak_by_device_and_kind():
    tr = AllocationTracker()
    a = tr.track(torch.empty(10), "gradient_buffers")
    key = tr.add("gathered_buffers", "cpu", 100)
    assert tr.current["cpu"] == {"gradient_buffers": 40, "gathered_buffers": 100} and tr.peak_total["cpu"] == 140
    tr.track(a, "reduce_inputs")  # the same tensor changes kind: counted once
    assert tr.current["cpu"]["gradient_buffers"] == 0 and tr.current["cpu"]["reduce_inputs"] == 40
    assert tr.total() == 140
    del a
    gc.collect()
    assert tr.total("cpu") == 100  # freed when the tensor object goes
    tr.free(key)
    tr.free(key)  # a second free of the same key: nothing
    assert tr.total() == 0 and tr.peak_total["cpu"] == 140 and tr.peak["cpu"]["gathered_buffers"] == 100
    tr.reset_peak()
    assert tr.peak_total["cpu"] == 0 and tr.peak["cpu"] == {}


def test_gradient_buffers_within_the_bound_in_backward():
    """Parameter-offloaded at W=1 (each use gathers, each release frees, as at W > 1), 4 chunks of two
    layers: each chunk is reduced as soon as its gradients are final, so at most 2 full gradient chunks
    are alive at once (one accumulating, the boundary one). Before the fix every chunk's buffer lived
    until the end of the backward: 4."""
    model = ZeroDDP(Stack(), chunk_size=2 * LAYER_NUMEL, offload_param_frac=1.0)
    assert len(model.chunks) == 4 and all(not c.resident for c in model.chunks)
    peaks = backward_peaks(model, torch.randn(4, memory_cases.WIDTH))
    full = sum(peaks.get(k, 0) for k in FULL_GRADIENT_KINDS)
    assert 0 < peaks["gradient_buffers"] <= full <= 2 * chunk_bytes(model), peaks


def test_allocated_agrees_with_the_tensors_held():
    """The tracker's current count (kept from allocation events) equals the bytes of the tensors the
    chunks hold now (counted from the tensors), after a backward: parameters, fp32 gradient shards."""
    model = ZeroDDP(Stack(), chunk_size=2 * LAYER_NUMEL, offload_param_frac=1.0)
    model.backward(model(torch.randn(4, memory_cases.WIDTH)))
    model.synchronize()
    r = model.memory_report()
    assert r.allocated_total("parameters") == r.total("parameters") > 0
    assert r.allocated_total("fp32_gradients") == r.total("gradients") > 0
    assert r.allocated_total() == r.total()  # nothing else is left allocated
    assert r.allocated_total(peak=True) > r.allocated_total()  # gathered buffers and copies came and went


def test_gradient_buffers_bounded_and_exact_at_two_ranks():
    """W=2 gloo, prefetch 1: the full gradient chunks alive at once stay within accumulating (≤ 2) plus
    in flight (1), the 2-rank exchange allocates no receive buffer, and each rank's reduced shard is
    the mean of the two ranks' gradients (a single-process reference on the whole batch)."""
    reports = run_distributed(memory_cases.worker_gradient_bound, 2, timeout=200)
    for rep in reports:
        peaks = rep["peaks"]
        full = sum(peaks.get(k, 0) for k in FULL_GRADIENT_KINDS)
        assert 0 < full <= 3 * rep["chunk_bytes"], peaks
        assert peaks.get("exchange_buffers", 0) == 0, peaks
    ref = Stack()
    torch.manual_seed(1)
    x = torch.randn(8, memory_cases.WIDTH)
    (ref(x[:4]) + ref(x[4:])).div(2).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    got = []
    for c in range(reports[0]["chunks"]):
        for rep in reports:
            got += rep["grads"][c]
    torch.testing.assert_close(torch.tensor(got)[: flat.numel()], flat, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tracker_peak_against_cuda_allocator():
    """On CUDA the engine's counted peak is at most the allocator's, and the allocator's peak exceeds
    it by no more than the activations and torch's own temporaries of this small model (8 MiB)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    model = ZeroDDP(Stack().to(dev), chunk_size=2 * LAYER_NUMEL, offload_param_frac=1.0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model.reset_peak_memory()
    x = torch.randn(4, memory_cases.WIDTH, device=dev)
    model.backward(model(x))
    model.synchronize()
    torch.cuda.synchronize()
    r = model.memory_report()
    counted = r.allocated_total(device=str(dev), peak=True)
    allocator = torch.cuda.max_memory_allocated(dev)
    assert 0 < counted <= allocator <= counted + 8 * 2**20, (counted, allocator)
    now = torch.cuda.memory_allocated(dev)
    assert r.allocated_total(device=str(dev)) <= now <= r.allocated_total(device=str(dev)) + 2**20
