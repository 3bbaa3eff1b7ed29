"""Clip-Cov and KL-Cov (the entropy mechanism, Cui et al. 2025): which tokens each picks, and the gradient."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.covariance import clip_cov_loss, kl_cov_loss, token_covariance
from relayrl.algorithms.losses import policy_loss

# 11 valid tokens; token (0, 0) is likely and rewarded: the largest covariance by far
OLD = torch.tensor([[-0.1, -3.0, -2.5, -2.0, -2.2, -1.9], [-2.1, -2.4, -2.6, -1.8, -2.3, -9.0]])
ADV = torch.tensor([[3.0, -1.0, -1.0, 0.5, 0.5, 0.5], [-0.5, -0.5, 0.2, 0.2, -1.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])


def test_covariance_is_over_valid_tokens_only():
    cov = token_covariance(OLD, ADV, MASK)
    m = MASK.bool()
    a, lp = ADV[m], OLD[m]
    torch.testing.assert_close(cov[m], (a - a.mean()) * (lp - lp.mean()))
    assert cov[1, 5] == float("-inf") and int(cov.flatten().argmax()) == 0


def test_kl_cov_penalises_the_top_covariance_tokens_and_equals_the_policy_gradient_elsewhere():
    shift = torch.full_like(OLD, 0.1)  # every ratio e^0.1
    lp = (OLD + shift).requires_grad_(True)
    loss, m = kl_cov_loss(lp, OLD, ADV, MASK, agg="token-mean", cov_ratio=0.1, kl_coef=0.5)  # 1 token of 11
    loss.backward()
    r = torch.exp(shift)
    expected = -ADV * r * MASK / 11
    expected[0, 0] += 0.5 / 11  # d |log r| / d log pi = sign(log r) = 1 on the penalised token
    torch.testing.assert_close(lp.grad, expected)
    assert m["actor/cov_frac"] == pytest.approx(1 / 11)
    # no clip: a far-off token keeps its gradient (PPO's would be 0)
    lp2 = (OLD + 2.0).requires_grad_(True)
    kl_cov_loss(lp2, OLD, ADV, MASK, agg="token-mean", cov_ratio=0.1, kl_coef=0.0)[0].backward()
    assert lp2.grad[0, 3] != 0


def test_clip_cov_removes_a_drawn_unclipped_token_in_the_range():
    lp = OLD.clone().requires_grad_(True)  # on-policy: nothing clipped
    torch.manual_seed(0)
    cov = token_covariance(OLD, ADV, MASK)
    in_range = (cov > 0.5) & (cov < 100.0)
    loss, m = clip_cov_loss(lp, OLD, ADV, MASK, agg="token-mean", cov_ratio=0.2, cov_low=0.5, cov_high=100.0)
    loss.backward()
    removed = (lp.grad == 0) & MASK.bool() & (ADV != 0)
    assert int(removed.sum()) == min(2, int(in_range.sum())) and bool((removed <= in_range).all())
    assert m["actor/cov_frac"] == pytest.approx(int(removed.sum()) / 11)
    ppo = OLD.clone().requires_grad_(True)
    policy_loss(ppo, OLD, ADV, MASK, agg="token-mean")[0].backward()
    torch.testing.assert_close(lp.grad[~removed], ppo.grad[~removed])  # elsewhere PPO's gradient
    # none in range: PPO exactly
    lp3 = OLD.clone().requires_grad_(True)
    _, m3 = clip_cov_loss(lp3, OLD, ADV, MASK, agg="token-mean", cov_low=1e6, cov_high=2e6)
    assert m3["actor/cov_frac"] == 0.0
    with pytest.raises(ValueError, match="cov_low < cov_high"):
        clip_cov_loss(lp3, OLD, ADV, MASK, cov_low=2.0, cov_high=1.0)
    with pytest.raises(ValueError, match="level 'token'"):
        kl_cov_loss(lp3, OLD, ADV, MASK, level="sequence")


def test_gmpo_is_the_geometric_mean_of_clipped_token_ratios():
    from relayrl.algorithms.gmpo import gmpo_loss

    adv = torch.tensor([[1.0] * 6, [-2.0] * 5 + [0.0]])
    shift = torch.tensor([[0.0, 0.6, -0.6, 0.1, 0.0, 0.0], [0.5, -0.5, 0.2, 0.0, 0.1, 3.0]])
    lp = (OLD + shift).requires_grad_(True)
    loss, m = gmpo_loss(lp, OLD, adv, MASK, clip_low=0.4, clip_high=0.4)
    loss.backward()
    # row 0 (A > 0): 0.6 is held at 0.4 (min of 0.6 and 0.4), -0.6 is not (min of -0.6 and -0.4)
    c0 = torch.tensor([0.0, 0.4, -0.6, 0.1, 0.0, 0.0])
    # row 1 (A < 0): -0.5 is held at -0.4 (pessimism flips with the sign), 0.5 is not
    c1 = torch.tensor([0.5, -0.4, 0.2, 0.0, 0.1])
    r0, r1 = torch.exp(c0.mean()), torch.exp(c1.mean())
    assert float(loss.detach()) == pytest.approx(float((-1.0 * r0 + 2.0 * r1) / 2), rel=1e-6)
    g0 = torch.tensor([1, 0, 1, 1, 1, 1.0]) * (-1.0 * r0 / 6) / 2  # held tokens: no gradient
    g1 = torch.tensor([1, 0, 1, 1, 1.0]) * (2.0 * r1 / 5) / 2
    torch.testing.assert_close(lp.grad[0], g0)
    torch.testing.assert_close(lp.grad[1, :5], g1)
    assert lp.grad[1, 5] == 0  # padding
    assert m["actor/clip_frac_high"] == pytest.approx(1 / 11) and m["actor/clip_frac_low"] == pytest.approx(1 / 11)
    # on-policy: GRPO's gradient with the per-sequence token mean
    on, ppo = OLD.clone().requires_grad_(True), OLD.clone().requires_grad_(True)
    gmpo_loss(on, OLD, adv, MASK)[0].backward()
    policy_loss(ppo, OLD, adv, MASK, agg="seq-mean-token-mean")[0].backward()
    torch.testing.assert_close(on.grad, ppo.grad)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        gmpo_loss(on, OLD, adv, MASK, agg="token-mean")
