"""KTO's loss and its unpaired APO-zero (relayrl.algorithms.kto) against hand-computed numbers, the KL estimate
and the gradients."""

import math

import pytest
import torch

from relayrl.algorithms.kto import apo_zero_unpaired_loss, kl_estimate, kto_loss, kto_terms


def _rows():
    # r = logps - ref = [0.5, -1.0, 0.0]; rows 0 and 2 desirable, row 1 undesirable
    logps = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -3.0], requires_grad=True)
    return logps, ref, torch.tensor([True, False, True])


def test_kto_loss_matches_hand_computed_numbers_with_weights():
    logps, ref, d = _rows()
    kl, kl_ref = torch.tensor([-2.0, -1.0]), torch.tensor([-2.4, -1.4])  # z0 = mean(0.4, 0.4) = 0.4
    loss, m = kto_loss(logps, ref, kl, kl_ref, d, beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    # 2 (1 - sig(0.5 (0.5 - 0.4))) = 2 (1 - 0.5124974) ; 0.5 (1 - sig(0.5 (0.4 + 1))) = 0.5 (1 - 0.6681878);
    # 2 (1 - sig(0.5 (0 - 0.4))) = 2 (1 - 0.4501660)
    want = (0.9750052 + 0.1659061 + 1.0996680) / 3
    assert float(loss.detach()) == pytest.approx(want, abs=1e-6)
    assert m["kto/loss"] == pytest.approx(want, abs=1e-6)
    assert m["kto/kl"] == pytest.approx(0.4, abs=1e-6)
    assert m["kto/rewards_desirable"] == pytest.approx(0.5 * (0.5 + 0.0) / 2)
    assert m["kto/rewards_undesirable"] == pytest.approx(-0.5)
    assert m["kto/reward_margin"] == pytest.approx(0.125 + 0.5)
    assert m["kto/logps_desirable"] == pytest.approx(-2.0) and m["kto/logps_undesirable"] == pytest.approx(-2.0)
    assert m["kto/desirable_fraction"] == pytest.approx(2 / 3)


def test_default_weights_and_beta_are_trls():
    logps, ref, d = _rows()
    z = torch.zeros(1)
    loss, _ = kto_loss(logps, ref, z, z, d)  # beta 0.1, weights 1, z0 = 0
    want = ((1 - torch.sigmoid(torch.tensor(0.05))) + (1 - torch.sigmoid(torch.tensor(0.1)))
            + (1 - torch.sigmoid(torch.tensor(0.0)))) / 3
    assert float(loss.detach()) == pytest.approx(float(want), abs=1e-7)


def test_the_kl_estimate_is_clamped_at_zero_and_detached():
    kl = torch.tensor([-3.0, -1.0], requires_grad=True)
    assert float(kl_estimate(kl, torch.tensor([-2.0, -1.5]))) == 0.0  # mean(-1, 0.5) = -0.25 -> 0
    z = kl_estimate(kl, torch.tensor([-3.5, -1.5]))
    assert float(z) == pytest.approx(0.5) and not z.requires_grad
    logps, ref, d = _rows()
    loss, m = kto_loss(logps, ref, torch.tensor([-3.0]), torch.tensor([-2.0]), d, beta=1.0)
    assert m["kto/kl"] == 0.0  # clamped: the loss is taken against z0 = 0
    want = ((1 - torch.sigmoid(torch.tensor(0.5))) + (1 - torch.sigmoid(torch.tensor(1.0)))
            + (1 - torch.sigmoid(torch.tensor(0.0)))) / 3
    assert float(loss.detach()) == pytest.approx(float(want), abs=1e-7)


def test_gradient_reaches_the_policy_log_probs_only():
    logps, ref, d = _rows()
    kl = torch.tensor([-2.0, -1.0], requires_grad=True)
    kl_ref = torch.tensor([-2.4, -1.4], requires_grad=True)
    beta = 0.5
    loss, _ = kto_loss(logps, ref, kl, kl_ref, d, beta=beta, desirable_weight=2.0, undesirable_weight=0.5)
    loss.backward()
    assert kl.grad is None and kl_ref.grad is None and ref.grad is None  # z0 and the reference take none
    # d/dr of lambda (1 - sig(beta m)): -lambda beta sig (1 - sig) dm/dr, m = r - z0 (desirable), z0 - r (undesirable)
    s = torch.sigmoid(beta * torch.tensor([0.1, 1.4, -0.4]))
    want = torch.tensor([-2.0, 0.5, -2.0]) * beta * s * (1 - s) / 3
    assert torch.allclose(logps.grad, want, atol=1e-7)
    assert logps.grad[0] < 0 and logps.grad[1] > 0  # descent raises the desirable, lowers the undesirable


def test_kto_terms_take_a_z0_with_a_graph_as_a_constant_and_check_their_inputs():
    logps, ref, d = _rows()
    z0 = torch.tensor(0.3, requires_grad=True)
    losses, rewards = kto_terms(logps, ref, z0 * 1.0, d, beta=0.1)
    losses.sum().backward()
    assert z0.grad is None and not rewards.requires_grad
    with pytest.raises(ValueError, match="beta must be > 0"):
        kto_terms(logps, ref, 0.0, d, beta=0.0)
    with pytest.raises(ValueError, match="shape"):
        kto_terms(logps, ref[:2], 0.0, d, beta=0.1)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_apo_zero_unpaired_matches_hand_computed_numbers_and_gradient():
    """TRL's loss_type="apo_zero_unpaired": desirable w_D (1 - sigmoid(beta r)), undesirable w_U sigmoid(beta r),
    no KL estimate."""
    logps, ref, d = _rows()  # r = [0.5, -1.0, 0.0]
    beta = 0.5
    loss, m = apo_zero_unpaired_loss(logps, ref, d, beta=beta, desirable_weight=2.0, undesirable_weight=0.5)
    want = (2.0 * (1 - _sig(0.25)) + 0.5 * _sig(-0.5) + 2.0 * (1 - _sig(0.0))) / 3
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6) and m["kto/loss"] == pytest.approx(want, rel=1e-6)
    assert "kto/kl" not in m  # no estimate to report
    assert m["kto/rewards_desirable"] == pytest.approx(0.125) and m["kto/rewards_undesirable"] == pytest.approx(-0.5)
    assert m["kto/desirable_fraction"] == pytest.approx(2 / 3)
    loss.backward()
    assert ref.grad is None
    sp = lambda x: _sig(x) * (1 - _sig(x))  # noqa: E731  (sigmoid')
    want_grad = [-2.0 * beta * sp(0.25) / 3, 0.5 * beta * sp(-0.5) / 3, -2.0 * beta * sp(0.0) / 3]
    assert logps.grad.tolist() == pytest.approx(want_grad, rel=1e-5)
    assert logps.grad[0] < 0 and logps.grad[1] > 0  # descent raises the desirable, lowers the undesirable


