"""Rollout correction (relayrl.algorithms.correction) against hand-computed values and its edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.correction import (Correction, divergence_mask, kl_statistic, level_log_weights,
                                           mask_outside, rollout_correction, token_kl, truncate)
from relayrl.algorithms.offpolicy import truncated_is_weights

e = math.exp
OLD = torch.tensor([[0.0, 1.0, 0.2], [-0.5, 0.1, 0.0]])  # log pi_old; log mu = 0, so these are the log-ratios
MU = torch.zeros(2, 3)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_truncate():
    w, m = rollout_correction(OLD, MU, MASK, level="token", mode="truncate", high=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, e(0.2)], [e(-0.5), e(0.1), 0.0]]))
    assert m["correction/token_capped_frac"] == pytest.approx(1 / 5)
    assert m["correction/seq_capped_frac"] == pytest.approx(1 / 2)
    assert m["correction/token_masked_frac"] == 0.0
    assert m["correction/ratio_max"] == pytest.approx(e(1.0), rel=1e-6)
    assert m["correction/ratio_mean"] == pytest.approx((1 + e(1) + e(0.2) + e(-0.5) + e(0.1)) / 5, rel=1e-6)
    assert m["correction/weight_mean"] == pytest.approx((1 + 2 + e(0.2) + e(-0.5) + e(0.1)) / 5, rel=1e-6)


def test_token_mask_icepop_bounds():
    w, m = rollout_correction(OLD, MU, MASK, level="token", mode="mask", high=2.0)  # low = 1/2
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, e(0.2)], [e(-0.5), e(0.1), 0.0]]))
    assert m["correction/token_masked_frac"] == pytest.approx(1 / 5)
    assert m["correction/seq_masked_frac"] == 0.0
    w, m = rollout_correction(OLD, MU, MASK, level="token", mode="mask", high=2.0, low=0.7)  # e^-0.5 = 0.61 < 0.7
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, e(0.2)], [0.0, e(0.1), 0.0]]))
    assert m["correction/token_masked_frac"] == pytest.approx(2 / 5)


def test_sequence_product_and_geometric():
    w, m = rollout_correction(OLD, MU, MASK, level="sequence", mode="truncate", high=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 2.0], [e(-0.4), e(-0.4), 0.0]]))  # exp(1.2) capped
    assert m["correction/seq_capped_frac"] == pytest.approx(1 / 2)
    w, m = rollout_correction(OLD, MU, MASK, level="sequence", mode="mask", high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [e(-0.4), e(-0.4), 0.0]]))
    assert m["correction/seq_masked_frac"] == pytest.approx(1 / 2)
    assert m["correction/token_masked_frac"] == pytest.approx(3 / 5)
    w, _ = rollout_correction(OLD, MU, MASK, level="geometric", mode="mask", high=1.3, low=0.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [e(-0.2), e(-0.2), 0.0]]))  # e^0.4 = 1.49 > 1.3


def test_kl_estimates_and_divergence_mask():
    _, m = rollout_correction(OLD, MU, MASK, level=None)
    assert m["correction/kl_k1"] == pytest.approx((0 - 1 - 0.2 + 0.5 - 0.1) / 5, abs=1e-6)
    k3 = [e(x) - 1 - x for x in (0.0, 1.0, 0.2, -0.5, 0.1)]
    assert m["correction/kl_k3"] == pytest.approx(sum(k3) / 5, rel=1e-6)
    # per-sequence k1 = mean(log mu - log pi_old): row 0 -0.4, row 1 +0.2 -> row 1 dropped at 0.1
    w, m = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.1)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert m["correction/kl_masked_frac"] == pytest.approx(2 / 5)
    assert m["correction/seq_masked_frac"] == pytest.approx(1 / 2)
    assert m["correction/seq_kl_max"] == pytest.approx(0.2, abs=1e-6)
    # DeepSeek-V3.2: only the negative-advantage tokens of a divergent sequence
    adv = torch.tensor([[-1.0, -1.0, -1.0], [1.0, -1.0, 0.0]])
    w, _ = rollout_correction(OLD, MU, MASK, adv, level=None, kl_threshold=0.1, negative_only=True)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    # k3 per sequence: row 0 (0 + 0.718 + 0.021) / 3 = 0.247, row 1 (0.107 + 0.005) / 2 = 0.056 -> row 0 dropped
    w, _ = rollout_correction(OLD, MU, MASK, level="token", high=2.0, kl_threshold=0.1, kl_kind="k3")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [e(-0.5), e(0.1), 0.0]]))


def test_k2_and_the_kl_reductions():
    # per-token log-ratios l: row 0 (0, 1, 0.2), row 1 (-0.5, 0.1) [+ padding]
    k2 = [[0.0, 0.5, 0.02], [0.125, 0.005]]  # l^2 / 2
    k3 = [[0.0, e(1) - 2, e(0.2) - 1.2], [e(-0.5) - 0.5, e(0.1) - 1.1]]  # 0, 0.718, 0.0214 | 0.1065, 0.0052
    # k2 mean: row 0 0.52 / 3 = 0.173, row 1 0.13 / 2 = 0.065 -> row 0 dropped at 0.1
    w, m = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.1, kl_kind="k2")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["correction/seq_kl_max"] == pytest.approx(sum(k2[0]) / 3, rel=1e-6)
    # k1 sum: row 0 -1.2, row 1 0.4 (mean 0.2) -> at 0.3 the sum drops row 1, the mean keeps it
    w, m = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.3, kl_reduce="sum")
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert m["correction/seq_kl_max"] == pytest.approx(0.4, abs=1e-6)
    assert m["correction/kl_masked_frac"] == pytest.approx(2 / 5) and m["correction/seq_masked_frac"] == 0.5
    w, _ = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.3)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    # k3 sum: row 0 0.739, row 1 0.112 -> at 0.1 both dropped; at 0.5 only row 0
    w, _ = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.5, kl_kind="k3", kl_reduce="sum")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    # k2 max: row 0 0.5, row 1 0.125 -> at 0.2 the max drops row 0 whole; the mean (0.173) keeps it
    w, m = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.2, kl_kind="k2", kl_reduce="max")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["correction/seq_kl_max"] == pytest.approx(0.5, rel=1e-6)
    w, _ = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.2, kl_kind="k2")
    assert torch.equal(w, MASK.float())
    # k3 max: row 1's largest token is 0.1065 -> at 0.1 both rows dropped, at 0.11 only row 0
    w, m = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.11, kl_kind="k3", kl_reduce="max")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["correction/seq_kl_max"] == pytest.approx(k3[0][1], rel=1e-6)
    # token k3: only the tokens over 0.1 -- (0, 1) and (1, 0); with the token weight applied on the rest
    w, m = rollout_correction(OLD, MU, MASK, level="token", high=2.0, kl_threshold=0.1, kl_kind="k3",
                              kl_reduce="token")
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, e(0.2)], [0.0, e(0.1), 0.0]]))
    assert m["correction/kl_masked_frac"] == pytest.approx(2 / 5)
    assert m["correction/token_masked_frac"] == pytest.approx(2 / 5) and m["correction/seq_masked_frac"] == 0.0
    assert m["correction/seq_kl_max"] == pytest.approx(k3[0][1], rel=1e-6)
    # token k2 at 0.01 with negative_only: of the tokens over it ((0, 1), (0, 2), (1, 0)) only A < 0 ones go
    adv = torch.tensor([[-1.0, 1.0, -1.0], [-1.0, -1.0, 0.0]])
    w, _ = rollout_correction(OLD, MU, MASK, adv, level=None, kl_threshold=0.01, kl_kind="k2", kl_reduce="token",
                              negative_only=True)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    # sum with negative_only: row 1 (sum k1 0.4 > 0.3) loses its negative-advantage tokens only
    adv = torch.tensor([[-1.0, -1.0, -1.0], [1.0, -1.0, 0.0]])
    w, _ = rollout_correction(OLD, MU, MASK, adv, level=None, kl_threshold=0.3, kl_reduce="sum", negative_only=True)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    # an empty row is never dropped and not a sequence of the metrics, under every reduction
    empty = torch.tensor([[1, 1, 1], [0, 0, 0]])
    for reduce in ("mean", "sum", "max", "token"):
        w, m = rollout_correction(OLD, MU, empty, level=None, kl_threshold=0.0, kl_kind="k2", kl_reduce=reduce)
        assert torch.equal(w[1], torch.zeros(3)) and all(math.isfinite(v) for v in m.values())
        assert m["correction/seq_masked_frac"] == (0.0 if reduce == "token" else 1.0)
    with pytest.raises(ValueError, match="valid reductions: mean, sum, max, token"):
        rollout_correction(OLD, MU, MASK, kl_threshold=0.1, kl_reduce="seq_sum")
    spec = Correction(level=None, kl_threshold=0.2, kl_kind="k2", kl_reduce="max")
    torch.testing.assert_close(spec(OLD, MU, MASK)[0], torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_all_tokens_masked_and_empty_rows():
    w, m = rollout_correction(OLD, MU, torch.zeros(2, 3), level="sequence", mode="mask", kl_threshold=0.0)
    assert torch.equal(w, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in m.values())
    assert m["correction/ratio_max"] == 1.0 and m["correction/seq_masked_frac"] == 0.0
    # an empty row: ratio 1, KL 0, not a sequence of the fractions; the other row is masked whole
    w, m = rollout_correction(OLD, MU, torch.tensor([[1, 1, 1], [0, 0, 0]]), level="sequence", mode="mask")
    assert torch.equal(w, torch.zeros(2, 3))
    assert m["correction/seq_masked_frac"] == 1.0 and m["correction/token_masked_frac"] == 1.0
    # every token masked: a loss weighted by the factor is 0, with a zero (finite) gradient
    lp = torch.zeros(2, 3, requires_grad=True)
    (lp * w).sum().backward()
    assert torch.equal(lp.grad, torch.zeros(2, 3))


def test_ratios_zero_inf_and_nan():
    inf = float("inf")
    old = torch.tensor([[-inf, 0.0, -inf, -1.0]])  # ratio 0, inf, nan (both -inf), e^-1
    mu = torch.tensor([[0.0, -inf, -inf, 0.0]])
    mask = torch.ones(1, 4)
    w, m = rollout_correction(old, mu, mask, level="token", mode="truncate", high=2.0)
    torch.testing.assert_close(w, torch.tensor([[e(-20), 2.0, e(-20), e(-1)]]))
    assert m["correction/token_capped_frac"] == pytest.approx(1 / 4)
    w, m = rollout_correction(old, mu, mask, level="token", mode="mask", high=2.0, low=0.1)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0, e(-1)]]))
    assert all(math.isfinite(v) for v in m.values())
    w, _ = rollout_correction(old, mu, mask, level="sequence", mode="truncate", high=2.0)  # -20+20-20-1, clamped
    assert torch.isfinite(w).all() and float(w.max()) == pytest.approx(e(-20))
    huge = rollout_correction(torch.full((1, 50), 5.0), torch.zeros(1, 50), torch.ones(1, 50), level="sequence")[0]
    assert torch.isfinite(huge).all() and float(huge.max()) == 2.0


def test_refusals_and_spec():
    with pytest.raises(ValueError, match="valid levels"):
        rollout_correction(OLD, MU, MASK, level="seq")
    with pytest.raises(ValueError, match="truncation caps"):
        rollout_correction(OLD, MU, MASK, mode="truncate", low=0.5)
    with pytest.raises(ValueError, match="needs the advantages"):
        rollout_correction(OLD, MU, MASK, kl_threshold=0.1, negative_only=True)
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 3\) but rollout_logprobs has shape \(3, 2\)"):
        rollout_correction(OLD, MU.T, MASK)
    with pytest.raises(ValueError, match="empty batch"):
        rollout_correction(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3))
    spec = Correction(level="token", mode="mask", high=2.0)
    torch.testing.assert_close(spec(OLD, MU, MASK)[0], rollout_correction(OLD, MU, MASK, mode="mask", high=2.0)[0])


def test_truncated_is_weights_is_the_upper_bound_case():
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask"):
            w, _ = truncated_is_weights(OLD, MU, MASK, level=level, mode=mode, cap=1.5)
            ref, _ = rollout_correction(OLD, MU, MASK, level=level, mode=mode, high=1.5,
                                        low=0.0 if mode == "mask" else None)
            torch.testing.assert_close(w, ref)


def test_two_sided_k1_bounds():
    """verl's k1 forms keep the estimate within [log lower, log upper] (kl_low, kl_threshold). Per-token k1 =
    -l: row 0 (0, -1, -0.2), row 1 (0.5, -0.1); sums -1.2 and 0.4; means -0.4 and 0.2."""
    w, m = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.3, kl_low=-0.5)  # mean: both kept
    assert torch.equal(w, MASK.float())
    w, _ = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.3, kl_low=-0.3)  # mean: row 0 too low
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    w, _ = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=0.3, kl_low=-1.0, kl_reduce="sum")
    torch.testing.assert_close(w, torch.zeros(2, 3))  # sums: row 0 below -1, row 1 above 0.3
    # token_k1 with verl's "0.5_1.2": keep log 0.5 <= k1 <= log 1.2 -> drops (0, 1) (-1) and (1, 0) (0.5)
    w, m = rollout_correction(OLD, MU, MASK, level=None, kl_threshold=math.log(1.2), kl_low=math.log(0.5),
                              kl_reduce="token")
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    assert m["correction/kl_masked_frac"] == pytest.approx(2 / 5)
    assert Correction(level=None, kl_threshold=0.3, kl_low=-0.3)(OLD, MU, MASK)[0][0].sum() == 0
    for bad in (dict(kl_low=-0.1), dict(kl_low=-0.1, kl_threshold=0.1, kl_kind="k3"),
                dict(kl_low=0.2, kl_threshold=0.1)):
        with pytest.raises(ValueError, match="kl_low"):
            rollout_correction(OLD, MU, MASK, level=None, **bad)


def test_the_config_checks_kl_low():
    from pydantic import ValidationError

    from relayrl.config.algorithm import CorrectionConfig

    assert CorrectionConfig(kl_threshold=0.2, kl_low=-0.2).spec().kl_low == -0.2
    for bad, msg in ((dict(kl_low=-0.1), "kl_threshold \\(the upper end\\)"),
                     (dict(kl_low=-0.1, kl_threshold=0.1, kl_kind="k2"), "kl_kind=k1"),
                     (dict(kl_low=0.1, kl_threshold=0.1), "not below kl_threshold")):
        with pytest.raises(ValidationError, match=msg):
            CorrectionConfig(**bad)


def test_each_part_by_hand():
    """The parts rollout_correction is made of (checked bit for bit against the single function they were split
    from in d478deb)."""
    lr = torch.tensor([[0.0, 1.0, 0.2], [-0.5, 0.1, 0.0]])  # row 1's last token is padding
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    valid = m > 0
    torch.testing.assert_close(level_log_weights(lr, m, "sequence"), torch.tensor([[1.2] * 3, [-0.4] * 3]))
    torch.testing.assert_close(level_log_weights(lr, m, "geometric"), torch.tensor([[0.4] * 3, [-0.2] * 3]))
    w, capped = truncate(lr, valid, 2.0)
    torch.testing.assert_close(w[0], torch.tensor([1.0, 2.0, math.exp(0.2)]))
    assert capped.tolist() == [[False, True, False], [False, False, False]]
    w, out = mask_outside(lr, valid, 2.0, None)  # keeps [1/2, 2]: e^1 is above, e^-0.5 = 0.61 inside
    assert out.tolist() == [[False, True, False], [False, False, False]] and w[0, 1] == 0
    stat, largest = kl_statistic(token_kl(lr, "k1"), m, "sum")  # k1 = -l: sums -1.2 and 0.4
    torch.testing.assert_close(stat, torch.tensor([[-1.2], [0.4]]))
    assert float(largest) == pytest.approx(0.4)
    dropped = divergence_mask(stat, valid, 0.3, None, torch.tensor([[1.0] * 3, [1.0, -1.0, -1.0]]))
    assert dropped.tolist() == [[False, False, False], [False, True, False]]  # A < 0 and valid only


def test_the_mismatch_kl_kinds_are_named_apart_from_the_reference_kl_kinds():
    """Two lists of KL estimators with different contents used to share the name KL_KINDS."""
    from relayrl.algorithms import correction, kl

    assert correction.MISMATCH_KL_KINDS == ("k1", "k2", "k3") and "abs" in kl.KL_KINDS
    assert not hasattr(correction, "KL_KINDS")
    with pytest.raises(ValueError, match="valid kinds: k1, k2, k3$"):
        token_kl(OLD, "abs")
