"""Every term of the policy loss that reads ``algorithm.loss_agg`` (the policy loss, the KL term, the entropy
bonus) aggregates prompt-level with the prompt-level mode, checked against the formula written out."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.aggregation import count_groups, group_token_counts
from relayrl.algorithms.kl import kl_estimate
from relayrl.engines.training.base import GROUP_TOKENS_FIELD, MicroBatch
from relayrl.workflows.losses import PolicyLoss

GROUPS = [0, 1, 0, 2, 1, 2]


def _prompt_mean(values, mask, groups):
    """1/|G| sum_g (sum over the group's valid tokens) / (the group's valid tokens), groups with tokens only."""
    out = []
    for g in sorted(set(groups)):
        rows = [i for i, x in enumerate(groups) if x == g]
        tokens = float(mask[rows].sum())
        if tokens:
            out.append(float((values[rows] * mask[rows]).sum()) / tokens)
    return sum(out) / len(out)


def _micro_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(GROUPS), 5
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B,), generator=g).unsqueeze(1)).float()
    mask[3] = 0  # one response of group 2 masked out entirely
    lp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    fields = {"advantages": torch.randn(B, T, generator=g), "ref_logprobs": -torch.rand(B, T, generator=g) * 3}
    group_tokens = group_token_counts(mask.sum(dim=1), GROUPS)
    fields[GROUP_TOKENS_FIELD] = group_tokens.float()
    entropy = torch.rand(B, T, generator=g)
    mb = MicroBatch(lp, mask, fields, int(mask.sum()), B, entropy, count_groups(mask, group_tokens))
    return mb


def test_policy_kl_and_entropy_terms_are_prompt_level():
    mb = _micro_batch()
    loss, m = PolicyLoss(agg="prompt-mean-token-mean", kl_coef=0.1, entropy_coef=0.01)(mb)
    a, lp, ref = mb.fields["advantages"], mb.logprobs.detach(), mb.fields["ref_logprobs"]
    pg = _prompt_mean(-a, mb.mask, GROUPS)  # on-policy: the ratio is 1, each token's loss -A
    kl = _prompt_mean(kl_estimate(lp, ref, "k3"), mb.mask, GROUPS)
    ent = _prompt_mean(mb.entropy, mb.mask, GROUPS)
    assert m["actor/pg_loss"] == pytest.approx(pg, rel=1e-5)
    assert m["actor/kl_loss"] == pytest.approx(kl, rel=1e-5)
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * ent, rel=1e-5)
    # the token mean weighs the groups otherwise: the mode is not a renamed token-mean
    token, _ = PolicyLoss(agg="token-mean")(mb)
    assert token.item() != pytest.approx(pg, rel=1e-3)


def test_without_the_group_field_the_loss_says_what_it_needs():
    mb = _micro_batch()
    del mb.fields[GROUP_TOKENS_FIELD]
    with pytest.raises(ValueError, match="pass group_tokens"):
        PolicyLoss(agg="prompt-mean-token-mean")(mb)
