"""A step's reward metrics do not depend on the order its scoring calls finished in: several calls run at once,
so a DAPO run and its resume gathered them in another order and differed in the last digits of ``reward/mean``
(a float32 mean of the rows in the order their groups were judged). (How the rows are split into calls still
moves the per-call means of ``reward/verifier_mean`` by an ulp now and then.)"""

from __future__ import annotations

import random

import pytest

from relayrl.workflows.rollout_stream import GroupRecord
from relayrl.workflows.state import StepState
from relayrl.workflows.step_metrics import step_metrics


def _state(order: list[int]) -> StepState:
    calls = [(0.1 * k + 1 / 3, 8) for k in range(7)]  # (value, rows) of each scoring call
    scores = [[(0.2 * k + 0.1 * j) % 1.3 for j in range(8)] for k in range(7)]
    st = StepState(problems=[None] * 7, positions=[None] * 7)
    st.records = [GroupRecord(group=k, lengths=[5] * 8, prompt_len=4, truncated=[False] * 8) for k in range(7)]
    for k in order:
        st.reward_metrics.setdefault("reward/verifier_mean", []).append(calls[k])
        st.scores += scores[k]
        st.rewards += [s - 0.7 for s in scores[k]]
    return st


def test_the_reward_metrics_are_the_same_in_any_order_the_calls_finished():
    first = step_metrics(_state(list(range(7))), step=1, prompts_per_step=7, tri_model=False, session=None)
    for seed in range(5):
        order = list(range(7))
        random.Random(seed).shuffle(order)
        again = step_metrics(_state(order), step=1, prompts_per_step=7, tri_model=False, session=None)
        assert again == first, order


def test_reward_mean_and_std_are_float64_and_dropped_groups_have_their_mean():
    """``reward/mean`` and ``reward/std`` were float32 reductions: rewards 1000.0, 1000.1, ... 1000.7 read mean
    1000.35004 and std 0.2449515 (statistics: 1000.35 and 0.2449490). ``dapo/dropped_reward_mean``: the mean
    over the groups dynamic sampling dropped of each one's mean reward (logged on a step that dropped one)."""
    import statistics

    st = StepState(problems=[None] * 3, positions=[None] * 3)
    st.records = [GroupRecord(group=k, lengths=[5] * 4, prompt_len=4, truncated=[False] * 4) for k in range(3)]
    st.rewards = [1000.0 + k / 10 for k in range(8)]
    st.scores = [1.0] * 8
    m = step_metrics(st, step=1, prompts_per_step=3, tri_model=False, session=None)
    assert m["reward/mean"] == pytest.approx(statistics.fmean(st.rewards), rel=1e-14)
    assert m["reward/std"] == pytest.approx(statistics.stdev(st.rewards), rel=1e-10)
    assert "dapo/dropped_reward_mean" not in m
    st.filtered_rewards = {2: 1.0, 0: 0.0, 1: 0.0}
    m = step_metrics(st, step=1, prompts_per_step=3, tri_model=False, session=None)
    assert m["dapo/dropped_reward_mean"] == 1 / 3


def test_a_step_that_trains_nothing_logs_no_reward_mean():
    """Old behaviour: a step whose every group dynamic sampling dropped logged the scorer's reward/mean (every row
    of every round, before the overlong shaping), where the other steps log the shaped reward of the samples they
    train on: a DAPO run's curve jumped to the unshaped figure (1.0 once every group was solved) at such steps."""
    class _Tracker:
        lines: list = []

        def write_text(self, line):
            self.lines.append(line)

    class _Session:
        tracker = _Tracker()

    st = StepState(problems=[None] * 2, positions=[None] * 2)
    st.records = [GroupRecord(group=k, lengths=[5] * 4, prompt_len=4, truncated=[True] * 4) for k in range(2)]
    st.dropped, st.rounds = {0, 1}, 4
    st.filtered_rewards = {0: 0.0, 1: 0.0}  # all right, all cut: 1 - 1 after the length penalty
    st.reward_metrics = {"reward/mean": [(1.0, 8)], "reward/std": [(0.0, 8)], "reward/verifier_mean": [(1.0, 8)]}
    m = step_metrics(st, step=3, prompts_per_step=2, tri_model=False, session=_Session())
    assert m["dapo/skipped_step"] == 1.0 and m["reward/verifier_mean"] == 1.0
    assert "reward/mean" not in m and "reward/std" not in m and "train/accuracy" not in m
    assert "no group with differing rewards in 4 rounds" in _Tracker.lines[-1]
