"""SimPO, ORPO, CPO and APO: hand-computed losses and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.cpo import cpo_loss
from relayrl.algorithms.dpo import dpo_loss
from relayrl.algorithms.names import AVERAGED_KINDS, PREFERENCE_KINDS, REFERENCE_FREE_KINDS, SMOOTHED_KINDS
from relayrl.algorithms.orpo import log1mexp, orpo_loss
from relayrl.algorithms.simpo import simpo_loss


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_simpo_hand_computed_loss_and_gradient():
    a_w = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    a_l = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    loss, m = simpo_loss(a_w, a_l, beta=2.0, gamma=1.0)  # logit 2(-1) - 2(-2) - 1 = 1
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), rel=1e-12)
    loss.backward()
    assert a_w.grad.item() == pytest.approx(-2.0 * _sig(-1.0), rel=1e-12)  # -beta sigmoid(-logit)
    assert a_l.grad.item() == pytest.approx(2.0 * _sig(-1.0), rel=1e-12)
    assert m["dpo/rewards_chosen"] == pytest.approx(-2.0) and m["dpo/rewards_rejected"] == pytest.approx(-4.0)
    assert m["dpo/reward_margin"] == pytest.approx(2.0) and m["dpo/reward_accuracy"] == 1.0
    assert m["dpo/logps_chosen"] == pytest.approx(-1.0)
    # gamma = 0 and beta = 1: DPO's sigmoid loss with the average log-probs and a zero reference
    z = torch.zeros(1, dtype=torch.float64)
    assert simpo_loss(a_w, a_l, beta=1.0, gamma=0.0)[0].item() == pytest.approx(
        dpo_loss(a_w, a_l, z, z, beta=1.0)[0].item())


def test_orpo_hand_computed_loss_and_gradient():
    # p_w = 1/2 (odds 1, log odds 0), p_l = 1/4 (odds 1/3): the log odds ratio is log 3
    a_w = torch.tensor([math.log(0.5)], dtype=torch.float64, requires_grad=True)
    a_l = torch.tensor([math.log(0.25)], dtype=torch.float64, requires_grad=True)
    loss, m = orpo_loss(a_w, a_l, beta=0.1)
    # NLL log 2, odds-ratio term -log sigmoid(log 3) = log(4/3)
    assert loss.item() == pytest.approx(math.log(2.0) + 0.1 * math.log(4.0 / 3.0), rel=1e-12)
    assert m["dpo/log_odds_ratio"] == pytest.approx(math.log(3.0)) and m["dpo/or_loss"] == pytest.approx(
        math.log(4.0 / 3.0))
    loss.backward()
    # d log odds / da = 1 / (1 - p); d(-log sigmoid(x))/dx = -sigmoid(-x) = -1/4 at x = log 3
    assert a_w.grad.item() == pytest.approx(-1.0 + 0.1 * (-0.25) * 2.0, rel=1e-12)
    assert a_l.grad.item() == pytest.approx(0.1 * (-0.25) * -(4.0 / 3.0), rel=1e-12)
    assert m["dpo/rewards_chosen"] == pytest.approx(0.1 * math.log(0.5))


def test_log1mexp_is_stable_on_both_branches_and_orpo_survives_p_equal_one():
    x = torch.tensor([-1e-10, -1e-3, -0.5, -0.7, -1.0, -30.0], dtype=torch.float64)
    # each value by the form exact in its range: log(-expm1) near 0, log1p(-exp) far below (there ~ -exp(v))
    want = torch.tensor([math.log(-math.expm1(v)) if v > -1 else math.log1p(-math.exp(v)) for v in x.tolist()],
                        dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), want, rtol=1e-12, atol=0)
    assert log1mexp(torch.tensor([-1e-10])).item() == pytest.approx(math.log(1e-10), rel=1e-6)  # float32
    a_w = torch.tensor([0.0, -0.3], requires_grad=True)  # p = 1: infinite odds, capped
    loss, _ = orpo_loss(a_w, torch.tensor([-1.0, -2.0]), beta=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a_w.grad).all()


def test_cpo_hand_computed_loss_and_gradient():
    # summed log-probs s_w = -3, s_l = -5, beta 0.5: the logit is 0.5 (-3 + 5) = 1
    s_w = torch.tensor([-3.0], dtype=torch.float64, requires_grad=True)
    s_l = torch.tensor([-5.0], dtype=torch.float64, requires_grad=True)
    loss, m = cpo_loss(s_w, s_l, beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), rel=1e-12)
    loss.backward()
    assert s_w.grad.item() == pytest.approx(-0.5 * _sig(-1.0), rel=1e-12)  # descent raises the chosen answer
    assert s_l.grad.item() == pytest.approx(0.5 * _sig(-1.0), rel=1e-12)  # and lowers the rejected one
    assert m["dpo/rewards_chosen"] == pytest.approx(-1.5) and m["dpo/rewards_rejected"] == pytest.approx(-2.5)
    assert m["dpo/reward_margin"] == pytest.approx(1.0) and m["dpo/reward_accuracy"] == 1.0
    assert m["dpo/logps_chosen"] == pytest.approx(-3.0)  # the sums, as the loss takes them
    # label smoothing eps = 0.2 (TRL's conservative form): 0.8 softplus(-1) + 0.2 softplus(1)
    s_w.grad = s_l.grad = None
    loss, _ = cpo_loss(s_w, s_l, beta=0.5, label_smoothing=0.2)
    assert loss.item() == pytest.approx(0.8 * math.log1p(math.exp(-1.0)) + 0.2 * math.log1p(math.exp(1.0)),
                                        rel=1e-12)
    loss.backward()
    assert s_w.grad.item() == pytest.approx(0.5 * (-0.8 * _sig(-1.0) + 0.2 * _sig(1.0)), rel=1e-12)
    # DPO's sigmoid loss against a reference that gives every answer log-prob 0
    rs = torch.tensor([-2.0, -7.0], dtype=torch.float64), torch.tensor([-4.0, -1.0], dtype=torch.float64)
    z = torch.zeros(2, dtype=torch.float64)
    assert cpo_loss(*rs, beta=0.3)[0].item() == pytest.approx(dpo_loss(*rs, z, z, beta=0.3)[0].item(), rel=1e-12)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        cpo_loss(s_w, s_l, beta=0.5, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta must be > 0"):
        cpo_loss(s_w, s_l, beta=0.0)
    with pytest.raises(ValueError, match=r"shape"):
        cpo_loss(s_w, torch.zeros(2), beta=0.1)


@pytest.mark.parametrize("kind", ["apo_zero", "apo_down"])
def test_apo_hand_computed_loss_and_gradient(kind):
    # chosen ratio c = 0.5, rejected ratio r = -0.5, beta 0.1
    c = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    r = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5], dtype=torch.float64)
    loss, m = dpo_loss(c, r, ref, ref, beta=0.1, kind=kind)
    loss.backward()
    d = lambda x: _sig(x) * (1.0 - _sig(x))  # noqa: E731  (sigmoid')
    if kind == "apo_zero":  # 1 - sigmoid(beta c) + sigmoid(beta r)
        want = 1.0 - _sig(0.05) + _sig(-0.05)
        grads = (-0.1 * d(0.05), 0.1 * d(-0.05))
    else:  # sigmoid(beta c) + 1 - sigmoid(beta (c - r))
        want = _sig(0.05) + 1.0 - _sig(0.1)
        grads = (0.1 * d(0.05) - 0.1 * d(0.1), 0.1 * d(0.1))
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert (c.grad.item(), r.grad.item()) == pytest.approx(grads, rel=1e-10)
    assert m["dpo/reward_margin"] == pytest.approx(0.1) and m["dpo/reward_accuracy"] == 1.0


@pytest.mark.parametrize("kind", ["simpo", "orpo", "cpo", "apo_zero", "apo_down"])
def test_gradcheck(kind):
    g = torch.Generator().manual_seed(0)
    xs = [-torch.rand(5, generator=g, dtype=torch.float64) * 3 - 0.01 for _ in range(4)]
    c, r = xs[0].requires_grad_(), xs[1].requires_grad_()
    if kind == "simpo":
        f = lambda c, r: simpo_loss(c, r, beta=2.0, gamma=0.5)[0]  # noqa: E731
    elif kind == "orpo":
        f = lambda c, r: orpo_loss(c, r, beta=0.3)[0]  # noqa: E731
    elif kind == "cpo":
        f = lambda c, r: cpo_loss(c, r, beta=0.3, label_smoothing=0.1)[0]  # noqa: E731
    else:
        f = lambda c, r: dpo_loss(c, r, xs[2], xs[3], beta=0.3, kind=kind)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (c, r), fast_mode=True)  # (a random projection of the Jacobian: ~5x faster)


def test_errors_and_names():
    one = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        simpo_loss(one, one, beta=1.0, gamma=-0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        orpo_loss(one, one, beta=0.0)
    with pytest.raises(ValueError, match=r"has shape \(1,\) but rejected_avg_logps has shape \(2,\)"):
        simpo_loss(one, torch.zeros(2), beta=1.0, gamma=0.0)
    with pytest.raises(ValueError, match="only defined for kind='sigmoid'"):
        dpo_loss(one, one, one, one, beta=0.1, kind="apo_zero", label_smoothing=0.1)
    from typing import get_args

    from relayrl.config.schema import DPOConfig
    assert get_args(DPOConfig.model_fields["kind"].annotation) == PREFERENCE_KINDS
    assert set(REFERENCE_FREE_KINDS) <= set(PREFERENCE_KINDS)
    assert set(AVERAGED_KINDS) <= set(REFERENCE_FREE_KINDS) and set(SMOOTHED_KINDS) <= set(PREFERENCE_KINDS)
