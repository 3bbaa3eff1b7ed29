"""Loss aggregation: hand values and micro-batch / data-parallel exactness (Periodic Asynchrony §3)."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.losses import AGG_MODES, aggregate, count_tokens_and_seqs

VALUES = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 0.0, 0.0, 0.0], [5.0, 7.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 22.0 / 6.0),  # (1+2+3+4+5+7) / 6 tokens
        ("seq-mean-token-mean", (2.0 + 4.0 + 6.0) / 3.0),
        ("seq-mean-token-sum", (6.0 + 4.0 + 12.0) / 3.0),
        ("seq-mean-token-sum-norm", 22.0 / (3.0 * 4.0)),  # constant defaults to T = 4
    ],
)
def test_hand_computed(mode, expected):
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_masked_values_never_leak_even_if_nan():
    v = VALUES.clone()
    v[0, 3] = float("nan")
    v[1, 1] = float("inf")
    for mode in AGG_MODES:
        assert torch.isfinite(aggregate(v, MASK, mode))


def test_fully_masked_rows_and_batch():
    mask = MASK.clone()
    mask[1] = 0
    # row 1 no longer counts as a sequence
    assert aggregate(VALUES, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 6.0) / 2.0)
    zero_mask = torch.zeros_like(MASK)
    for mode in AGG_MODES:
        assert aggregate(VALUES, zero_mask, mode).item() == 0.0


def _split(values, mask, bounds, trim):
    """Row ranges [a, b); optionally trim each part's padding columns (like per-micro-batch padding)."""
    parts = []
    for a, b in bounds:
        v, m = values[a:b], mask[a:b]
        if trim:
            width = int(m.sum(dim=1).max().clamp(min=1).item())
            v, m = v[:, :width], m[:, :width]
        parts.append((v, m))
    return parts


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("trim", [False, True])
def test_micro_batches_with_global_counts_sum_to_full_batch(mode, trim):
    g = torch.Generator().manual_seed(0)
    B, T = 12, 9
    values = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    mask[3] = 0  # a fully masked row in some micro-batch
    tokens, seqs = count_tokens_and_seqs(mask)
    kw = dict(global_tokens=tokens, global_seqs=seqs, constant=float(T))
    full = aggregate(values, mask, mode, constant=float(T))
    (full_grad,) = torch.autograd.grad(full, values)

    # Micro-batches of unequal sizes, as 2 data-parallel ranks x 2-3 micro-batches each.
    bounds = [(0, 1), (1, 4), (4, 6), (6, 11), (11, 12)]
    total = sum(aggregate(v, m, mode, **kw) for v, m in _split(values, mask, bounds, trim))
    (micro_grad,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(micro_grad, full_grad)


def test_local_normalisation_is_not_exact_for_token_mean():
    """Why global counts matter: averaging per-micro-batch token means differs."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    full = aggregate(values, mask, "token-mean")
    local = (aggregate(values[:1], mask[:1], "token-mean") + aggregate(values[1:], mask[1:], "token-mean")) / 2
    assert full.item() == pytest.approx(9.0 / 5.0)
    assert local.item() == pytest.approx(3.0)


def test_errors():
    with pytest.raises(ValueError, match="valid modes: token-mean"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match=r"values has shape \(3, 4\) but mask has shape \(3, 3\)"):
        aggregate(VALUES, MASK[:, :3], "token-mean")
    with pytest.raises(ValueError, match="empty batch"):
        aggregate(torch.zeros(0, 4), torch.zeros(0, 4), "token-mean")
    with pytest.raises(ValueError, match="constant"):
        aggregate(VALUES, MASK, "seq-mean-token-sum-norm", constant=0.0)
    assert count_tokens_and_seqs(MASK) == (6, 3)
