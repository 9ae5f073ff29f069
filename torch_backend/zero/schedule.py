"""Which chunk collectives to issue, and when — decided identically on every rank.

Ranks may use different chunks in one step (an MoE expert that gets tokens on one rank only, a
data-dependent branch) or use them in a different order, so a collective cannot simply follow each
rank's own use order: two ranks would issue different all-gathers at the same moment and the job
would abort or, worse, mix two chunks' shards. Every chunk collective is therefore decided in a
**round**: each rank contributes a small vector of votes and one all-reduce (SUM) of it gives every
rank the same decision, which each issues in the same order (gathers by chunk index, then reductions
by chunk index):

- ``want[c]`` — this rank needs chunk ``c`` gathered (now, or ahead of use: prefetch). Any vote
  gathers it on every rank (a rank that has it already gathers it again in place).
- ``ready[c]`` — this rank's gradient contribution to ``c`` is final. A chunk is reduced when every
  rank is ready and at least one has a gradient (``has_grad[c]``); a rank without one takes part
  with zeros (data-parallel averaging, as DDP with unused parameters).
- ``done`` — this rank has finished the current forward or backward; rounds continue until all are
  (so a rank that finished early still serves the others' gathers and reductions).
- ``used[t]`` — at the end of a backward, which tensors received a gradient here (the sum tells
  which received none on any rank).

A round happens only where a rank needs a decision: at a miss (a chunk used while not gathered), when
the prefetch window has room, when a gradient chunk is ready with nothing else pending (``prefetch=0``),
and at the end of each forward and backward. Rounds pair up across ranks in sequence whatever each
rank votes for, so ranks never diverge; at world size 1 there are none. Prefetch follows the order in
which chunks were first used during the previous step (Gemini's ``max_prefetch`` over its recorded
order), re-recorded whenever the order changes; a chunk used out of that order is simply a miss.

With ``prefetch > 0`` all-gathers and reduce-scatters are issued asynchronously (gloo work handles;
CUDA: a communication stream, see :mod:`torch_backend.zero.collectives`) so the prefetched gathers and
the reductions of finished chunks overlap the computation; at most ``max(1, prefetch)`` reductions
are in flight (the oldest is completed before the next is issued), which bounds the gradient memory. The prefetch votes
are asynchronous too: a vote cast at chunk ``k``'s first use is decided at the next chunk's, so it
asks for the chunks up to ``prefetch + 1`` ahead, and the gathers it decides are issued a chunk ahead
of their use (``late_gathers`` counts those issued only at their use).

Once a step repeats, its rounds are replayed instead of all-reduced (the fixed schedule, Note [fixed
schedule] in :mod:`torch_backend.zero.round_plans`): only the end rounds stay real, and they check it.
"""

from __future__ import annotations

import enum
from collections import deque

import torch

from . import collectives
from .chunks import Chunk
from .round_plans import RoundPlans

__all__ = ["AccessOrder", "Phase", "Scheduler", "Votes"]

class Phase(enum.Enum):
    """A part of the step with its own recorded access order."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OUTSIDE = "outside"
    """A submodule called directly under ``no_grad`` (``model.module.generate(...)``)."""

    __hash__ = object.__hash__  # members are singletons: identity, hashed in C


FORWARD, BACKWARD, OUTSIDE = Phase.FORWARD, Phase.BACKWARD, Phase.OUTSIDE
_NO_WORK = collectives.Pending()
"""A finished collective (a replayed round has none to wait for)."""


class AccessOrder:
    """The order in which chunks were first used (after each gather) in one phase of the last step.

    ``previous`` is the recorded order (``None`` before the first step); ``current`` is being recorded.
    :meth:`upcoming` names the chunks expected next, for prefetch.
    """

    def __init__(self):
        self.previous: list[int] | None = None
        self.current: list[int] = []
        self.pos = 0
        self.in_step = False
        """Whether this phase's accesses still follow ``previous`` (set by :meth:`start`)."""
        self.recordings = 0
        """How many times the order was (re-)recorded."""

    def start(self) -> None:
        self.current = []
        self.pos = 0
        self.in_step = self.previous is not None

    def access(self, chunk: int) -> None:
        self.current.append(chunk)
        prev = self.previous
        if prev is None or not self.in_step:
            return
        if self.pos < len(prev) and prev[self.pos] == chunk:
            self.pos += 1
            return
        try:  # the order changed: resume after the next occurrence, if any
            self.pos = prev.index(chunk, self.pos) + 1
        except ValueError:
            self.in_step = False

    def first(self, count: int) -> list[int]:
        """Up to ``count`` distinct chunks expected first in the phase (from the recorded order)."""
        return self._distinct(self.previous or [], count, None)

    def upcoming(self, count: int, exclude: int | None = None) -> list[int]:
        """Up to ``count`` distinct chunks expected after the current position."""
        if not self.in_step:
            return []
        return self._distinct(self.previous[self.pos :], count, exclude)

    @staticmethod
    def _distinct(order: list[int], count: int, exclude: int | None) -> list[int]:
        if count <= 0:
            return []
        out: list[int] = []
        for c in order:
            if c != exclude and c not in out:
                out.append(c)
                if len(out) == count:
                    break
        return out

    def end(self) -> None:
        if self.current and self.current != self.previous:
            self.previous = list(self.current)
            self.recordings += 1
        self.current = []


