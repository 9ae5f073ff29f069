"""Workers of the fixed-schedule tests (Note [fixed schedule] in ``torch_backend.zero.round_plans``):
a 4-block GPT-2 over several chunks at W = 2 trains for :data:`STEPS` steps; the schedule is fixed
(rounds replayed) from the fourth step (two equal recordings, then replay), and at step :data:`CHANGE`
the order changes on every rank or on one rank only."""

from __future__ import annotations

import copy

import torch
from engine_cases import Reorderable, gpt2
from zero_cases import ADAMW, FP32, assert_state_close, average_grads, micro

STEPS = 10
CHANGE = 5
KINDS = ("all-reverse", "one-reverse", "one-touch")
"""``all-reverse``: every rank runs the blocks in reverse from step :data:`CHANGE` on (an order change);
``one-reverse``: rank 1 alone, at that step only (a forward divergence); ``one-touch``: rank 1 alone,
at that step, reads block 0's weight in a gradient hook between blocks 2 and 1 (a backward divergence:
a chunk gathered mid-backward that the plan gathers later)."""


class Diverging(Reorderable):
    """:class:`engine_cases.Reorderable` whose forward can also hook block 2's output gradient with a
    read of block 0's weight (``touch``): the same gradients, another chunk use in backward."""

    def forward(self, batch, reverse: bool = False, touch: bool = False):
        h = self.lm.transformer
        x = h.wte(batch) + h.wpe(torch.arange(batch.shape[1]))
        for i, block in enumerate(reversed(h.h) if reverse else h.h):
            x = block(x)
            if touch and i == 2:
                w = h.h[0].mlp.c_fc.weight
                x.register_hook(lambda g, w=w: g + 0.0 * w.sum())
        return torch.nn.functional.cross_entropy(self.lm.lm_head(h.ln_f(x)).flatten(0, 1), batch.flatten())


def how(kind: str, step: int, rank: int) -> dict:
    """The forward's keywords on ``rank`` at ``step``."""
    if kind == "all-reverse":
        return {"reverse": step >= CHANGE}
    if step != CHANGE or rank != 1:
        return {}
    return {"reverse": True} if kind == "one-reverse" else {"touch": True}


def worker_change(rank: int, world: int, kind: str, blind: bool = False):
    """Train with ``kind``'s change; check the state against the single-process reference that runs
    each rank's micro-batch as that rank does; return ``collective_stats`` after each step.
    ``blind``: the mutant — replay without comparing this rank's votes with the plan's."""
    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.zero.round_plans import RoundPlans

    original = RoundPlans.take
    if blind:
        def take(self, local, wait):
            plan, pos = self._replay, self._pos
            if pos < len(plan):
                self._pos = pos + 1
                return plan[pos]
            return None
        RoundPlans.take = take
    try:
        data = [torch.randint(0, 64, (2 * world, 8), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
        module = Diverging(gpt2(n_layer=4))
        ref = copy.deepcopy(module)
        model = ZeroDDP(module, chunk_size=6000, prefetch=1)
        optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
        ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
        stats = []
        for step in range(STEPS):
            optim.backward(model(micro(data[step], rank, world), **how(kind, step, rank)))
            optim.step()
            optim.zero_grad()
            stats.append(model.collective_stats)
            for r in range(world):
                ref(micro(data[step], r, world), **how(kind, step, r)).backward()
            average_grads(list(ref.parameters()), world)
            ref_opt.step()
            ref_opt.zero_grad()
        assert_state_close(model.state_dict(), ref.state_dict(), **FP32)
        return stats
    finally:
        RoundPlans.take = original
