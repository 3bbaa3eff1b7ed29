"""Bradley-Terry loss and reward normalisation against hand-computed values."""

from __future__ import annotations

import math
import re

import pytest
import torch

from relayrl.algorithms.reward_model import RunningMoments, bradley_terry_loss, normalize_rewards
from relayrl.engines.reward.judge import parse_judge_score


def _nls(x: float) -> float:  # -log sigmoid(x)
    return math.log1p(math.exp(-x))


def test_bradley_terry_loss_matches_hand_computed_values():
    chosen = torch.tensor([2.0, 0.0, -1.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.5, -1.0])
    loss, m = bradley_terry_loss(chosen, rejected)
    want = (_nls(1.0) + _nls(-0.5) + _nls(0.0)) / 3  # 0.3133, 0.9741, 0.6931
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    assert m["rm/loss"] == pytest.approx(want, rel=1e-6)
    assert m["rm/accuracy"] == pytest.approx(1 / 3)  # a tie is not a win
    assert m["rm/reward_margin"] == pytest.approx((1.0 - 0.5 + 0.0) / 3)
    assert m["rm/chosen_mean"] == pytest.approx(1 / 3) and m["rm/rejected_mean"] == pytest.approx(0.5 / 3)
    loss.backward()  # d/dr_c of -log sigmoid(d) = -(1 - sigmoid(d)) = -sigmoid(-d), over N
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert chosen.grad.tolist() == pytest.approx([-sig(-1.0) / 3, -sig(0.5) / 3, -sig(0.0) / 3], rel=1e-6)


def test_margin_shifts_the_difference_per_pair():
    chosen, rejected = torch.tensor([2.0, 3.0]), torch.tensor([1.0, 1.0])
    loss, m = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.5]))
    assert float(loss) == pytest.approx((_nls(0.0) + _nls(1.5)) / 2, rel=1e-6)
    assert m["rm/accuracy"] == 1.0  # accuracy ignores the margin
    loss2, _ = bradley_terry_loss(chosen, rejected, margin=1.0)
    assert float(loss2) == pytest.approx((_nls(0.0) + _nls(1.0)) / 2, rel=1e-6)


def test_bradley_terry_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="rejected_rewards"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))


def test_running_normalisation_and_clipping_by_hand():
    mom = RunningMoments()
    out, m = normalize_rewards(torch.tensor([1.0, 3.0]), mom)  # no moments yet: as they are
    assert (m["reward/norm_mean"], m["reward/norm_std"]) == (0.0, 1.0) and out.tolist() == [1.0, 3.0]
    assert mom.count == 0  # (whitening never updates the moments: the caller does, once per step)
    mom.update(torch.tensor([3.0, 1.0]))
    out, m = normalize_rewards(torch.tensor([1.0, 3.0]), mom)
    assert (m["reward/norm_mean"], m["reward/norm_std"]) == pytest.approx((2.0, 1.0))
    assert out.tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)
    mom.update(torch.tensor([5.0, 7.0]))
    out, m = normalize_rewards(torch.tensor([5.0, 7.0]), mom, clip=1.0)  # all four: mean 4, var 5
    assert m["reward/norm_mean"] == pytest.approx(4.0) and m["reward/norm_std"] == pytest.approx(math.sqrt(5.0))
    assert out.tolist() == pytest.approx([1 / math.sqrt(5.0), 1.0], abs=1e-5)  # 3/sqrt(5) = 1.34 clipped to 1
    assert m["reward/clip_frac"] == 0.5
    out, m = normalize_rewards(torch.tensor([-3.0, 0.5]), None, clip=2.0)
    assert out.tolist() == [-2.0, 0.5] and "reward/norm_mean" not in m


def test_running_moments_of_a_batch_do_not_depend_on_its_order():
    x = torch.tensor([0.1, 7.3, -2.2, 1e-3, 4.4, 0.7, 3.3])
    a, b = RunningMoments(1.0, 0.5, 0.25), RunningMoments(1.0, 0.5, 0.25)
    a.update(x)
    b.update(x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))])
    assert a.state() == b.state()  # bit for bit


def test_judge_verdicts_parse_by_the_documented_rule():
    pat = re.compile(r"-?\d+(?:\.\d+)?")
    assert parse_judge_score("Score: 7", pat, 0, 10) == pytest.approx(0.7)
    assert parse_judge_score("10/10", pat, 0, 10) == 1.0
    assert parse_judge_score("banana", pat, 0, 10) is None  # no number
    assert parse_judge_score("11", pat, 0, 10) is None  # out of range
    assert parse_judge_score("rating=4", re.compile(r"rating=(\d)"), 1, 5) == pytest.approx(0.75)