class Votes:
    """One round's votes, as named views of the one int32 tensor the round all-reduces (SUM).

    Args:
        chunks: chunks in the layout.
        tensors: tensors in the layout.

    Attributes:
        tensor: the whole vector, ``3 · chunks + 6 + tensors`` elements (what the all-reduce sums).
        want, ready, has_grad: per chunk (module docstring).
        done: 0-d: ranks that have finished the phase.
        first_end: 0-d: ranks casting their first end round of the phase (``W`` with ``done == W``:
            every rank cast as many rounds before it, the interval was clean).
        diverged: 0-d, end rounds: ranks that left the replayed plan in this interval
            (:mod:`~torch_backend.zero.round_plans`).
        next_key, next_key_sq: 0-d, end rounds: the code of the interval that follows, and its square
            (equal on every rank iff ``W · Σ key² == (Σ key)²``).
        next_plan: 0-d, end rounds: ranks that hold a plan for the interval that follows.
        used: per tensor: ranks on which it received a gradient in this backward.
        head: the vector without ``used`` (all that a round other than an end round carries: what a
            plan keeps of it).
    """

    __slots__ = ("diverged", "done", "first_end", "has_grad", "head", "next_key", "next_key_sq", "next_plan", "ready",
                 "tensor", "used", "want")

    def __init__(self, chunks: int, tensors: int):
        self.tensor = torch.zeros(3 * chunks + 6 + tensors, dtype=torch.int32)
        self.want = self.tensor[:chunks]
        self.ready = self.tensor[chunks : 2 * chunks]
        self.has_grad = self.tensor[2 * chunks : 3 * chunks]
        (self.done, self.first_end, self.diverged, self.next_key, self.next_key_sq,
         self.next_plan) = self.tensor[3 * chunks : 3 * chunks + 6]
        self.used = self.tensor[3 * chunks + 6 :]
        self.head = self.tensor[: 3 * chunks + 6]


