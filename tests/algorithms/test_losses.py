"""Clipped policy loss: hand values, clip metrics, dual-clip, GSPO, IS weights, gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.losses import policy_loss


def test_hand_computed_decoupled_clip():
    old = torch.zeros(1, 4)
    logprobs = torch.tensor([[0.5, -0.5, 0.0, 3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # t0: ratio e^.5 = 1.6487 > 1.28, A>0 -> -1.28; t1: ratio e^-.5 = .6065 < .8, A<0 -> .8; t2: -2
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.0) / 3.0, abs=1e-6)
    assert metrics["actor/clip_frac_high"] == pytest.approx(1 / 3)
    assert metrics["actor/clip_frac_low"] == pytest.approx(1 / 3)
    assert metrics["actor/clip_frac"] == pytest.approx(2 / 3)
    assert metrics["actor/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert metrics["actor/ratio_min"] == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert metrics["actor/ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.5) + 1) / 3, rel=1e-6)
    k3 = [math.exp(x) - 1 - x for x in (0.5, -0.5, 0.0)]
    assert metrics["actor/approx_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A * ratio / 3
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -2.0 / 3.0, 0.0]]))


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[2.0, 2.0]])  # ratio e^2 = 7.389
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    plain, _ = policy_loss(logprobs, old, adv, mask)
    dual, metrics = policy_loss(logprobs, old, adv, mask, dual_clip=3.0)
    # t0 plain: max(7.389, 1.2) = 7.389; dual: min(7.389, 3) = 3; t1: -1.2 both
    assert plain.item() == pytest.approx((math.exp(2.0) - 1.2) / 2, rel=1e-6)
    assert dual.item() == pytest.approx((3.0 - 1.2) / 2, rel=1e-6)
    assert metrics["actor/dual_clip_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logprobs, old, adv, mask, dual_clip=0.9)


def test_sequence_level_ratio_gspo():
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[0.1, 0.3, 5.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, metrics = policy_loss(logprobs, old, adv, mask, level="sequence", clip_high=0.5, agg="seq-mean-token-mean")
    s = math.exp(0.2)  # geometric mean of the valid token ratios of row 0
    assert metrics["actor/ratio_max"] == pytest.approx(s, rel=1e-6)
    assert loss.item() == pytest.approx((-s + 1.0) / 2, rel=1e-6)
    loss.backward()
    # d/dlogp of -s * A: each valid token of row 0 gets -s/2 (seq weight) * 1/2 (seq-mean) ... GSPO-token form
    torch.testing.assert_close(logprobs.grad[0], torch.tensor([-s / 4, -s / 4, 0.0]))


def test_is_weights_scale_token_losses_and_are_detached():
    old = torch.zeros(1, 2)
    logprobs = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0]])
    w = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss, _ = policy_loss(logprobs, old, adv, torch.ones(1, 2), is_weights=w)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    loss.backward()
    assert w.grad is None


def test_fully_masked_batch_gives_zero_and_no_nan():
    lp = torch.randn(2, 3, requires_grad=True)
    loss, metrics = policy_loss(lp, torch.full((2, 3), float("-inf")), torch.randn(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(lp.grad).all()


def test_errors_name_both_shapes():
    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 3\) but advantages has shape \(2,\)"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="empty batch"):
        policy_loss(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), torch.ones(0, 3))
    with pytest.raises(ValueError, match="level"):
        policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), level="seq")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradcheck(agg):
    g = torch.Generator().manual_seed(3)
    B, T = 3, 5
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    # keep ratios in (0.75, 1.3) but off the clip boundaries' neighbourhood
    logprobs = (old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 3:] = 0
    w = torch.rand(B, T, generator=g, dtype=torch.float64)

    def f(lp):
        return policy_loss(lp, old, adv, mask, agg=agg, is_weights=w, dual_clip=3.0)[0]

    assert torch.autograd.gradcheck(f, (logprobs,))


def test_sequence_level_gradient_equals_gspo_objective():
    """GSPO-token with per-sequence advantages and seq-mean-token-mean has GSPO's gradient."""
    g = torch.Generator().manual_seed(4)
    B, T = 4, 6
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    logprobs = (old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 2:] = 0
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    adv = seq_adv.unsqueeze(1).expand(B, T)
    loss, _ = policy_loss(logprobs, old, adv, mask, level="sequence", agg="seq-mean-token-mean", clip_low=0.1, clip_high=0.15)
    (grad,) = torch.autograd.grad(loss, logprobs)

    lp = logprobs.detach().clone().requires_grad_()
    s = torch.exp(((lp - old) * mask).sum(1) / mask.sum(1))
    ref = torch.maximum(-seq_adv * s, -seq_adv * s.clamp(0.9, 1.15)).mean()
    (ref_grad,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss.detach(), ref.detach())
    torch.testing.assert_close(grad, ref_grad)


