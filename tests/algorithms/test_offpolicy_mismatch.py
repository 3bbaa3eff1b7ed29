"""Truncated importance weights and the train/generation logprob error."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.mismatch import logprob_error, logprob_error_per_seq
from relayrl.algorithms.offpolicy import truncated_is_weights

TRAIN = torch.tensor([[0.0, 1.0, 0.2], [-0.5, 0.1, 0.0]])
ROLL = torch.zeros(2, 3)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_level_truncate_and_mask():
    w, metrics = truncated_is_weights(TRAIN, ROLL, MASK, level="token", mode="truncate", cap=2.0)
    e = math.exp
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, e(0.2)], [e(-0.5), e(0.1), 0.0]]))
    assert metrics["offpolicy/capped_frac"] == pytest.approx(1 / 5)
    assert metrics["offpolicy/is_weight_max"] == pytest.approx(e(1.0), rel=1e-6)
    wm, _ = truncated_is_weights(TRAIN, ROLL, MASK, level="token", mode="mask", cap=2.0)
    torch.testing.assert_close(wm, torch.tensor([[1.0, 0.0, e(0.2)], [e(-0.5), e(0.1), 0.0]]))


def test_sequence_and_geometric_levels():
    e = math.exp
    w, _ = truncated_is_weights(TRAIN, ROLL, MASK, level="sequence", mode="truncate", cap=2.0)
    # row 0: exp(1.2) = 3.32 -> 2; row 1: exp(-0.4)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 2.0], [e(-0.4), e(-0.4), 0.0]]))
    wm, metrics = truncated_is_weights(TRAIN, ROLL, MASK, level="sequence", mode="mask", cap=2.0)
    torch.testing.assert_close(wm, torch.tensor([[0.0, 0.0, 0.0], [e(-0.4), e(-0.4), 0.0]]))
    assert metrics["offpolicy/capped_frac"] == pytest.approx(3 / 5)
    wg, _ = truncated_is_weights(TRAIN, ROLL, MASK, level="geometric", cap=2.0)
    torch.testing.assert_close(wg, torch.tensor([[e(0.4)] * 3, [e(-0.2), e(-0.2), 0.0]]))


def test_huge_sequence_ratio_does_not_overflow_and_errors():
    w, metrics = truncated_is_weights(torch.full((1, 50), 5.0), torch.zeros(1, 50), torch.ones(1, 50), level="sequence")
    assert torch.isfinite(w).all() and w.max() == 2.0
    assert all(math.isfinite(v) for v in metrics.values())
    with pytest.raises(ValueError, match="valid modes"):
        truncated_is_weights(TRAIN, ROLL, MASK, mode="clip")
    with pytest.raises(ValueError, match=r"train_logprobs has shape \(2, 3\) but rollout_logprobs has shape \(3, 2\)"):
        truncated_is_weights(TRAIN, ROLL.T, MASK)


def test_logprob_error():
    gen = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, float("nan")]])
    train = torch.tensor([[-1.1, -2.0, -2.5], [-1.0, -1.2, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    e = math.exp
    metrics = logprob_error(gen, train, mask)
    assert metrics["rollout/logprob_error"] == pytest.approx((e(0.1) + 1 + e(0.5) + 1 + e(0.2)) / 5, rel=1e-6)
    assert metrics["rollout/logprob_error_max"] == pytest.approx(e(0.5), rel=1e-6)
    per_seq = logprob_error_per_seq(gen, train, mask)
    torch.testing.assert_close(per_seq, torch.tensor([(e(0.1) + 1 + e(0.5)) / 3, (1 + e(0.2)) / 2]))
    assert metrics["rollout/logprob_error_seq_max"] == pytest.approx(per_seq.max().item())
    empty_row = logprob_error_per_seq(gen, train, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    assert empty_row[1].item() == 1.0
    with pytest.raises(ValueError, match="empty batch"):
        logprob_error(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3))


def test_the_truncated_weights_take_the_corrections_levels_and_modes():
    """truncated_is_weights is rollout_correction's upper-bound case: one list of levels and modes, the
    correction's, not a copy that could drift from what that function accepts."""
    from relayrl.algorithms import correction, offpolicy

    assert offpolicy.IS_LEVELS is correction.WEIGHT_LEVELS and offpolicy.IS_MODES is correction.MODES
    lp = torch.zeros(1, 3)
    for level in offpolicy.IS_LEVELS:
        for mode in offpolicy.IS_MODES:
            w, _ = truncated_is_weights(lp, lp, torch.ones(1, 3), level=level, mode=mode)
            torch.testing.assert_close(w, torch.ones(1, 3))