class Scheduler:
    """Issues the chunk collectives of one :class:`~torch_backend.ZeroDDP` (see the module docstring).

    Args:
        chunks: every chunk, by index.
        num_tensors: tensors in the layout (length of the ``used`` votes).
        group: the agreement group (:func:`torch_backend.zero.collectives.agreement_group`), ``None`` alone.
        world_size: ranks in the data-parallel group.
        prefetch: chunks gathered ahead of use; ``0``: no prefetch and blocking collectives.
    """

    def __init__(self, chunks: list[Chunk], *, num_tensors: int, group, world_size: int, prefetch: int):
        self.chunks = chunks
        self.n = len(chunks)
        self.num_tensors = num_tensors
        self.group = group
        self.world_size = world_size
        self.prefetch = prefetch
        self.async_op = prefetch > 0
        self.orders = {FORWARD: AccessOrder(), BACKWARD: AccessOrder(), OUTSIDE: AccessOrder()}
        self.ready: set[int] = set()
        self._reducing: deque[int] = deque()
        self.rounds = 0
        """Rounds (vote all-reduces) so far."""
        self._pending: tuple[Votes, collectives.Pending, set[int]] | None = None
        self.gathers = 0
        """All-gathers issued so far (prefetched or on demand)."""
        self.misses = 0
        """Uses of a chunk that was neither gathered nor being gathered (an on-demand gather)."""
        self.late_gathers = 0
        """Prefetched gathers issued only at the chunk's use (voted for ahead, decided too late to overlap)."""
        self.peak_gathered = 0
        """The most sharded chunks gathered or being gathered at once."""
        self.policy = None
        """The placement policy told of the step at named points (:meth:`set_policy`)."""
        self.plans = RoundPlans(self._decisions)
        """The fixed schedule (:mod:`torch_backend.zero.round_plans`); unused at world size 1."""

    def set_policy(self, policy) -> None:
        """Tell ``policy`` (``placement="auto"``: :class:`torch_backend.zero.placement.AutoPlacement`) of
        the step at named points: ``phase_started(phase)``; ``accessed(phase, chunk)`` at each recorded
        access, before its gather; ``gathering(chunk)`` before each gather is issued;
        ``phase_ended(phase)`` after the order is recorded. It never calls the scheduler back."""
        self.policy = policy

    # ------------------------------------------------------------------ phases
    def start(self, phase: Phase) -> None:
        """A forward or backward begins: chunks still gathered from the previous phase count as
        not yet used in this one (so their first use is recorded)."""
        self.orders[phase].start()
        for c in self.chunks:
            c.forget_uses()
        if self.policy is not None:
            self.policy.phase_started(phase)

    def end(
        self, phase: Phase, used: torch.Tensor | None = None, prefetch_next: Phase | None = None, *, sync: bool = True
    ) -> torch.Tensor | None:
        """Rounds until every rank has finished ``phase``; returns the summed ``used`` votes (backward).

        ``prefetch_next``: the phase that follows, whose first recorded chunks are gathered now (the
        backward's first chunks at the end of a forward, so the backward does not start on a miss).
        ``sync``: whether the backward that follows (or this one) reduces; part of the next interval's
        key (Note [fixed schedule]).
        """
        self.orders[phase].end()
        if self.policy is not None:
            self.policy.phase_ended(phase)
        first = [] if prefetch_next is None else self.orders[prefetch_next].first(self.prefetch + 1)
        want = [i for i in first[: self.prefetch] if not self._present(self.chunks[i])]
        if self.world_size == 1:
            self._round(want=want)
            return used
        if self.plans.pending_rest():  # fewer rounds than the plan: issue its rest as the others do
            self._diverge()
        codes = {FORWARD: 4, BACKWARD: 8, OUTSIDE: 12}
        key = None if phase is OUTSIDE else codes[phase] + 2 * (prefetch_next is not None) + int(sync)
        context = tuple(tuple(self.orders[p].previous or ()) for p in (FORWARD, BACKWARD))
        wants_replay = self.plans.wants_replay(key, context)
        clean = None
        while True:
            votes = self._round(want=want, done=True, used=used, next_key=key or 0, next_plan=wants_replay,
                                first_end=clean is None)
            want = ()
            if clean is None:  # every rank cast its first end round at the same position: a clean interval
                clean = int(votes.first_end) == self.world_size and int(votes.done) == self.world_size
            if int(votes.done) == self.world_size:
                break
        any_diverged = int(votes.diverged) > 0
        self.plans.close(clean=clean, any_diverged=any_diverged)
        key_sum, key_sq = int(votes.next_key), int(votes.next_key_sq)
        same_key = key is not None and key_sq * self.world_size == key_sum * key_sum
        self.plans.open(key if same_key else None, context,
                        replay=same_key and not any_diverged and int(votes.next_plan) == self.world_size)
        # the next phase's first vote is decided only at its second chunk: vote for the chunk after
        # the prefetched ones now, so that its gather is issued at the first chunk's use
        later = [i for i in first[self.prefetch :] if not self._present(self.chunks[i])]
        if self.async_op and later:
            self._round(want=later, wait=False)
        return None if used is None else votes.used

    def last_use(self, phase: Phase, index: int) -> bool:
        """Whether the recorded order of ``phase`` expects no further use of chunk ``index`` (``False``
        when there is no recorded order to tell)."""
        order = self.orders[phase]
        return order.in_step and index not in order.previous[order.pos :]

    def used_next(self, phase: Phase, index: int) -> bool:
        """Whether the recorded order of ``phase`` expects chunk ``index`` again as the next chunk used
        (a tied weight used by the last module in a one-chunk layout): releasing it would re-gather it."""
        order = self.orders[phase]
        return order.in_step and order.upcoming(1) == [index]

    def prefetched_for(self, phase: Phase) -> set[int]:
        """The first recorded chunks of ``phase`` (kept gathered across the phase boundary)."""
        return set(self.orders[phase].first(self.prefetch))

    # ------------------------------------------------------------------ gathers
    def ensure(self, chunk: Chunk, phase: Phase) -> None:
        """Make ``chunk`` gathered for use now: record its first use, prefetch what comes next."""
        if not chunk.record_use():
            if chunk.gather_in_flight:
                chunk.finish_gather()
            return
        order = self.orders[phase]
        order.access(chunk.index)
        if self.policy is not None:
            self.policy.accessed(phase, chunk)
        if self._voted(chunk.index):
            self.late_gathers += 1  # voted for ahead of use, but its gather is issued only now
        # issue what the previous (async) vote decided: the gathers for the chunks after this one
        self._resolve()
        miss = not self._present(chunk)
        if miss:
            self.misses += 1
            self._round(want=[chunk.index, *self._upcoming(order, chunk, self.prefetch)])
        if self.async_op:
            # this vote is decided at the next chunk's first use, where its gathers are issued: so it
            # asks one chunk further ahead, and the window of gathers in flight stays ``prefetch``
            upcoming = self._upcoming(order, chunk, self.prefetch + 1)
            if upcoming:
                self._round(want=upcoming, wait=False)
        elif not miss:
            upcoming = self._upcoming(order, chunk, self.prefetch)
            if upcoming:
                self._round(want=upcoming)
        if chunk.gather_in_flight:
            chunk.finish_gather()

    def _upcoming(self, order: AccessOrder, chunk: Chunk, count: int) -> list[int]:
        """Up to ``count`` chunks expected after ``chunk`` that are neither gathered nor voted for."""
        return [i for i in order.upcoming(count, exclude=chunk.index)
                if not self._present(self.chunks[i]) and not self._voted(i)]

    @staticmethod
    def _present(c: Chunk) -> bool:
        return c.is_gathered or c.gather_in_flight

    def gathered_count(self) -> int:
        return len([c for c in self.chunks if not c.resident and (c.is_gathered or c.gather_in_flight)])

    # ------------------------------------------------------------------ reductions
    def mark_ready(self, chunk: Chunk) -> None:
        """``chunk``'s gradient contribution on this rank is final; it is reduced once every rank's is."""
        self.ready.add(chunk.index)
        if self.world_size == 1:
            self._reduce(chunk.index)
        elif not self.async_op:
            self._round(want=())

    def final_reduce(self) -> None:
        """End of a synced backward: every chunk with a gradient on some rank is reduced (collective)."""
        for c in self.chunks:
            if c.requires_grad:
                self.ready.add(c.index)
        if self.world_size == 1:
            for i in sorted(self.ready):
                if self.chunks[i].gradient.pending:
                    self._reduce(i)
            self.ready.clear()
            return
        self._round(want=())
        self.ready.clear()

    def finish_gradients(self) -> None:
        """Complete every reduction (collective): those in flight, then every chunk still holding an
        accumulated gradient (backwards under ``no_sync``) is reduced and waited for."""
        self.wait_all()
        self.final_reduce()
        self.wait_all()

    def drop_ready(self) -> None:
        """Forget the chunks marked ready and not yet reduced (their gradient buffers were dropped)."""
        self.ready.clear()

    def stats(self) -> dict[str, int]:
        """``rounds`` (all-reduced), ``gathers``, ``misses``, ``late_gathers``, ``peak_gathered_chunks``,
        ``order_recordings``, ``replayed_rounds`` and ``divergences`` (from a replayed plan, this rank)
        so far (``ZeroDDP.collective_stats``)."""
        return {
            "rounds": self.rounds,
            "gathers": self.gathers,
            "misses": self.misses,
            "late_gathers": self.late_gathers,
            "peak_gathered_chunks": self.peak_gathered,
            "order_recordings": sum(o.recordings for o in self.orders.values()),
            "replayed_rounds": self.plans.replayed,
            "divergences": self.plans.divergences,
        }

    def wait_all(self) -> None:
        """Complete every collective in flight (gathers and reductions)."""
        self._resolve()
        for c in self.chunks:
            if c.gather_in_flight:
                c.finish_gather()
        while self._reducing:
            self.chunks[self._reducing.popleft()].gradient.finish_reduces()
        for c in self.chunks:
            if c.gradient is not None:
                c.gradient.finish_host_gradients()

    def _reduce(self, index: int) -> None:
        self.ready.discard(index)
        c = self.chunks[index]
        # the oldest reductions are completed before the next is issued, so that at most
        # max(1, prefetch) are ever in flight (their gradient buffers included)
        while len(self._reducing) >= max(1, self.prefetch):
            self.chunks[self._reducing.popleft()].gradient.finish_reduces()
        c.gradient.begin_reduce(async_op=self.async_op and self.world_size > 1)
        self._reducing.append(index)
        while self._reducing and not self.async_op:
            self.chunks[self._reducing.popleft()].gradient.finish_reduces()

    # ------------------------------------------------------------------ rounds
    def _round(self, *, want=(), done: bool = False, used: torch.Tensor | None = None, wait: bool = True,
               next_key: int = 0, next_plan: bool = False, first_end: bool = False):
        """One vote all-reduce, then the decided collectives, in the same order on every rank.

        With ``wait=False`` (a prefetch with nothing needed now) the vote is issued asynchronously and
        decided at the next round, so the rendezvous overlaps the computation; every rank still
        issues a round's decided collectives right before its next vote, so the order is the same.
        A round that is not an end round (``done``) is replayed from the plan while this rank's votes
        match it (Note [fixed schedule]). Returns the summed votes (``None`` when not waited for or replayed).
        """
        self._resolve()
        if self.world_size == 1:
            for i in sorted(set(want)):
                self._gather(i)
            for i in sorted(self.ready):
                self._reduce(i)
            return None
        if not done and self.plans.replaying:
            rnd = self.plans.take(self._local_list(want), wait)
            if rnd is not None:  # the recorded decision, issued as the recorded sum would decide it
                if not wait:
                    self._pending = (rnd[4], _NO_WORK, set(want))
                    return None
                self._issue(rnd[4])
                return None
            self._diverge()
        votes = self._local_votes(want, done, used)  # (after a divergence: the plan's rest changed them)
        if done:
            votes.first_end.fill_(int(first_end))
            votes.diverged.fill_(int(self.plans.diverged))
            votes.next_key.fill_(next_key)
            votes.next_key_sq.fill_(next_key * next_key)
            votes.next_plan.fill_(int(next_plan))
        else:
            self.plans.record(votes.head, votes.head, wait)  # the sum lands in place (cloned local first)
        self.rounds += 1
        if not wait:
            self._pending = (votes, collectives.agree(votes.tensor, self.group, async_op=True), set(want))
            return None
        collectives.agree(votes.tensor, self.group)
        self._decide(votes)
        return votes

    def _diverge(self) -> None:
        """This rank left the replayed plan: issue the decisions of its remaining rounds now, in order,
        as the other ranks will (Note [fixed schedule])."""
        for summed, wait in self.plans.rest():
            self._resolve()
            votes = Votes(self.n, self.num_tensors)
            votes.head.copy_(summed)
            if wait:
                self._decide(votes)
            else:
                self._pending = (votes, collectives.Pending(), set())
        self._resolve()

    def _local_list(self, want) -> list[int]:
        """This rank's votes of a round that is not an end round, as ``_local_votes(want, False,
        None).head.tolist()`` would give them, without tensor work (a replayed round compares them)."""
        n = self.n
        votes = [0] * (3 * n + 6)
        for i in want:
            votes[i] = 1
        for i in self.ready:
            votes[n + i] = 1
            if self.chunks[i].gradient.pending:
                votes[2 * n + i] = 1
        return votes

    def _decisions(self, summed: torch.Tensor) -> tuple[list[int], list[int]]:
        """What summed votes decide: the chunks to gather and the chunks to reduce, in issue order."""
        n = self.n
        gathers = summed[:n].nonzero().flatten().tolist()
        reduces = ((summed[n : 2 * n] == self.world_size) & (summed[2 * n : 3 * n] > 0)).nonzero().flatten().tolist()
        return gathers, reduces

    def _issue(self, decision: tuple[list[int], list[int]]) -> None:
        gathers, reduces = decision
        for i in gathers:
            self._gather(i)
        for i in reduces:
            self._reduce(i)

    def _local_votes(self, want, done: bool, used: torch.Tensor | None) -> Votes:
        votes = Votes(self.n, self.num_tensors)
        if want:
            votes.want[list(want)] = 1
        for i in self.ready:
            votes.ready[i] = 1
            if self.chunks[i].gradient.pending:
                votes.has_grad[i] = 1
        votes.done.fill_(int(done))
        if used is not None:
            votes.used.copy_(used)
        return votes

    def _resolve(self) -> None:
        """Decide the vote issued asynchronously by the previous round, if any."""
        if self._pending is not None:
            votes, pending, _ = self._pending
            self._pending = None
            pending.wait()
            if type(votes) is Votes:
                self._decide(votes)
            else:  # a replayed round's recorded decision
                self._issue(votes)

    def _voted(self, index: int) -> bool:
        return self._pending is not None and index in self._pending[2]

    def _decide(self, votes: Votes) -> None:
        self._issue(self._decisions(votes.head))

    def _gather(self, index: int) -> None:
        c = self.chunks[index]
        if c.resident:
            return
        if self.policy is not None:
            self.policy.gathering(c)
        c.begin_gather(async_op=self.async_op)
        self.gathers += 1
        if not self.async_op:
            c.finish_gather()
        self.peak_gathered = max(self.peak_gathered, self.gathered_count())
