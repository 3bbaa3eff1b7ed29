"""CISPO (relayrl.algorithms.cispo): the gradient is the hand-derived -sg(clip(r)) * A * grad log pi."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.cispo import cispo_loss
from relayrl.algorithms.losses import policy_loss

OLD = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, -3.0, -1.0]])
SHIFT = torch.tensor([[0.0, 0.5, -0.5], [0.1, -0.05, 0.0]])  # log r: ratios 1, 1.65, 0.61, 1.11, 0.95
ADV = torch.tensor([[1.0, 1.0, -1.0], [-2.0, 0.5, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _lp():
    return (OLD + SHIFT).clone().requires_grad_(True)


def test_gradient_matches_the_formula():
    lp = _lp()
    loss, m = cispo_loss(lp, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28, agg="token-mean")
    loss.backward()
    w = torch.exp(SHIFT).clamp(0.8, 1.28)
    expected = -w * ADV * MASK / 5  # token-mean over 5 valid tokens
    torch.testing.assert_close(lp.grad, expected)
    assert float(loss.detach()) == pytest.approx(float((-w * ADV * (OLD + SHIFT) * MASK).sum() / 5), rel=1e-6)
    # clipped weights: 1.65 above 1.28, 0.61 below 0.8 -- yet both tokens keep a gradient
    assert m["actor/clip_frac_high"] == pytest.approx(1 / 5) and m["actor/clip_frac_low"] == pytest.approx(1 / 5)
    assert lp.grad[0, 1] != 0 and lp.grad[0, 2] != 0
    assert m["actor/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)


def test_ppo_drops_the_clipped_token_cispo_keeps_it():
    lp_ppo, lp_cispo = _lp(), _lp()
    policy_loss(lp_ppo, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28, agg="token-mean")[0].backward()
    cispo_loss(lp_cispo, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28, agg="token-mean")[0].backward()
    assert lp_ppo.grad[0, 1] == 0 and lp_ppo.grad[0, 2] == 0  # ratio out of range in the advantage's direction
    assert lp_cispo.grad[0, 1] == pytest.approx(-1.28 / 5) and lp_cispo.grad[0, 2] == pytest.approx(0.8 / 5)


def test_on_policy_equals_the_policy_gradient_and_weights_apply():
    lp_ppo = OLD.clone().requires_grad_(True)
    lp_cispo = OLD.clone().requires_grad_(True)
    policy_loss(lp_ppo, OLD, ADV, MASK, agg="seq-mean-token-mean")[0].backward()
    cispo_loss(lp_cispo, OLD, ADV, MASK, agg="seq-mean-token-mean")[0].backward()
    torch.testing.assert_close(lp_cispo.grad, lp_ppo.grad)
    lp = OLD.clone().requires_grad_(True)
    isw = torch.tensor([[0.5, 0.0, 1.0], [2.0, 1.0, 1.0]])
    cispo_loss(lp, OLD, ADV, MASK, agg="token-mean", is_weights=isw)[0].backward()
    torch.testing.assert_close(lp.grad, -isw * ADV * MASK / 5)


def test_all_masked_and_bad_bounds():
    lp = _lp()
    loss, m = cispo_loss(lp, OLD, ADV, torch.zeros(2, 3))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(lp.grad, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in m.values())
    with pytest.raises(ValueError, match="clip_low"):
        cispo_loss(_lp(), OLD, ADV, MASK, clip_low=1.0)
