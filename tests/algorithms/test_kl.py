"""KL estimators, KL as loss and as reward penalty, KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_loss,
    kl_penalty_rewards,
)

LP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])  # d = logp - ref = [0.5, -1.0, 0.0]


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("k1", [0.5, -1.0, 0.0]),
        ("abs", [0.5, 1.0, 0.0]),
        ("k2", [0.125, 0.5, 0.0]),
        ("mse", [0.125, 0.5, 0.0]),
        ("k3", [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, 0.0]),
        ("low_var_kl", [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, 0.0]),
    ],
)
def test_estimators_hand_computed(kind, expected):
    torch.testing.assert_close(kl_estimate(LP, REF, kind), torch.tensor([expected]))


def test_k3_is_clamped_and_k1_k3_unbiased_on_samples():
    big = kl_estimate(torch.tensor([[-30.0]]), torch.tensor([[0.0]]), "k3")
    assert big.item() == 10.0
    # Sample from p = N-free categorical and check E_p[k1] ~ E_p[k3] ~ KL(p || q).
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64)
    idx = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[idx].unsqueeze(0), q.log()[idx].unsqueeze(0)
    true = (p * (p / q).log()).sum().item()
    assert kl_estimate(lp, lq, "k1").mean().item() == pytest.approx(true, abs=5e-3)
    assert kl_estimate(lp, lq, "k3").mean().item() == pytest.approx(true, abs=5e-3)


def test_kl_loss_and_unknown_kind():
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = kl_loss(LP, REF, mask, kind="abs")
    assert loss.item() == pytest.approx(0.75)
    assert metrics["actor/ref_kl_k1"] == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="valid kinds: k1, k2, k3, abs, mse, low_var_kl"):
        kl_estimate(LP, REF, "k4")
    with pytest.raises(ValueError, match=r"logprobs has shape \(1, 3\) but ref_logprobs has shape \(1, 2\)"):
        kl_estimate(LP, REF[:, :2], "k1")


def test_kl_penalty_rewards():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 1]])
    out, metrics = kl_penalty_rewards(rewards, LP, REF, mask, coef=0.1, kind="k1")
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.1, 1.0]]))
    assert metrics["actor/reward_kl"] == pytest.approx(-0.5 / 3)
    assert metrics["actor/kl_coef"] == pytest.approx(0.1)
    out, _ = kl_penalty_rewards(rewards, LP, REF, torch.tensor([[1, 0, 0]]), coef=0.1, kind="k1")
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.0, 0.0]]))


def test_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(3.0, 100)
    assert fixed.value == 0.05 and fixed.last_kl == 3.0
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=12.0, n_steps=1000)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    ctl.update(current_kl=5.4, n_steps=1000)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * 1.02 * (1 - 0.01))
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="coef"):
        FixedKLController(-1.0)


def test_kl_controller_from_config_values_and_its_state_round_trip():
    from relayrl.algorithms.kl import AdaptiveKLController, FixedKLController, kl_controller

    assert isinstance(kl_controller(0.1), FixedKLController)
    ctrl = kl_controller(0.1, target=0.02, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(0.04, n_steps=50)  # KL twice the target: error clipped to +0.2, half the horizon
    assert ctrl.value == pytest.approx(0.1 * 1.1)
    again = kl_controller(0.1, target=0.02, horizon=100)
    again.load_state_dict(ctrl.state_dict())
    assert again.value == ctrl.value and again.last_kl == 0.04
    fixed = kl_controller(0.3)
    fixed.load_state_dict({"coef": 9.0, "last_kl": 0.5})  # a fixed coefficient is the config's
    assert fixed.value == 0.3 and fixed.last_kl == 0.5
    with pytest.raises(ValueError, match="finite number >= 0"):
        again.load_state_dict({"coef": float("nan")})


def test_a_run_resumed_with_an_adaptive_kl_starts_from_its_own_coefficient():
    """algorithm.kl_target added on resume: the checkpoint's fixed coefficient (0 without a KL term, which the
    multiplicative update would keep at 0 for good) is not the adaptive controller's; algorithm.kl_coef is."""
    from relayrl.algorithms.kl import kl_controller

    for before in (0.0, 0.3):
        adaptive = kl_controller(0.05, target=0.02, horizon=100)
        adaptive.load_state_dict(kl_controller(before).state_dict())
        assert adaptive.value == 0.05
        adaptive.update(0.04, n_steps=50)
        assert adaptive.value == pytest.approx(0.05 * 1.1)


def test_plus_forms_keep_the_value_and_take_k2s_gradient():
    from relayrl.algorithms.kl import canonical_kind, kl_estimate

    ref = torch.tensor([[-1.0, -2.0, -0.5]])
    for kind in ("k3+", "low_var_kl+", "k1+", "abs+"):
        lp = torch.tensor([[-1.3, -1.0, -0.5]], requires_grad=True)
        est = kl_estimate(lp, ref, kind)
        torch.testing.assert_close(est, kl_estimate(lp.detach(), ref, kind.rstrip("+")))
        est.sum().backward()
        torch.testing.assert_close(lp.grad, (lp - ref).detach())  # d(d^2 / 2) / d log pi = d
    assert canonical_kind("low_var_kl+") == "k3+"
    with pytest.raises(ValueError, match="k3\\+"):
        canonical_kind("k9+")
