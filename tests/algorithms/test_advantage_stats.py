"""The step's ``advantage/*`` metrics by hand, and the same figures however the rows are cut into calls."""

import math

import pytest
import torch

from relayrl.algorithms.advantage_stats import AdvantageSums, advantage_stats


def test_advantage_stats_by_hand():
    # three responses; the second's last token is an environment's (loss_mask 0) and the third has none to train on
    adv = [torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0, 5.0]), torch.tensor([7.0])]
    masks = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.0])]
    m = advantage_stats(adv, masks)
    # valid tokens 1, 1, 0, 0: mean 0.5, unbiased variance (4 * 0.25) / 3
    assert m == pytest.approx({"advantage/mean": 0.5, "advantage/std": math.sqrt(1 / 3), "advantage/max": 1.0,
                               "advantage/min": 0.0, "advantage/zero_frac": 0.5})  # 1 of the 2 responses
    # without masks every token counts: 1, 1, 0, 0, 5, 7
    m = advantage_stats(adv)
    assert m["advantage/mean"] == pytest.approx(14 / 6)
    assert m["advantage/std"] == pytest.approx(torch.tensor([1.0, 1, 0, 0, 5, 7]).std().item())
    assert (m["advantage/max"], m["advantage/min"], m["advantage/zero_frac"]) == (7.0, 0.0, 0.0)
    assert advantage_stats([torch.tensor([3.0])]) == {"advantage/mean": 3.0, "advantage/std": 0.0,
                                                      "advantage/max": 3.0, "advantage/min": 3.0,
                                                      "advantage/zero_frac": 0.0}
    assert advantage_stats([torch.tensor([1.0])], [torch.tensor([0.0])]) == {}


def test_sums_of_calls_are_the_batch_figures():
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(int(n), generator=g) * 3 + 1 for n in torch.randint(1, 20, (12,), generator=g)]
    adv[4] = torch.zeros_like(adv[4])
    whole = advantage_stats(adv)
    parts = AdvantageSums.of(adv[:5]) + AdvantageSums() + AdvantageSums.of(adv[5:9]) + AdvantageSums.of(adv[9:])
    assert parts.metrics() == pytest.approx(whole, rel=1e-12)
    flat = torch.cat(adv).double()
    assert whole["advantage/std"] == pytest.approx(flat.std().item(), rel=1e-12)
    assert whole["advantage/zero_frac"] == 1 / 12
