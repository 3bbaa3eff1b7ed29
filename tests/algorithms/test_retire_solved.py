"""The pass rate that retires a prompt (``data.retire_solved``, ScaleRL's no-positive-resampling): the share of a
group's scores >= the solved score (``data.retire_score``, 1.0 by default), NaN counting as not solved, and the
groups at or above the threshold."""

import math

import pytest

from relayrl.algorithms.retire import pass_rates, solved_groups


def test_pass_rate_is_the_share_of_a_groups_scores_at_or_above_one():
    scores = [1.0, 1.0, 0.0, 1.0, 0.5, 0.99, 1.5, float("nan"), 1.0, 1.0, 1.0, 1.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    rates = pass_rates(scores, groups, 1.0)
    assert rates == {0: 0.75, 1: 0.25, 2: 1.0}  # 0.99 is not solved, 1.5 is, NaN (a failed score) is not
    assert list(rates) == [0, 1, 2]
    # groups interleaved (rows of several groups in one scoring call) and uneven
    assert pass_rates([1.0, 0.0, 1.0, 1.0, 1.0], [7, 3, 7, 3, 7], 1.0) == {7: 1.0, 3: 0.5}
    assert pass_rates([], [], 1.0) == {}


def test_a_graded_reward_is_solved_from_the_score_it_is_given():
    """Partial credit in [0, 1] never reaches 1.0 (nothing would retire); a reward model's scores around 0 would
    all miss it too. ``solved_at`` (data.retire_score) is the score each is solved from, inclusively."""
    partial = [0.7, 0.4, 0.5, 0.9, 0.2, 0.6]
    groups = [0, 0, 0, 1, 1, 1]
    assert pass_rates(partial, groups, 1.0) == {0: 0.0, 1: 0.0}
    assert pass_rates(partial, groups, 0.5) == {0: 2 / 3, 1: 2 / 3}  # 0.5 itself is solved
    assert pass_rates([-1.5, 0.2, 2.5, float("nan")], [3, 3, 4, 4], 0.0) == {3: 0.5, 4: 0.5}  # NaN: not solved
    assert pass_rates([1.0, 1.2], [0, 0], 1.1) == {0: 0.5}  # above 1 too (a verifier plus a format term)


@pytest.mark.parametrize("solved_at", [math.nan, math.inf, -math.inf])
def test_a_solved_score_that_is_not_finite_is_refused(solved_at):
    with pytest.raises(ValueError, match="solved_at must be a finite score"):
        pass_rates([1.0], [0], solved_at)


def test_solved_groups_meet_the_threshold_inclusively():
    rates = {4: 0.9, 1: 0.875, 2: 1.0, 0: 0.0}
    assert solved_groups(rates, 0.9) == [2, 4]
    assert solved_groups(rates, 1.0) == [2]
    assert solved_groups(rates, 0.5) == [1, 2, 4]
    # 9 of 10 responses solved reaches ScaleRL's 0.9 (no float rounding below it)
    assert solved_groups(pass_rates([1.0] * 9 + [0.0], [0] * 10, 1.0), 0.9) == [0]
    assert solved_groups(pass_rates([1.0] * 8 + [0.0] * 2, [0] * 10, 1.0), 0.9) == []


@pytest.mark.parametrize("threshold", [0.0, -0.1, 1.01, math.nan])
def test_a_threshold_outside_zero_to_one_is_refused(threshold):
    with pytest.raises(ValueError, match="threshold must be in"):
        solved_groups({0: 1.0}, threshold)


def test_scores_and_groups_must_pair_up():
    with pytest.raises(ValueError, match="3 scores but 2 group ids"):
        pass_rates([1.0, 0.0, 1.0], [0, 0], 1.0)
