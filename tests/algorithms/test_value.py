"""Clipped value loss and explained variance."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.value import explained_variance, value_loss


def test_hand_computed_clipped_value_loss():
    values = torch.tensor([[1.0, 0.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    # t0: v=1 (err 1), clipped v=.7 (err 1.69) -> .5*1.69; t1: v=0 err 1 -> .5
    assert loss.item() == pytest.approx((0.845 + 0.5) / 2)
    assert metrics["critic/vf_clip_frac"] == pytest.approx(0.5)
    unclipped, _ = value_loss(values, old, returns, mask, clip=None)
    assert unclipped.item() == pytest.approx((0.5 + 0.5) / 2)
    loss.backward()
    # gradient flows only through the unclipped token t1: d/dv .5(v-1)^2 / 2 = (0-1)/2
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.5, 0.0]]))


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(returns, torch.ones(1, 4), mask))


def test_gradcheck_and_errors():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 4, generator=g, dtype=torch.float64)
    values = (old + 0.5 * torch.randn(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    returns = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.float64)
    mask[2, 1:] = 0
    assert torch.autograd.gradcheck(lambda v: value_loss(v, old, returns, mask, clip=0.2)[0], (values,))
    with pytest.raises(ValueError, match=r"values has shape \(3, 4\) but returns has shape \(4, 3\)"):
        value_loss(values, old, returns.T, mask)
    with pytest.raises(ValueError, match="empty batch"):
        value_loss(torch.zeros(0, 2), torch.zeros(0, 2), torch.zeros(0, 2), torch.zeros(0, 2))
