"""DAPO: soft overlong punishment, overlong filtering, dynamic sampling."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.dapo import dynamic_sampling_filter, overlong_filter_mask, overlong_penalty


def test_overlong_penalty_eq13():
    lengths = torch.tensor([10, 12, 13, 14, 16, 17, 100])
    out = overlong_penalty(lengths, max_len=16, cache_len=4)
    # start of the ramp = 12: <=12 -> 0; (12 - L)/4 inside (12, 16]; > 16 -> -1
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(lengths, max_len=16, cache_len=0)
    with pytest.raises(ValueError, match="empty batch"):
        overlong_penalty(torch.zeros(0), max_len=16, cache_len=4)


def test_overlong_filter_mask():
    mask = torch.ones(3, 2, dtype=torch.long)
    out = overlong_filter_mask(torch.tensor([False, True, False]), mask)
    torch.testing.assert_close(out, torch.tensor([[1, 1], [0, 0], [1, 1]]))
    assert mask.sum() == 6  # input untouched
    out_b = overlong_filter_mask(torch.tensor([True, False, False]), mask.bool())
    assert out_b.dtype == torch.bool and out_b.sum() == 4
    with pytest.raises(ValueError, match=r"truncated has shape \(2,\) but mask has shape \(3, 2\)"):
        overlong_filter_mask(torch.tensor([True, False]), mask)


def test_dynamic_sampling_filter():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 1.0])
    gids = torch.tensor([3, 3, 8, 8, 5, 5, 2, 2])
    keep, metrics = dynamic_sampling_filter(rewards, gids)
    torch.testing.assert_close(keep, torch.tensor([False, False, True, True, False, False, True, True]))
    assert metrics["dapo/groups_total"] == 4
    assert metrics["dapo/groups_kept"] == 2
    assert metrics["dapo/groups_dropped"] == 2
    assert metrics["dapo/groups_dropped_frac"] == 0.5
    assert metrics["dapo/dropped_reward_mean"] == 0.5  # one all-solved, one all-failed
    assert metrics["dapo/rows_kept"] == 4
    keep_one, m1 = dynamic_sampling_filter(torch.tensor([1.0]), torch.tensor([0]))
    assert not keep_one.item() and m1["dapo/groups_dropped"] == 1
    keep_tol, _ = dynamic_sampling_filter(torch.tensor([1.0, 1.0 + 1e-9]), torch.tensor([0, 0]), atol=1e-6)
    assert not keep_tol.any()


def _plan(*over: str):
    from relayrl.config.loader import load_config
    from relayrl.config.plan import step_plan
    from relayrl.config.schema import Config

    return step_plan(load_config(Config, "recipes/arith_dapo.yaml", list(over)))


def test_dynamic_sampling_metric_score_or_shaped_reward():
    """Overlong shaping splits a group the verifier scored uniformly (group 0: both right, one response long)
    and evens out one it did not (group 1: right but overlong = wrong and short): the score metric keeps
    group 1, the reward metric keeps group 0."""
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    lengths = torch.tensor([3, 15, 3, 20, 3, 3])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    rewards = scores + overlong_penalty(lengths, max_len=16, cache_len=4)  # the pipeline's shaping, penalty 1
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.25, 0.0, 0.0, 0.0, 1.0]))
    on_score = dynamic_sampling_filter(scores, groups)[0]
    on_reward = dynamic_sampling_filter(rewards, groups)[0]
    assert on_score.tolist() == [False, False, True, True, True, True]
    assert on_reward.tolist() == [True, True, False, False, True, True]
    # the step plan gives the filter the value algorithm.dynamic_sampling_metric names (default: score)
    plan = _plan()
    assert plan.group_metric == "score" and plan.keep_groups(scores, rewards, groups) == on_score.tolist()
    plan = _plan("algorithm.dynamic_sampling_metric=reward")
    assert plan.group_metric == "reward" and plan.keep_groups(scores, rewards, groups) == on_reward.tolist()
    assert "dynamic sampling on rewards" in plan.describe()
    assert _plan("algorithm.dynamic_sampling=false").keep_groups(scores, rewards, groups) == [True] * 6


def test_dynamic_sampling_metric_refusals():
    with pytest.raises(ValueError, match="set algorithm.dynamic_sampling=true or drop dynamic_sampling_metric"):
        _plan("algorithm.dynamic_sampling=false", "algorithm.dynamic_sampling_metric=score")
    with pytest.raises(ValueError, match="or set algorithm.overlong_shaping=true"):
        _plan("algorithm.overlong_shaping=false", "algorithm.dynamic_sampling_metric=reward")
