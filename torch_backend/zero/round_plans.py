"""The fixed schedule: vote rounds replayed from the last step instead of all-reduced.

Note [fixed schedule]. Between two *end rounds* (the blocking rounds at the end of a forward or a
backward, which every rank casts with ``done``) the ranks cast the same number of rounds, in the same
sequence, when no rank was still mid-phase at the first end round (its sum has ``done == W``): the
interval was *clean*. The votes and sums of a clean interval's rounds become its *plan* once the same
interval recorded them twice in a row (so intervals of one key that alternate, a saliency backward
between training steps, keep voting), under the interval's key (what ended before it: a forward
followed by a backward, a forward without one, a backward; with the ``sync`` setting) and its context
(the recorded access orders of every phase when the interval began). The next interval with the same
key and context **replays** the plan when every rank has one (agreed at the end round before it):
each round's all-reduce is replaced by the recorded sum, valid as long as this rank's own votes equal
the ones it cast then (then every rank's do, so the sums do too).

A rank whose votes differ (another order, another chunk missed, a round more or fewer) has
*diverged*: it issues the decisions of the plan's remaining rounds at once, in order, so that its
collectives stay the others' (they issue the same ones as they go), then votes for real; the others'
end rounds pair with its rounds, as when voting, and serve them. The end round carries ``diverged``,
so every rank drops that plan together and records the interval again. Nothing is lost by issuing
early: a gather early is only early (the chunks it gathers stay until released as usual, so the
memory bound does not hold while diverged); a reduction of a chunk whose gradient is not final yet
here adds this rank's part so far (zeros for none), and the rest is reduced later, when every rank
has marked it ready (reductions add into ``master.grad``). So a divergence on any rank, in a forward
or a backward, falls back to voting with the same values, without an error and without a hang. One
difference remains: a drained reduction of a chunk that no rank had a gradient for leaves zeros in
``master.grad`` where voting leaves ``None`` (an optimizer then steps it with a zero gradient); the
two equal recordings a plan needs keep that to a backward unlike the ones before it.
"""

from __future__ import annotations

import torch

__all__ = ["RoundPlans"]


class RoundPlans:
    """The recorded intervals of one scheduler and the one being replayed or recorded.

    ``record(local, summed)`` after each voted round of the interval (``summed`` is filled in place
    by the all-reduce, maybe later); :meth:`take` in place of a round's all-reduce while replaying;
    :meth:`close` at the end round; :meth:`open` after it.

    Args:
        decisions: what a round's summed votes decide, in the form the scheduler issues it (called
            once per round of a kept recording, so that a replay costs no tensor work); default: none.

    A plan's round is ``(local, summed, wait, local_list, decision)``: this rank's votes and their sum
    (1-D int tensors), whether the round was waited for, ``local.tolist()`` and ``decisions(summed)``.
    """

    def __init__(self, decisions=None):
        self._decisions = decisions
        self._plans: dict[int, tuple[tuple, list[tuple]]] = {}
        self._candidates: dict[int, tuple[tuple, list[tuple]]] = {}
        """Per key: the last clean recording, a plan once the next one equals it."""
        self._key: int | None = None
        """The current interval's key (agreed at the end round before it), ``None``: not storable."""
        self._context: tuple = ()
        self._recording: list[tuple[torch.Tensor, torch.Tensor, bool]] | None = None
        self._replay: list[tuple[torch.Tensor, torch.Tensor, bool]] | None = None
        self._pos = 0
        self.diverged = False
        """This rank's votes left the replayed plan in the current interval."""
        self.replayed = 0
        """Rounds replayed so far (no all-reduce)."""
        self.divergences = 0
        """Intervals this rank diverged from its plan in."""

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    def take(self, local: list[int], wait: bool) -> tuple | None:
        """The recorded next round (see the class docstring), if this rank's ``local`` votes (as a
        list, ``Votes.head.tolist()``) are the recorded ones; ``None`` (diverged: see :meth:`rest`)
        otherwise."""
        plan, pos = self._replay, self._pos
        if pos < len(plan):
            rnd = plan[pos]
            if rnd[2] == wait and rnd[3] == local:
                self._pos = pos + 1
                self.replayed += 1
                return rnd
        return None

    def rest(self) -> list[tuple[torch.Tensor, bool]]:
        """Diverge: the recorded ``(sum, wait)`` of the rounds not yet replayed, in order; replaying
        stops for the rest of the interval (which is then not recorded)."""
        plan, pos = self._replay or [], self._pos
        self._replay, self._recording = None, None
        self.diverged = True
        self.divergences += 1
        return [(rnd[1], rnd[2]) for rnd in plan[pos:]]

    def pending_rest(self) -> bool:
        """Whether the replayed plan has rounds left (a rank with fewer rounds than recorded)."""
        return self._replay is not None and self._pos < len(self._replay)

    def record(self, local: torch.Tensor, summed: torch.Tensor, wait: bool) -> None:
        if self._recording is not None:
            self._recording.append((local.clone(), summed, wait))

    def wants_replay(self, key: int | None, context: tuple) -> bool:
        """Whether this rank holds a plan for the interval that follows (``key``, ``context``)."""
        entry = self._plans.get(key) if key is not None else None
        return entry is not None and entry[0] == context

    def close(self, *, clean: bool, any_diverged: bool) -> None:
        """The end round's sums are in: keep the interval's recording as its plan when every rank's was
        clean; drop its plan when some rank diverged (every rank does the same: same sums)."""
        if any_diverged:
            self._plans.pop(self._key, None)
            self._candidates.pop(self._key, None)
        elif clean and self._recording is not None and self._key is not None:
            decide = self._decisions or (lambda _: None)
            rounds = []
            for local, summed, wait in self._recording:
                summed = summed.clone()
                rounds.append((local, summed, wait, local.tolist(), decide(summed)))
            entry = (self._context, rounds)
            if _same(self._candidates.get(self._key), entry):
                self._plans[self._key] = entry
            self._candidates[self._key] = entry
        self._recording, self._replay, self._pos = None, None, 0
        self.diverged = False

    def open(self, key: int | None, context: tuple, replay: bool) -> None:
        """The next interval begins (after an end round): replay its plan (``replay``: every rank
        agreed) or record it."""
        self._key, self._context = key, context
        self._pos = 0
        if replay:
            self._replay, self._recording = self._plans[key][1], None
        else:
            self._replay, self._recording = None, []

    def clear(self) -> None:
        """Forget every plan (the layout or the ranks' agreement changed)."""
        self._plans.clear()
        self._candidates.clear()
        self._key, self._recording, self._replay = None, None, None


def _same(a, b) -> bool:
    """Whether two recordings ``(context, rounds)`` are equal (every vote, sum and wait)."""
    if a is None or a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    return all(ra[2] == rb[2] and torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
               for ra, rb in zip(a[1], b[1], strict=True))
