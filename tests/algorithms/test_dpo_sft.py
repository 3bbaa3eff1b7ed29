"""DPO variants and the SFT loss."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.dpo import dpo_loss
from relayrl.algorithms.losses import AGG_MODES
from relayrl.algorithms.names import GROUP_AGG_MODES
from relayrl.algorithms.sft import sft_loss

C, R = torch.tensor([-1.0]), torch.tensor([-2.0])
RC, RR = torch.tensor([-1.5]), torch.tensor([-1.5])  # h = 0.5 - (-0.5) = 1


@pytest.mark.parametrize(
    "kind,smoothing,expected",
    [
        ("sigmoid", 0.0, math.log1p(math.exp(-0.1))),
        ("sigmoid", 0.1, 0.9 * math.log1p(math.exp(-0.1)) + 0.1 * math.log1p(math.exp(0.1))),
        ("ipo", 0.0, (1.0 - 5.0) ** 2),
        ("hinge", 0.0, 0.9),
    ],
)
def test_hand_computed(kind, smoothing, expected):
    loss, metrics = dpo_loss(C, R, RC, RR, beta=0.1, kind=kind, label_smoothing=smoothing)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["dpo/reward_accuracy"] == 1.0
    assert metrics["dpo/reward_margin"] == pytest.approx(0.1)
    assert metrics["dpo/rewards_chosen"] == pytest.approx(0.05)
    assert metrics["dpo/rewards_rejected"] == pytest.approx(-0.05)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "hinge"])
def test_dpo_gradcheck(kind):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(4)]
    c, r = xs[0].requires_grad_(), xs[1].requires_grad_()
    f = lambda c, r: dpo_loss(c, r, xs[2], xs[3], beta=0.3, kind=kind)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (c, r))


def test_dpo_errors():
    with pytest.raises(ValueError, match="only defined for kind='sigmoid'"):
        dpo_loss(C, R, RC, RR, beta=0.1, kind="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="valid kinds"):
        dpo_loss(C, R, RC, RR, beta=0.1, kind="kto")
    with pytest.raises(ValueError, match=r"chosen_logps has shape \(1,\) but rejected_logps has shape \(2,\)"):
        dpo_loss(C, torch.zeros(2), RC, RR, beta=0.1)
    with pytest.raises(ValueError, match="empty batch"):
        dpo_loss(*(torch.zeros(0) for _ in range(4)), beta=0.1)


def test_sft_loss_hand_computed_and_modes():
    lp = torch.tensor([[-1.0, -3.0, -9.0], [-2.0, -9.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = sft_loss(lp, mask)
    assert loss.item() == pytest.approx(2.0)
    assert metrics["sft/tokens"] == 3.0
    assert metrics["sft/ppl"] == pytest.approx(math.exp(2.0), rel=1e-6)
    seq, _ = sft_loss(lp, mask, agg="seq-mean-token-mean")
    assert seq.item() == pytest.approx((2.0 + 2.0) / 2)
    for mode in AGG_MODES:
        if mode in GROUP_AGG_MODES:  # SFT rows have no prompt groups to weigh
            with pytest.raises(ValueError, match="group_tokens"):
                sft_loss(lp, mask, agg=mode)
            continue
        assert torch.isfinite(sft_loss(lp, mask, agg=mode)[0])
    loss.backward()
    torch.testing.assert_close(lp.grad, -mask.float() / 3)
