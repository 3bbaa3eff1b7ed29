"""Loss aggregation: hand values and micro-batch / data-parallel exactness (Periodic Asynchrony §3)."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.aggregation import count_groups, group_token_counts, normalized_by
from relayrl.algorithms.losses import AGG_MODES, aggregate, count_tokens_and_seqs

VALUES = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 0.0, 0.0, 0.0], [5.0, 7.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
GROUPS = [0, 0, 1]  # rows 0 and 1 answer one prompt, row 2 another
GROUP_TOKENS = group_token_counts(MASK.sum(dim=1), GROUPS)  # [4, 4, 2]


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 22.0 / 6.0),  # (1+2+3+4+5+7) / 6 tokens
        ("seq-mean-token-mean", (2.0 + 4.0 + 6.0) / 3.0),
        ("seq-mean-token-sum", (6.0 + 4.0 + 12.0) / 3.0),
        ("seq-mean-token-sum-norm", 22.0 / (3.0 * 4.0)),  # constant defaults to T = 4
        ("prompt-mean-token-mean", ((1 + 2 + 3 + 4) / 4.0 + (5 + 7) / 2.0) / 2.0),  # per prompt, then over 2
    ],
)
def test_hand_computed(mode, expected):
    assert aggregate(VALUES, MASK, mode, group_tokens=GROUP_TOKENS).item() == pytest.approx(expected)


def test_masked_values_never_leak_even_if_nan():
    v = VALUES.clone()
    v[0, 3] = float("nan")
    v[1, 1] = float("inf")
    for mode in AGG_MODES:
        assert torch.isfinite(aggregate(v, MASK, mode, group_tokens=GROUP_TOKENS))


def test_fully_masked_rows_and_batch():
    mask = MASK.clone()
    mask[1] = 0
    # row 1 no longer counts as a sequence
    assert aggregate(VALUES, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 6.0) / 2.0)
    zero_mask = torch.zeros_like(MASK)
    for mode in AGG_MODES:
        assert aggregate(VALUES, zero_mask, mode, group_tokens=group_token_counts([0, 0, 0], GROUPS)).item() == 0.0


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
    groups = [0, 1, 0, 2, 1, 3, 2, 0, 3, 1, 2, 3]  # every group's rows fall into several micro-batches
    group_tokens = group_token_counts(mask.sum(dim=1), groups)
    tokens, seqs = count_tokens_and_seqs(mask)
    kw = dict(global_tokens=tokens, global_seqs=seqs, constant=float(T), global_groups=count_groups(mask, group_tokens))
    full = aggregate(values, mask, mode, constant=float(T), group_tokens=group_tokens)
    (full_grad,) = torch.autograd.grad(full, values)

    # Micro-batches of unequal sizes, as 2 data-parallel ranks x 2-3 micro-batches each.
    bounds = [(0, 1), (1, 4), (4, 6), (6, 11), (11, 12)]
    total = sum(aggregate(v, m, mode, group_tokens=group_tokens[a:b], **kw)
                for (v, m), (a, b) in zip(_split(values, mask, bounds, trim), bounds))
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


def _prompt_level_reference(values, mask, groups):
    """ScaleRL's prompt-level average written out: for each prompt with a valid token, the sum of its token
    losses over its token count; the mean of those over such prompts (0 when there is none)."""
    per_prompt = []
    for g in sorted(set(groups)):
        rows = [i for i, x in enumerate(groups) if x == g]
        tokens = sum(float(mask[i, t]) for i in rows for t in range(mask.shape[1]))
        if tokens > 0:
            per_prompt.append(sum(values[i, t] * mask[i, t] for i in rows for t in range(mask.shape[1])) / tokens)
    return sum(per_prompt) / len(per_prompt) if per_prompt else values.sum() * 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prompt_level_matches_the_formula_over_any_micro_batches(seed):
    """Groups of 4 rows shuffled over the batch, a group whose every token is masked (it does not count),
    a fully masked row inside a counted group, cut at random boundaries (groups split across parts): the
    parts add up to the formula, in value and gradient."""
    g = torch.Generator().manual_seed(seed)
    B, T, n = 16, 7, 4
    groups = [int(x) for x in torch.randperm(B, generator=g) // n]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    mask[[i for i, x in enumerate(groups) if x == 2]] = 0  # group 2: every response cut (overlong filter)
    mask[groups.index(0)] = 0  # one response of group 0 masked out, the rest of the group counts
    values = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    group_tokens = group_token_counts(mask.sum(dim=1), groups)
    assert count_groups(mask, group_tokens) == pytest.approx(3.0)  # 4 groups, one with no valid token

    expected = _prompt_level_reference(values, mask, groups)
    (ref_grad,) = torch.autograd.grad(expected, values)
    full = aggregate(values, mask, "prompt-mean-token-mean", group_tokens=group_tokens)
    torch.testing.assert_close(full, expected)

    cuts = sorted(torch.randperm(B - 1, generator=g)[:4].add(1).tolist())
    bounds = list(zip([0, *cuts], [*cuts, B]))
    global_groups = sum(count_groups(mask[a:b], group_tokens[a:b]) for a, b in bounds)
    assert global_groups == pytest.approx(3.0)
    total = sum(aggregate(values[a:b], mask[a:b], "prompt-mean-token-mean", group_tokens=group_tokens[a:b],
                          global_groups=global_groups) for a, b in bounds)
    (grad,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(grad, ref_grad)
    # each group's tokens share one weight, 1 / (its tokens x the groups): a token of a long group weighs less
    row = groups.index(1)
    if mask[row].any():
        assert grad[row, 0].item() == pytest.approx(1.0 / (float(group_tokens[row]) * 3.0))


def test_prompt_level_differs_from_token_and_sequence_means():
    """A long and a short prompt group: the token mean favours the long group's tokens, the sequence mean
    each response; the prompt mean gives each prompt half."""
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
    group_tokens = group_token_counts(mask.sum(dim=1), [0, 0, 1])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(13.0 / 9.0)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(7.0 / 3.0)
    assert aggregate(values, mask, "prompt-mean-token-mean", group_tokens=group_tokens).item() == pytest.approx(3.0)


def test_part_of_a_group_counts_its_share():
    """A mini-batch holding one of a group's two equal rows counts half a group, so its loss is that row's
    token mean, the formula applied to the mini-batch (each token weighs as in the full batch)."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    group_tokens = group_token_counts(mask.sum(dim=1), [0, 0, 1])
    assert count_groups(mask[:1], group_tokens[:1]) == pytest.approx(0.5)
    values = torch.tensor([[2.0, 4.0, 0.0]])
    part = aggregate(values, mask[:1], "prompt-mean-token-mean", group_tokens=group_tokens[:1],
                     global_groups=count_groups(mask[:1], group_tokens[:1]))
    assert part.item() == pytest.approx(3.0)


def test_prompt_level_errors_and_normaliser():
    assert normalized_by("prompt-mean-token-mean") == "groups"
    assert normalized_by("seq-mean-token-sum") == "seqs" and normalized_by("token-mean") == "tokens"
    with pytest.raises(ValueError, match="pass group_tokens"):
        aggregate(VALUES, MASK, "prompt-mean-token-mean")
    with pytest.raises(ValueError, match="group_tokens has 2 rows but values has 3"):
        aggregate(VALUES, MASK, "prompt-mean-token-mean", group_tokens=GROUP_TOKENS[:2])
    with pytest.raises(ValueError, match="global_groups must be >= 0"):
        aggregate(VALUES, MASK, "prompt-mean-token-mean", group_tokens=GROUP_TOKENS, global_groups=-1.0)
    with pytest.raises(ValueError, match="tokens has 3 rows but groups has 2"):
        group_token_counts([1, 2, 3], [0, 0])
    with pytest.raises(ValueError, match="row 1 has -1"):
        group_token_counts([1, -1], [0, 0])
