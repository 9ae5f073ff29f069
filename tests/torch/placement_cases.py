"""Workers and helpers of the ``placement="auto"`` tests (run in spawned gloo processes or in-process).

The reference is ``placement="static"`` with nothing offloaded on the same per-rank batches; fp32,
so training must agree to rtol 1e-5 (only copies differ: nothing may be lost in a move).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from zero_cases import ADAMW, FP32

from chunkzero import Location, plan_placement
from torch_backend import ZeroDDP, ZeroOptimizer
from torch_backend.train.gpt import GPT, GPTConfig

STEPS = 4
CHUNK_SIZE = 4000


def base_model() -> GPT:
    """A 4-layer byte-level GPT (width 32, vocabulary 64, tied head): 17 chunks at CHUNK_SIZE."""
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32))


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(batch).flatten(0, 1), batch.flatten())


def batches(rank: int, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(steps)]


def train(module, data, *, fraction: float | None = None, policy: str = "auto", **kwargs):
    """Train ``module`` under ZeroDDP on ``data``; with ``fraction`` the budget is set after the
    warm-up step to ``budget_for_fraction(fraction)`` and the plan uses ``policy``. For every planned
    access the device set (after the access's moves) is recorded with the plan's, in ``checks``."""
    model = ZeroDDP(module, chunk_size=CHUNK_SIZE, **kwargs)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    ap = model.auto_placement
    checks: list[tuple[set, set]] = []
    if ap is not None:
        ap.policy = policy
        accessed = ap.accessed

        def checking(phase, chunk):
            accessed(phase, chunk)
            if ap._on_plan and ap._pos > 0:
                step = ap.plan.step(ap._k)
                t = ap._pos - 1
                want = {i for i, c in enumerate(model.chunks) if not c.resident and _on_device_in_plan(step, i, t)}
                have = {
                    i
                    for i, p in enumerate(ap.placements)
                    if p.param is Location.DEVICE and not model.chunks[i].resident
                }
                checks.append((want, have - set(ap._early)))

        ap.accessed = checking
    for s, batch in enumerate(data):
        loss = loss_of(model, batch)
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        if s == 0 and fraction is not None:
            ap.budget_bytes = ap.budget_for_fraction(fraction)
    return model, optim, checks


def _on_device_in_plan(step, chunk: int, t: int) -> bool:
    """Whether ``chunk`` is on the device during access ``t`` of ``step`` (replaying its moves)."""
    on = chunk in step.resident_at_start
    for u in range(t + 1):
        if chunk in step.evict[u]:
            on = False
        if chunk in step.prefetch[u]:
            on = True
    return on


def assert_same_training(a: ZeroDDP, b: ZeroDDP) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], **FP32, msg=lambda m, k=k: f"{k}: {m}")


def static_plan_bytes(ap) -> float:
    """Bytes per step of Gemini's static policy at the same budget over the same trace."""
    t = ap.trace
    extra = [a + b + ap.resident_bytes for a, b in zip(t.non_model_bytes, t.transient_bytes)]
    return plan_placement(ap.chunk_bytes, t.access_order, extra, ap.budget_bytes, policy="static").bytes_moved_per_step


def worker_half_budget(rank: int, world: int) -> dict:
    """At half the model state (``budget_for_fraction(0.5)``): ``auto`` and the static policy run
    through the engine train exactly as static placement without offload; each moves, every step
    after the warm-up, the bytes its plan says, the device set follows the plan at every access, the
    optimizer state of the ``optim_host`` chunks is on the host, and ``auto`` moves fewer bytes than
    the static policy."""
    base, data = base_model(), batches(rank)
    ref, _, _ = train(copy.deepcopy(base), data)
    auto, _, auto_checks = train(copy.deepcopy(base), data, fraction=0.5, placement="auto")
    static, _, static_checks = train(copy.deepcopy(base), data, fraction=0.5, policy="static", placement="auto")
    assert_same_training(ref, auto)
    assert_same_training(ref, static)
    out = {}
    for name, model, checks in (("auto", auto, auto_checks), ("static", static, static_checks)):
        ap = model.auto_placement
        plan = ap.plan
        assert ap.traces == 1 and plan is not None
        assert plan.policy == ("belady" if name == "auto" else "static"), plan.policy
        # step 0: warm-up (nothing moves), step 1: entering the cycle; then exactly the plan's bytes
        assert ap.step_bytes_moved[0] == 0
        steady = ap.step_bytes_moved[2:]
        assert steady == [plan.step(k + 1).bytes_moved for k in range(len(steady))], (steady, plan.bytes_moved_per_step)
        assert len(checks) == (STEPS - 1) * len(ap.trace.access_order)
        for want, have in checks:
            assert want == have, (want, have)
        for i in plan.optim_host:
            assert ap.placements[i].optim_state is Location.HOST
        assert all(
            p.optim_state is Location.DEVICE
            for i, p in enumerate(ap.placements)
            if p.trainable and i not in plan.optim_host
        )
        out[name] = sum(steady) / len(steady)
    assert 0 < out["auto"] < out["static"], out
    assert out["static"] == static_plan_bytes(auto.auto_placement), out
    out["model_bytes"] = sum(auto.auto_placement.chunk_bytes)
    if world > 1:
        dist.barrier()
    return out
