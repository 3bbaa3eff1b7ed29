"""Online DPO (:mod:`relayrl.algorithms.online_dpo`): the best-worst pair of each prompt group (ties, groups of
equal rewards, groups of more than two), and the key property: the estimator's advantages through the ratio-free
policy loss summed per response (``policy_loss=gpg``, ``loss_agg=seq-mean-token-sum``) have the gradient of
:func:`relayrl.algorithms.dpo.dpo_loss` on the same pairs, for every kind, and the value logged is DPO's."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.dpo import DPO_KINDS, dpo_loss
from relayrl.algorithms.estimators import ESTIMATORS, EstimatorInputs, compute
from relayrl.algorithms.estimators.online_dpo import DPOSpec
from relayrl.algorithms.gpg import gpg_loss
from relayrl.algorithms.online_dpo import best_worst_pairs, online_dpo_advantages, online_dpo_coefficients


def test_the_highest_and_the_lowest_reward_of_each_group_make_its_pair():
    # group 5: four responses, best row 3, worst row 1; group 2: two responses
    rewards = torch.tensor([0.5, 0.0, 0.2, 1.0, 0.7, 0.1])
    groups = torch.tensor([5, 5, 5, 5, 2, 2])
    chosen, rejected, n = best_worst_pairs(rewards, groups)
    assert n == 2
    assert chosen.tolist() == [4, 3] and rejected.tolist() == [5, 1]  # in the order of the groups' ids (2, 5)


def test_ties_go_to_the_first_row_and_equal_groups_give_no_pair():
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0,   3.0, 3.0, 3.0,   2.0,   1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0,            1, 1, 1,         2,     3, 3, 3, 3])
    chosen, rejected, n = best_worst_pairs(rewards, groups)
    # group 0: best tied at rows 1 and 2, worst at 0 and 3 -> (1, 0); groups 1 (all equal) and 2 (one row): none;
    # group 3 interleaved: best rows 8 and 10 -> 8, worst rows 9 and 11 -> 9
    assert n == 4 and chosen.tolist() == [1, 8] and rejected.tolist() == [0, 9]
    c, r, n = best_worst_pairs(torch.ones(4), torch.tensor([0, 0, 1, 1]))
    assert n == 2 and c.numel() == 0 and r.numel() == 0


def test_pairs_refuse_what_cannot_be_ranked():
    with pytest.raises(ValueError, match="finite"):
        best_worst_pairs(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="integers"):
        best_worst_pairs(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        best_worst_pairs(torch.tensor([0.0, 1.0]), torch.tensor([0, 0, 0]))


def _batch(seed: int = 0, dtype=torch.float64):
    """Four prompt groups of three responses of unequal lengths: a group with a tie for the best, one whose
    rewards are all equal (no pair), two plain; the per-token log-probs of the policy and the reference."""
    g = torch.Generator().manual_seed(seed)
    B, T = 12, 6
    lengths = torch.tensor([6, 3, 5, 2, 6, 4, 1, 5, 6, 3, 3, 4])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    logprobs = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    ref = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    rewards = torch.tensor([1.0, 0.0, 1.0,  0.3, 0.3, 0.3,  0.0, 0.5, 0.2,  2.0, -1.0, 0.5], dtype=dtype)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    return logprobs, ref, mask, rewards, groups


def _dpo_gradient(logprobs, ref, mask, rewards, groups, spec: DPOSpec):
    """``dpo_loss`` on the best-worst pairs (+ the chosen's NLL), its value and gradient w.r.t. the log-probs."""
    lp = logprobs.clone().requires_grad_(True)
    s, r = (lp * mask).sum(1), (ref * mask).sum(1)
    c, w, _ = best_worst_pairs(rewards, groups)
    loss, _ = dpo_loss(s[c], s[w], r[c], r[w], beta=spec.beta, kind=spec.kind, label_smoothing=spec.label_smoothing)
    if spec.nll_weight:
        loss = loss + spec.nll_weight * (-s[c] / mask.sum(1)[c]).mean()
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), grad


def _surrogate_gradient(logprobs, mask, advantages):
    """The pipeline's policy loss on the advantages: gpg's -A log pi, summed per response, mean over responses."""
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = gpg_loss(lp, lp.detach(), advantages, mask, agg="seq-mean-token-sum")
    (grad,) = torch.autograd.grad(loss, lp)
    return grad, metrics


