"""reward.normalize=running: a step's whitened rewards do not depend on how its rows are split into scoring
calls (one call for the batch, a call per group as groups land, a call per row) nor on the order the calls
finish in. A step is whitened by the moments of the steps before it, frozen at its start; its rewards join
the moments in one update at its end (the first step has none before it: unwhitened)."""

from __future__ import annotations

import math

import pytest

from relayrl.engines.reward import RewardConfig, RewardEngine

ANSWERS = ["1", "2", "3", "4", "5", "6", "7", "8"]


class _Task:
    name = "lengths"

    @staticmethod
    def verify(response: str, answer: str) -> float:  # a reward that varies: the response's length
        return float(len(response))


def _engine() -> RewardEngine:
    return RewardEngine(RewardConfig(verifier_weight=1.0, normalize="running"), task=_Task())


def _steps() -> list[list[str]]:
    return [["a" * k for k in (1, 2, 2, 5, 3, 1, 4, 6)], ["b" * k for k in (7, 1, 3, 3, 2, 8, 5, 1)]]


def _scored(eng: RewardEngine, rows: list[str], calls: list[list[int]]) -> list[float]:
    """``rows`` scored in ``calls`` (row indexes per call, in the order the calls run), back in row order."""
    out = [math.nan] * len(rows)
    for idx in calls:
        got, _ = eng.score(["p"] * len(idx), [rows[i] for i in idx], [ANSWERS[i] for i in idx])
        for i, r in zip(idx, got):
            out[i] = r
    return out


@pytest.mark.parametrize("calls", [
    [[0, 1, 2, 3], [4, 5, 6, 7]],  # a call per landed pair of groups
    [[6, 7], [0, 1], [4, 5], [2, 3]],  # a call per group, landing in another order
    [[i] for i in (3, 0, 7, 5, 1, 6, 2, 4)],  # reward.stream=sample: a call per row
])
def test_a_steps_whitened_rewards_are_the_same_however_its_rows_are_split_into_calls(calls):
    whole, split = _engine(), _engine()
    for rows in _steps():
        want = _scored(whole, rows, [list(range(8))])
        got = _scored(split, rows, calls)
        assert got == want  # bit for bit
        whole.fold_moments()
        split.fold_moments()
        assert split.moments.state() == whole.moments.state()


def test_a_step_is_whitened_by_the_moments_of_the_steps_before_it():
    eng = _engine()
    first, second = _steps()
    r1 = _scored(eng, first, [[0, 1, 2], [3, 4, 5, 6, 7]])
    assert r1 == [float(len(x)) for x in first]  # the first step: no earlier rewards, left as they are
    assert eng.moments.count == 0  # (the step's calls leave the moments as they were)
    eng.fold_moments()
    lengths = [len(x) for x in first]
    m = sum(lengths) / 8
    s = math.sqrt(sum((x - m) ** 2 for x in lengths) / 8)
    assert (eng.moments.count, eng.moments.mean, eng.moments.std) == pytest.approx((8, m, s))
    r2, metrics = eng.score(["p"] * 8, second, ANSWERS)
    assert r2 == pytest.approx([(len(x) - m) / (s + 1e-6) for x in second], abs=1e-5)
    assert (metrics["reward/norm_mean"], metrics["reward/norm_std"]) == pytest.approx((m, s))


def test_a_checkpoint_of_the_moments_is_the_state_the_step_ends_with():
    """What a checkpoint saves mid-run (after a step, before the next starts) is the state the next step
    starts from, bit for bit, and loading it drops a step under way's rewards."""
    eng = _engine()
    first, second = _steps()
    _scored(eng, first, [[0, 1], [2, 3, 4, 5, 6, 7]])
    saved = eng.folded_moments()
    assert eng.moments.count == 0
    eng.fold_moments()
    assert eng.moments.state() == saved
    resumed = _engine()
    _scored(resumed, second, [[0]])  # (a batch drawn ahead, scored before the run stopped: redrawn on resume)
    resumed.load_moments(saved)
    resumed.fold_moments()
    assert resumed.moments.state() == saved
