"""On-policy distillation advantages (relayrl.algorithms.distill) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.distill import distill_advantages

STUDENT = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -9.0]])
TEACHER = torch.tensor([[-0.5, -0.5, -3.0], [-0.1, -0.5, -1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_negative_reverse_kl_per_token():
    adv, m = distill_advantages(STUDENT, TEACHER, MASK)
    # -(s - t): the teacher likes token (0, 0) more (+0.5), token (0, 2) less (-1.0); padding 0
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, -1.0], [0.1, 1.0, 0.0]]))
    assert m["distill/reverse_kl"] == pytest.approx((-0.5 + 0 + 1 - 0.1 - 1) / 5, abs=1e-6)
    assert m["distill/reverse_kl_seq_max"] == pytest.approx(0.5 / 3, abs=1e-6)
    assert m["distill/teacher_logprob_mean"] == pytest.approx((-0.5 - 0.5 - 3 - 0.1 - 0.5) / 5, abs=1e-6)


def test_coef_and_reward_mixing():
    reward_adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    adv, _ = distill_advantages(STUDENT, TEACHER, MASK, reward_adv, coef=2.0, reward_weight=0.5)
    torch.testing.assert_close(adv, torch.tensor([[1.5, 0.5, -1.5], [-0.3, 1.5, 0.0]]))
    with pytest.raises(ValueError, match="needs reward_advantages"):
        distill_advantages(STUDENT, TEACHER, MASK, reward_weight=1.0)
    with pytest.raises(ValueError, match="coef"):
        distill_advantages(STUDENT, TEACHER, MASK, coef=0.0)


def test_edges():
    inf = float("inf")
    adv, m = distill_advantages(torch.tensor([[-1.0, -inf, -inf]]), torch.tensor([[-inf, -1.0, -inf]]),
                                torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.tensor([[-20.0, 20.0, 0.0]]))  # clamped; nan (both -inf) -> 0
    assert all(math.isfinite(v) for v in m.values())
    adv, m = distill_advantages(STUDENT, TEACHER, torch.zeros(2, 3))
    assert torch.equal(adv, torch.zeros(2, 3)) and all(math.isfinite(v) for v in m.values())
    with pytest.raises(ValueError, match="empty batch"):
        distill_advantages(torch.zeros(0, 2), torch.zeros(0, 2), torch.zeros(0, 2))
