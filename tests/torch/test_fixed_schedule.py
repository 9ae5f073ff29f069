"""The fixed schedule (Note [fixed schedule] in ``torch_backend.zero.round_plans``) at W = 2 and 3: rounds
are replayed once a step repeats; an order change on every rank, or a divergence on one rank in
forward or in backward, falls back to voting, stays exact and neither hangs nor raises; replaying
without checking this rank's votes against the plan does not survive the same divergence."""

import fixed_schedule_cases as cases
import pytest

from torch_backend._testing import run_distributed


@pytest.mark.parametrize(("kind", "world"), [*((k, 2) for k in cases.KINDS), ("one-touch", 3)])
def test_changes_fall_back_to_voting_and_stay_exact(kind, world):
    stats = run_distributed(cases.worker_change, world, kind, timeout=600)
    for s in stats:  # before the change: the fourth step on all-reduces only its two end rounds
        assert s[3]["replayed_rounds"] > s[2]["replayed_rounds"], s
        assert s[3]["rounds"] - s[2]["rounds"] == 2 and s[cases.CHANGE - 1]["rounds"] - s[3]["rounds"] == 2, s
        assert s[cases.CHANGE - 1]["divergences"] == 0, s
        # and replayed again by the last step
        assert s[-1]["replayed_rounds"] > s[-2]["replayed_rounds"], s
    diverged = [s[cases.CHANGE]["divergences"] > 0 for s in stats]
    assert diverged == [kind == "all-reverse" or r == 1 for r in range(world)], stats


def test_replay_without_the_vote_check_fails_on_a_divergence():
    """The mutant: a rank that replays the plan without comparing its own votes gathers the plan's chunk
    instead of the one it uses: the run raises, hangs or trains to other values."""
    with pytest.raises(Exception):  # noqa: B017,PT011 - any failure: an error, a timeout, a wrong state
        run_distributed(cases.worker_change, 2, "one-reverse", True, timeout=120, fresh=True)
