"""SAPO's soft gate, VESPO's sequence kernel, LUSPO as a PPO configuration, the high-entropy token selection and
the ratio-weighted KL: each gradient against its hand-derived formula."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.entropy import high_entropy_mask
from relayrl.algorithms.kl import kl_loss
from relayrl.algorithms.losses import POLICY_LOSSES, policy_loss
from relayrl.algorithms.sapo import sapo_loss
from relayrl.algorithms.vespo import vespo_loss, vespo_weight

OLD = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, -3.0, -1.0]])
SHIFT = torch.tensor([[0.0, 0.5, -0.5], [0.1, -0.05, 0.0]])  # log r on each token
ADV = torch.tensor([[1.0, 1.0, -1.0], [-2.0, 0.5, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _lp(shift=SHIFT):
    return (OLD + shift).clone().requires_grad_(True)


def _grad(fn, shift=SHIFT, **kw):
    lp = _lp(shift)
    loss, metrics = fn(lp, OLD, ADV, MASK, agg="token-mean", **kw)
    loss.backward()
    return lp.grad, loss, metrics


def test_registry_names_every_loss():
    assert set(POLICY_LOSSES) == {"ppo", "cispo", "sapo", "vespo", "clip_cov", "kl_cov", "gmpo", "gpg"}


def test_sapo_gradient_is_the_soft_gate_times_the_policy_gradient():
    grad, loss, m = _grad(sapo_loss, tau_pos=1.0, tau_neg=1.05)
    r = torch.exp(SHIFT)
    tau = torch.where(ADV > 0, 1.0, 1.05)
    p = torch.sigmoid(tau * (r - 1))
    expected = -4 * p * (1 - p) * r * ADV * MASK / 5  # d f(r) / d log pi = 4 p (1 - p) r; token-mean over 5
    torch.testing.assert_close(grad, expected)
    assert float(loss.detach()) == pytest.approx(float((-(4 / tau) * p * ADV * MASK).sum() / 5), rel=1e-6)
    gate = (4 * p * (1 - p))[MASK.bool()].mean()
    assert m["actor/soft_gate_mean"] == pytest.approx(float(gate), rel=1e-6) and m["actor/soft_gate_mean"] < 1
    assert m["actor/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)


def test_sapo_on_policy_is_ppo_and_off_policy_fades_smoothly():
    on = torch.zeros_like(SHIFT)
    torch.testing.assert_close(_grad(sapo_loss, on)[0], _grad(policy_loss, on)[0])
    # far off-policy a positive-advantage token keeps a small, nonzero gradient (PPO's clip would zero it)
    far = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    g_sapo, g_ppo = _grad(sapo_loss, far)[0], _grad(policy_loss, far)[0]
    assert g_ppo[0, 1] == 0 and 0 > g_sapo[0, 1] > -0.2 / 5
    # a larger tau fades sooner
    g_sharp = _grad(sapo_loss, far, tau_pos=3.0)[0]
    assert abs(g_sharp[0, 1]) < abs(g_sapo[0, 1])


def test_sapo_negative_tokens_use_tau_neg_and_refusals():
    shift = torch.full_like(SHIFT, 0.3)
    a, b = _grad(sapo_loss, shift, tau_neg=1.05)[0], _grad(sapo_loss, shift, tau_neg=4.0)[0]
    neg, pos = (ADV < 0) & MASK.bool(), (ADV > 0) & MASK.bool()
    torch.testing.assert_close(a[pos], b[pos])
    assert (b[neg].abs() < a[neg].abs()).all()
    with pytest.raises(ValueError, match="temperatures"):
        sapo_loss(_lp(), OLD, ADV, MASK, tau_pos=0.0)
    with pytest.raises(ValueError, match="dual_clip"):
        sapo_loss(_lp(), OLD, ADV, MASK, dual_clip=3.0)


def test_sapo_at_sequence_level_gates_the_sequence_ratio():
    lp = _lp()
    _, m = sapo_loss(lp, OLD, ADV, MASK, level="sequence")
    s0 = math.exp((0.0 + 0.5 - 0.5) / 3)
    assert m["actor/ratio_max"] == pytest.approx(max(s0, math.exp((0.1 - 0.05) / 2)), rel=1e-6)


def test_vespo_kernel_is_one_at_one_and_peaks_at_k_over_lambda():
    pos = torch.tensor([True])
    phi = lambda w, **kw: float(vespo_weight(torch.tensor([math.log(w)]), pos, **{  # noqa: E731
        "k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0, **kw}))
    assert phi(1.0) == pytest.approx(1.0)
    assert phi(0.5) == pytest.approx(0.5 ** 2 * math.exp(3 * 0.5), rel=1e-6)
    ws = [0.3 + 0.01 * i for i in range(80)]
    assert max(ws, key=phi) == pytest.approx(2 / 3, abs=0.01)
    assert phi(50.0) == pytest.approx(0.0, abs=1e-30)  # a wild sequence weight vanishes, finite
    neg = float(vespo_weight(torch.tensor([math.log(0.5)]), torch.tensor([False]), k_pos=2.0, lambda_pos=3.0,
                             k_neg=3.0, lambda_neg=2.0))
    assert neg == pytest.approx(0.5 ** 3 * math.exp(2 * 0.5), rel=1e-6)


def test_vespo_gradient_is_the_kernel_of_the_sequence_ratio_times_the_policy_gradient():
    grad, loss, m = _grad(vespo_loss)
    log_w = (SHIFT * MASK).sum(1, keepdim=True)  # row 0: 0.0, row 1: 0.05
    k = torch.where(ADV >= 0, 2.0, 3.0)
    lam = torch.where(ADV >= 0, 3.0, 2.0)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    torch.testing.assert_close(grad, -phi * ADV * MASK / 5)
    assert float(loss.detach()) == pytest.approx(float((-phi * ADV * (OLD + SHIFT) * MASK).sum() / 5), rel=1e-6)
    assert m["actor/seq_log_ratio_mean"] == pytest.approx(0.025, rel=1e-5)
    # on-policy: the policy gradient, as PPO's
    on = torch.zeros_like(SHIFT)
    torch.testing.assert_close(_grad(vespo_loss, on)[0], _grad(policy_loss, on)[0])
    # further token factors multiply the token loss
    isw = torch.tensor([[0.5, 0.0, 1.0], [2.0, 1.0, 1.0]])
    torch.testing.assert_close(_grad(vespo_loss, is_weights=isw)[0], -phi * isw * ADV * MASK / 5)
    with pytest.raises(ValueError, match="level 'token'"):
        vespo_loss(_lp(), OLD, ADV, MASK, level="sequence")


def test_luspo_is_gspo_with_each_sequence_loss_times_its_length():
    """LUSPO (2026): GSPO's per-sequence loss scaled by the sequence's length, averaged over sequences: the
    sequence ratio with the seq-mean-token-sum aggregation."""
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    lp = _lp()
    policy_loss(lp, OLD, adv, MASK, level="sequence", agg="seq-mean-token-sum", clip_low=0.2,
                clip_high=0.2)[0].backward()
    lp2 = _lp()
    lengths = MASK.sum(1).float()
    s = torch.exp(((lp2 - OLD) * MASK).sum(1) / lengths)
    a = adv[:, 0]
    per_seq = -torch.minimum(s * a, s.clamp(0.8, 1.2) * a)
    (per_seq * lengths).mean().backward()
    torch.testing.assert_close(lp.grad, lp2.grad)


def test_high_entropy_mask_keeps_the_top_fraction_of_valid_tokens():
    ent = torch.tensor([[0.1, 2.0, 0.5, 9.0], [1.0, 3.0, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])  # the 9.0 is padding: never kept, never counted
    keep, m = high_entropy_mask(ent, mask, 0.5)
    assert keep.tolist() == [[0, 1, 0, 0], [1, 1, 0, 0]]  # the median of [.1 .2 .5 1 2 3] is 0.75
    assert m["actor/entropy_kept_frac"] == pytest.approx(3 / 6) and m["actor/entropy_threshold"] == pytest.approx(0.75)
    keep, m = high_entropy_mask(ent, mask, 1 / 3)  # quantile 2/3: 1 + 1/3 (2 - 1), linearly interpolated
    assert keep.tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]] and m["actor/entropy_threshold"] == pytest.approx(4 / 3)
    assert high_entropy_mask(ent, mask, 1.0)[0].tolist() == mask.float().tolist()
    assert high_entropy_mask(ent, mask, 0.0)[0].sum() == 1  # the top token only
    assert high_entropy_mask(ent, torch.zeros_like(mask), 0.2)[0].sum() == 0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        high_entropy_mask(ent, mask, 1.5)


def test_ratio_weighted_kl_is_unbiased_for_the_sampling_policy():
    """With tokens sampled from pi_old, E_old[(pi/pi_old) k3] is KL(pi || ref): the weighted estimate's value
    and gradient, against the formula (k3 = e^-d - 1 + d, d = log pi - log ref)."""
    ref = OLD - 0.3
    lp = _lp()
    ratio = torch.exp(lp - OLD)
    loss, _ = kl_loss(lp, ref, MASK, kind="k3", agg="token-mean", ratio=ratio)
    loss.backward()
    lp2 = _lp()
    d = lp2 - ref
    (((torch.exp(-d) - 1 + d) * torch.exp(lp2 - OLD) * MASK).sum() / 5).backward()
    torch.testing.assert_close(lp.grad, lp2.grad)
    plain, _ = kl_loss(OLD.clone(), ref, MASK, kind="k3", agg="token-mean")
    weighted, _ = kl_loss(OLD.clone(), ref, MASK, kind="k3", agg="token-mean", ratio=torch.ones_like(OLD))
    assert float(plain) == pytest.approx(float(weighted))  # on-policy: the ratio is 1