def test_matches_per_token_loop_on_random_inputs():
    g = torch.Generator().manual_seed(7)
    B, T = 4, 6
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.25).double()
    lo, hi, dual = 0.2, 0.28, 2.0
    total, count, low, high = 0.0, 0, 0, 0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            r, a = math.exp(float(lp[b, t] - old[b, t])), float(adv[b, t])
            loss_t = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
            if a < 0:
                loss_t = min(loss_t, -a * dual)
            total, count = total + loss_t, count + 1
            low += r < 1 - lo and a < 0
            high += r > 1 + hi and a > 0
    loss, metrics = policy_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi, dual_clip=dual)
    assert loss.item() == pytest.approx(total / count, rel=1e-12)
    assert metrics["actor/clip_frac_low"] == pytest.approx(low / count)
    assert metrics["actor/clip_frac_high"] == pytest.approx(high / count)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batched_policy_loss_equals_full_batch(agg):
    from relayrl.algorithms.losses import count_tokens_and_seqs

    g = torch.Generator().manual_seed(5)
    B, T = 6, 5
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    full, _ = policy_loss(lp, old, adv, mask, agg=agg)
    tokens, seqs = count_tokens_and_seqs(mask)
    parts = [
        policy_loss(lp[a:b], old[a:b], adv[a:b], mask[a:b], agg=agg, global_tokens=tokens, global_seqs=seqs)[0]
        for a, b in [(0, 2), (2, 3), (3, 6)]
    ]
    torch.testing.assert_close(sum(parts), full)


def test_logprob_error_compares_the_trainers_logprobs_in_every_old_logprobs_mode():
    """Issue 11 item 2: with old_logprobs=rollout pi_old is the generator's log-probs; the metric compared them
    with themselves and read 1.0 whatever the mismatch (fails before)."""
    from relayrl.engines.training.base import MicroBatch
    from relayrl.workflows.losses import PolicyLoss

    current = torch.tensor([[-1.0, -2.0, -0.5]])
    gen = current + torch.tensor([[0.1, -0.2, 0.0]])
    mask = torch.ones(1, 3)
    want = (math.exp(0.1) + math.exp(0.2) + 1.0) / 3
    fields = {"advantages": torch.ones(1, 3), "gen_logprobs": gen}
    rollout_mode = PolicyLoss(old_key="gen_logprobs")(MicroBatch(current, mask, dict(fields), 3, 1))[1]
    assert rollout_mode["rollout/logprob_error"] == pytest.approx(want, rel=1e-6)
    on_policy = PolicyLoss()(MicroBatch(current, mask, dict(fields), 3, 1))[1]
    assert on_policy["rollout/logprob_error"] == pytest.approx(want, rel=1e-6)
    recomputed = PolicyLoss()(MicroBatch(current + 5.0, mask, {**fields, "old_logprobs": current}, 3, 1))[1]
    assert recomputed["rollout/logprob_error"] == pytest.approx(want, rel=1e-6)  # pi_old, not the drifted policy


def test_kl_to_the_reference_is_reported_when_it_is_in_the_rewards():
    """Issue 11 item 7: with kl_in_reward the loss has kl_coef=0 and reported no KL (fails before)."""
    from relayrl.engines.training.base import MicroBatch
    from relayrl.workflows.losses import PolicyLoss

    current = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -0.1]])
    mb = MicroBatch(current, torch.ones(1, 3), {"advantages": torch.ones(1, 3), "ref_logprobs": ref}, 3, 1)
    loss, metrics = PolicyLoss(kl_coef=0.0)(mb)
    assert metrics["actor/ref_kl_k1"] == pytest.approx((0.5 + 0.0 - 0.4) / 3, rel=1e-6)
    assert "actor/kl_loss" not in metrics
    plain, _ = PolicyLoss(kl_coef=0.0)(MicroBatch(current, mb.mask, {"advantages": torch.ones(1, 3)}, 3, 1))
    assert loss.item() == pytest.approx(plain.item())  # a metric, not a loss term
