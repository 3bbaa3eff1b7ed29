"""GDPO's decoupled reward (reward.user_aggregation=normalize_then_sum) against numbers worked out by hand, and
the claim the pipeline rests on: its batch normalisation is the grpo-batch-std estimator."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.advantages import grpo, grpo_batch_std
from relayrl.algorithms.gdpo import EPS, decoupled_rewards

NAN = float("nan")

# two functions, two groups: group 0 has rows 0-2, group 1 rows 3-6
SCORES = torch.tensor([
    [1.0, 0.5],
    [0.0, 0.5],
    [1.0, NAN],   # f2 is flat over the rows of group 0 it scored: its part is 0 there
    [2.0, 1.0],
    [NAN, 0.0],   # f1 did not score this row (TRL's None)
    [0.0, NAN],
    [NAN, NAN],   # no function scored it
])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 1])
WEIGHTS = torch.tensor([1.0, 0.5])


def _by_hand() -> list[float]:
    # group 0, f1 = 1, 0, 1: mean 2/3, unbiased std sqrt((1/9 + 4/9 + 1/9) / 2) = 1/sqrt(3)
    s0 = 1 / math.sqrt(3) + EPS
    # group 1, f1 = 2, 0 (rows 3, 5): mean 1, std sqrt((1 + 1) / 1) = sqrt(2)
    s1 = math.sqrt(2) + EPS
    # group 1, f2 = 1, 0 (rows 3, 4): mean 0.5, std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    s2 = math.sqrt(0.5) + EPS
    return [(1 / 3) / s0, (-2 / 3) / s0, (1 / 3) / s0,
            1 / s1 + 0.5 * (0.5 / s2), 0.5 * (-0.5 / s2), -1 / s1,
            0.0]


def test_each_function_is_normalised_within_its_group_then_weighted_and_summed():
    got = decoupled_rewards(SCORES, WEIGHTS, GROUPS)
    torch.testing.assert_close(got, torch.tensor(_by_hand()), rtol=1e-6, atol=1e-7)
    assert got[6] == 0  # a row no function scored


def test_a_function_flat_in_a_group_gives_exactly_zero_there():
    flat = torch.tensor([[0.1, 3.0], [0.1, 1.0], [0.1, 2.0]])  # 0.1 three times: its float mean is not 0.1
    got = decoupled_rewards(flat, torch.tensor([1.0, 0.0]), torch.tensor([5, 5, 5]))
    assert got.tolist() == [0.0, 0.0, 0.0]
    one = decoupled_rewards(torch.tensor([[1.0], [NAN]]), torch.tensor([1.0]), torch.tensor([0, 0]))
    assert one.tolist() == [0.0, 0.0]  # one scored row: no spread to normalise by


def test_the_weights_apply_after_normalisation_and_group_ids_are_any_integers():
    a = decoupled_rewards(SCORES, WEIGHTS, GROUPS)
    scaled = SCORES.clone()
    scaled[:, 0] *= 10.0  # a function's scale does not matter, its weight does
    torch.testing.assert_close(decoupled_rewards(scaled, WEIGHTS, GROUPS), a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decoupled_rewards(SCORES, WEIGHTS, GROUPS * 7 - 3), a)
    only_f1 = decoupled_rewards(SCORES, torch.tensor([1.0, 0.0]), GROUPS)
    assert only_f1[4] == 0 and only_f1[3] > 0 > only_f1[5]


def test_the_decoupled_sum_centres_every_group_so_grpo_batch_std_is_trls_batch_normalisation():
    """TRL: advantage = (c - mean_batch(c)) / (std_batch(c) + eps). Every group's mean of c is 0, so the
    group-mean baseline of grpo-batch-std is the batch mean, and the two agree."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (24, 3), generator=g).float()
    scores[torch.rand(24, 3, generator=g) < 0.2] = NAN
    groups = torch.arange(24) // 6
    c = decoupled_rewards(scores, torch.tensor([1.0, 0.2, -0.5]), groups)
    for k in range(4):
        assert abs(float(c[groups == k].mean())) < 1e-6
    trl = (c - c.mean()) / (c.std() + 1e-6)
    torch.testing.assert_close(grpo_batch_std(c, groups), trl, rtol=1e-5, atol=1e-5)
    # and it differs from GRPO on the plain weighted sum
    summed = torch.nan_to_num(scores) @ torch.tensor([1.0, 0.2, -0.5])
    assert not torch.allclose(grpo_batch_std(c, groups), grpo(summed, groups), atol=1e-3)


def test_same_sum_different_parts_get_different_rewards():
    """GDPO's point: two responses with the same weighted sum but different functions' scores (1 + 0 and
    0 + 1) are told apart once each function is normalised within its group."""
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    summed = scores.sum(1)
    assert summed[0] == summed[1] == summed[2]
    c = decoupled_rewards(scores, torch.tensor([1.0, 1.0]), torch.zeros(4, dtype=torch.long))
    assert c[0] > c[1] == c[2] > c[3]  # f1 is rarer in the group: scoring on it counts for more


@pytest.mark.parametrize("scores,weights,groups,message", [
    (torch.ones(3), torch.ones(1), torch.zeros(3, dtype=torch.long), "scores must be 2-D"),
    (torch.ones(3, 2), torch.ones(3), torch.zeros(3, dtype=torch.long), "weights has 3 values for the 2 functions"),
    (torch.ones(3, 2), torch.ones(2), torch.zeros(4, dtype=torch.long), "shape mismatch"),
    (torch.ones(3, 2), torch.ones(2), torch.zeros(3), "group_ids must be an integer tensor"),
])
def test_bad_shapes_are_named(scores, weights, groups, message):
    with pytest.raises(ValueError, match=message):
        decoupled_rewards(scores, weights, groups)