def test_apo_zero_unpaired_is_kto_against_a_zero_kl_estimate_only():
    logps, ref, d = _rows()
    apo, _ = apo_zero_unpaired_loss(logps, ref, d, beta=0.3)
    same, _ = kto_loss(logps, ref, torch.tensor([-1.0]), torch.tensor([-1.0]), d, beta=0.3)  # z0 = 0
    assert float(apo.detach()) == pytest.approx(float(same.detach()), rel=1e-7)
    kto, m = kto_loss(logps, ref, torch.tensor([-1.0]), torch.tensor([-2.0]), d, beta=0.3)  # z0 = 1
    assert m["kto/kl"] == pytest.approx(1.0) and float(kto.detach()) != pytest.approx(float(apo.detach()), rel=1e-3)
    with pytest.raises(ValueError, match="beta must be > 0"):
        apo_zero_unpaired_loss(logps, ref, d, beta=0.0)
    with pytest.raises(ValueError, match="weights must be >= 0"):
        apo_zero_unpaired_loss(logps, ref, d, undesirable_weight=-1.0)


def test_kto_loss_names_match_the_config():
    from typing import get_args

    from relayrl.algorithms.names import KTO_LOSSES
    from relayrl.config.kto import KTOConfig

    assert get_args(KTOConfig.model_fields["loss"].annotation) == KTO_LOSSES
    assert KTOConfig().loss == "kto"  # TRL's default loss_type