SPECS = [DPOSpec(kind=k) for k in DPO_KINDS] + [DPOSpec(beta=0.5, label_smoothing=0.2),
                                                DPOSpec(beta=0.05, nll_weight=1.0)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-b{s.beta}-ls{s.label_smoothing}-nll{s.nll_weight}")
def test_the_surrogates_gradient_is_dpos_on_the_same_pairs(spec):
    """The estimator sees the log-probs before the update (detached); the policy loss then takes the gradient at
    those same weights: it equals dpo_loss's gradient w.r.t. every log-prob, to rounding, and the logged
    online_dpo/loss is dpo_loss's value."""
    logprobs, ref, mask, rewards, groups = _batch()
    est = ESTIMATORS["online-dpo"]
    out = est(EstimatorInputs(rewards, groups, mask, logprobs=logprobs.detach(), ref_logprobs=ref, dpo=spec))
    value, want = _dpo_gradient(logprobs, ref, mask, rewards, groups, spec)
    got, _ = _surrogate_gradient(logprobs, mask, out.advantages)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7)
    assert bool(want.abs().sum() > 0)  # (a gradient that could differ)
    assert out.metrics["online_dpo/loss"] == pytest.approx(value, rel=1e-9)
    # rows in no pair carry no advantage: group 1 (equal rewards), row 2 (tied for group 0's best with row 0,
    # which comes first) and the middle responses of groups 2 and 3
    no_pair = [2, 3, 4, 5, 8, 11]
    assert bool((out.advantages[no_pair] == 0).all())


def test_float32_log_probs_match_to_1e_6():
    logprobs, ref, mask, rewards, groups = (t.float() if t.is_floating_point() else t for t in _batch(seed=3))
    adv = compute("online-dpo", rewards=rewards, group_ids=groups, mask=mask, logprobs=logprobs, ref_logprobs=ref)
    _, want = _dpo_gradient(logprobs, ref, mask, rewards, groups, DPOSpec())
    got, _ = _surrogate_gradient(logprobs, mask, adv)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_the_coefficients_by_hand():
    """Sigmoid DPO, two pairs: g_w = -beta sigmoid(-beta m) / P, g_l = -g_w; the advantage is -g times the
    batch's rows that have a token (here 5 of 6: a row without a valid token is no sequence to the mean)."""
    beta = 0.2
    s = torch.tensor([-2.0, -5.0, -3.0, -1.0, -4.0, 0.0], dtype=torch.float64)
    r = torch.tensor([-3.0, -4.0, -3.0, -2.0, -2.0, 0.0], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    g, metrics = online_dpo_coefficients(s, r, torch.ones(6), rewards, groups, beta=beta)
    m0 = (-2.0 + 3.0) - (-5.0 + 4.0)  # pair (0, 1): margin 2
    m1 = (-1.0 + 2.0) - (-3.0 + 3.0)  # pair (3, 2): margin 1
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = [-beta * sig(-beta * m0) / 2, beta * sig(-beta * m0) / 2, beta * sig(-beta * m1) / 2,
            -beta * sig(-beta * m1) / 2, 0.0, 0.0]
    torch.testing.assert_close(g, torch.tensor(want, dtype=torch.float64))
    loss = (-math.log(sig(beta * m0)) - math.log(sig(beta * m1))) / 2
    assert metrics["online_dpo/loss"] == pytest.approx(loss)
    assert metrics["online_dpo/pairs"] == 2 and metrics["online_dpo/pair_frac"] == pytest.approx(2 / 3)
    assert metrics["online_dpo/reward_margin"] == pytest.approx(beta * (m0 + m1) / 2)
    assert metrics["online_dpo/reward_accuracy"] == 1.0 and metrics["online_dpo/score_margin"] == pytest.approx(1.0)
    # per token: every valid token of a row carries the row's advantage
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.float64)
    lp = torch.stack([s / 2, s / 2], 1) * mask  # (the sums are not these rows' own: the scale is the point here)
    adv, _ = online_dpo_advantages(lp, lp, mask, rewards, groups, beta=beta)
    assert bool((adv[5] == 0).all()) and bool((adv[1, 1] == 0))
    g_rows, _ = online_dpo_coefficients((lp * mask).sum(1), (lp * mask).sum(1), mask.sum(1), rewards, groups,
                                        beta=beta)
    torch.testing.assert_close(adv[:, 0], -g_rows * 5)


def test_no_pair_in_the_batch_means_no_gradient_and_no_loss_figure():
    logprobs, ref, mask, _, groups = _batch()
    out = ESTIMATORS["online-dpo"](EstimatorInputs(torch.zeros(12, dtype=torch.float64), groups, mask,
                                                   logprobs=logprobs, ref_logprobs=ref))
    assert bool((out.advantages == 0).all())
    assert out.metrics == {"online_dpo/pairs": 0.0, "online_dpo/pair_frac": 0.0}


def test_the_record_declares_what_it_needs():
    est = ESTIMATORS["online-dpo"]
    assert est.reference and est.old_logprobs and est.reads_old and not est.token_stats
    assert est.own_loss == "DPO" and est.min_group == 2 and not est.group_relative and not est.values
    assert est.params == frozenset({"online_dpo"})
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="reference model's log-probs"):
        compute("online-dpo", rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), mask=mask,
                logprobs=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="pre-update log-probs"):
        compute("online-dpo", rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), mask=mask,
                ref_logprobs=torch.zeros(2, 3))
    # the other estimators read neither pass but OTB's
    assert [n for n, e in ESTIMATORS.items() if e.reference] == ["online-dpo"]
    assert sorted(n for n, e in ESTIMATORS.items() if e.reads_old) == ["online-dpo", "otb", "otb-tir"]
