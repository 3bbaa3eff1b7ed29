"""Clipped value loss and explained variance."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.value import (EV_TERMS, explained_variance, explained_variance_of, explained_variance_terms,
                                     value_loss)


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


def test_values_that_moved_less_than_the_clip_are_not_counted_as_clipped():
    """Old behaviour: v_clip was old + clamp(v - old), which rounds away from v, so critic/vf_clip_frac counted
    tokens that moved far less than the clip (5% of them with values and old values spread like 0.2)."""
    torch.manual_seed(0)
    old = torch.randn(256, 32) * 0.2
    values = torch.randn(256, 32) * 0.2
    values = torch.where((values - old).abs() < 0.45, values, old).requires_grad_()
    returns = torch.rand(256, 32)
    loss, metrics = value_loss(values, old, returns, torch.ones(256, 32), clip=0.5)
    assert metrics["critic/vf_clip_frac"] == 0.0
    assert loss.item() == pytest.approx((0.5 * (values - returns).square()).mean().item(), rel=1e-6)
    loss.backward()
    assert torch.allclose(values.grad, (values - returns).detach() / values.numel(), atol=1e-9)


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


@pytest.mark.parametrize("c", [0.1, 1 / 3, 0.7, 1e3 / 7, -0.2])
def test_explained_variance_of_constant_float64_returns_is_nan(c):
    """Issue 11 item 7: ``var == 0`` missed constant float64 returns whose mean rounds (var ~1e-33), giving
    about -1e31 (fails before for most of these shapes); a spread a float32 return can hold still counts."""
    g = torch.Generator().manual_seed(0)
    for b, t in [(3, 7), (5, 9), (6, 5), (4, 3)]:
        returns = torch.full((b, t), c, dtype=torch.float64)
        values = returns + torch.randn(b, t, dtype=torch.float64, generator=g)
        assert math.isnan(explained_variance(values, returns, torch.ones(b, t)))
    returns = torch.full((4, 3), c, dtype=torch.float64)
    returns[0, 0] *= 1 + 1e-4  # a real spread (above the 1e-6 tolerance)
    assert explained_variance(returns, returns, torch.ones(4, 3)) == pytest.approx(1.0)


def test_explained_variance_from_summed_terms_is_the_whole_batch_figure():
    """The terms of two halves, added up (and scaled by one factor, as an average over steps scales them), give
    the explained variance of the whole, where the halves' own figures do not (one half is NaN: constant)."""
    g = torch.Generator().manual_seed(0)
    values, mask = torch.randn(4, 5, generator=g), torch.ones(4, 5)
    mask[3, 2:] = 0
    returns = torch.cat([torch.full((2, 5), 0.7), torch.randn(2, 5, generator=g)])
    halves = [explained_variance_terms(values[i:i + 2], returns[i:i + 2], mask[i:i + 2]) for i in (0, 2)]
    assert math.isnan(explained_variance(values[:2], returns[:2], mask[:2]))
    for scale in (1.0, 0.5):
        terms = {k: scale * sum(float(h[k]) for h in halves) for k in EV_TERMS}
        terms["_ev/r_abs_max"] = max(float(h["_ev/r_abs_max"]) for h in halves)
        assert explained_variance_of(terms) == pytest.approx(float(explained_variance(values, returns, mask)),
                                                             rel=1e-9)
    constant = explained_variance_terms(values[:2], returns[:2], mask[:2])
    assert math.isnan(explained_variance_of(constant))
