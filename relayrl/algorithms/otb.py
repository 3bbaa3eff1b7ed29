"""Optimal Token Baseline (OTB; Li, Xu et al. 2026, "The Optimal Token Baseline: Variance Reduction for
Long-Horizon LLM-RL", arXiv 2602.07078; verl's
``compute_optimal_token_baseline_advantage``, ``algorithm.adv_estimator=optimal_token_baseline``): a baseline
per prompt group *and* per token position, the variance-minimising one under the "logit-gradient proxy".

For response ``i`` of a group and its response token ``t``:

* ``G_t^(i)``: the reward-to-go, the sum of the row's per-token rewards from ``t`` on (with an outcome reward
  alone, ``R_i`` at every valid token);
* ``w_j = 1 - 2 pi_j + S_j`` with ``pi_j`` the probability of the sampled token ``j`` and
  ``S_j = sum_v p_v^2`` of position ``j``'s distribution: ``||onehot(y_j) - p_j||^2``, the squared norm of the
  log-prob's gradient with respect to the logits, the proxy for that token's gradient energy;
* ``W_t^(i) = sum_{j <= t} w_j`` over the row's valid tokens: the "realized energy" accumulated up to ``t``;
* ``B*_t = sum_i G_t^(i) W_t^(i) / (sum_i W_t^(i) + eps)`` over the group's responses with a valid token
  at ``t``, and ``A_t^(i) = (G_t^(i) - B*_t) mask_t``.

A response whose path so far was nearly deterministic (small ``W``) weighs little in the baseline of its
position; positions past a response's end take no part in the group's sums there. With equal ``W`` the
baseline is the plain group mean of ``G`` (GRPO's centring without the std).

``pi_j`` and ``S_j`` are the trainer's, from its pass before the update (``old_logprobs`` and the same
pass's ``sum_v p_v^2``, both under ``softmax(logits / rollout.temperature)``), as in verl; relayrl's step
plan runs that pass whenever the estimator needs them (its ``token_stats`` flag). Like verl: no
normalisation of the advantages, no discount, ``eps = 1e-8``; positions are counted from each response's
first token (so the longest response's tail, where it is the only one left, gets an advantage of about 0:
verl's default, ``handle_zero_tail=False``). With ``zero_tail=True`` (``algorithm.advantage=otb-tir``, verl's
``tir_optimal_token_baseline``, whose default it is) a group's single longest response gets a baseline of 0 on
the tokens past the group's second-longest: its advantage there is its reward-to-go ``G_t``.

verl's ``tir_optimal_token_baseline`` also squeezes each response to the tokens its loss mask keeps before
counting positions (multi-turn, tool-integrated rollouts, where the environment's tokens sit between the
model's); relayrl does that for every estimator on episodes (:mod:`relayrl.workflows.estimate`), so here the
two differ only in ``zero_tail``.

Departures from verl:

* a group of one response gets advantage 0 (relayrl's convention for every group estimator; verl gives it
  its return ``G_t``);
* ``w_j`` is clamped at 0: it is a squared norm, and rounding of ``pi_j`` and ``S_j`` (bf16 passes) can make
  it slightly negative;

With a rollout correction (``algorithm.correction``; verl's ``rollout_is``), each ``w_j`` is scaled by the
square of the correction's factor for token ``j`` (``rho_j``: the truncated importance weight
``pi_old / mu``, 0 where it masks the token): the baseline that minimises the variance of the *corrected*
gradient ``rho_t A_t grad log pi`` (verl's ``B*_t = sum G_t rho^2 W_t / sum rho^2 W_t``, with the weight
folded into the running sum as verl does).
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim, check_rows
from relayrl.algorithms._ops import group_index

Tensor = torch.Tensor

__all__ = ["optimal_token_baseline", "realized_energy", "sole_tail", "sum_sq_from_logits"]

EPS = 1e-8
"""Added to the group's summed energy (verl's ``epsilon``)."""


def sum_sq_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """``sum_v softmax(logits / temperature)_v^2`` over the last dimension, computed in float32 as
    ``exp(logsumexp(2x) - 2 logsumexp(x))``."""
    x = logits.float() / temperature
    return torch.exp(torch.logsumexp(2.0 * x, dim=-1) - 2.0 * torch.logsumexp(x, dim=-1))


def realized_energy(logprobs: Tensor, sum_sq: Tensor, mask: Tensor, is_weights: Tensor | None = None) -> Tensor:
    """``W_t = sum_{j <= t, valid} rho_j^2 (1 - 2 exp(logprobs_j) + sum_sq_j)``, ``[B, T]`` (each term clamped at
    0; masked positions add nothing and get 0; ``rho = is_weights``, 1 when None)."""
    m = as_float_mask(mask, logprobs.float())
    w = (1.0 - 2.0 * logprobs.detach().float().exp() + sum_sq.detach().float()).clamp(min=0.0)
    if is_weights is not None:
        w = w * is_weights.detach().float().square()
    return (w * m).cumsum(dim=1) * m


def optimal_token_baseline(token_rewards: Tensor, logprobs: Tensor, sum_sq: Tensor, group_ids: Tensor,
                           mask: Tensor, *, eps: float = EPS, zero_tail: bool = False,
                           is_weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """OTB advantages (module docstring).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (the outcome on the last valid token, possibly minus a
            per-token KL penalty).
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy before the update.
        sum_sq: ``[B, T]`` ``sum_v p_v^2`` of each position's distribution under the same policy.
        group_ids: ``[B]`` integer prompt-group id per response.
        mask: ``[B, T]`` 1 on valid response tokens.
        eps: added to the group's summed energy at each position.
        zero_tail: a group's single longest response (no other as long) takes a baseline of 0 at the positions
            from the group's second-longest length on (its advantage there is ``G_t``; :func:`sole_tail`).
        is_weights: ``[B, T]`` the rollout correction's per-token factor ``rho``: each token's energy is scaled
            by ``rho^2`` (module docstring); None: unweighted.

    Returns:
        ``(advantages [B, T], returns [B, T])``: ``A_t = (G_t - B*_t) mask_t`` and the rewards-to-go ``G_t``;
        both 0 at masked positions, advantages 0 for a group of one.
    """
    check_ndim("token_rewards", token_rewards, 2)
    check_batch(token_rewards=token_rewards, logprobs=logprobs, sum_sq=sum_sq, mask=mask,
                **({} if is_weights is None else {"is_weights": is_weights}))
    check_rows("group_ids", group_ids, "mask", mask)
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    with torch.no_grad():
        r = token_rewards.detach().to(torch.promote_types(token_rewards.dtype, torch.float32))
        m = as_float_mask(mask, r)
        returns = (r * m).flip(1).cumsum(1).flip(1) * m  # G_t: the rewards from t on
        energy = realized_energy(logprobs, sum_sq, mask, is_weights).to(r.dtype)
        index, num_groups = group_index(group_ids.to(mask.device))
        num = r.new_zeros(num_groups, r.shape[1]).index_add_(0, index, returns * energy)  # [G, T]
        den = r.new_zeros(num_groups, r.shape[1]).index_add_(0, index, energy)
        adv = (returns - (num / (den + eps))[index]) * m
        if zero_tail:
            adv = torch.where(sole_tail(mask, index, num_groups), returns, adv)
        alone = torch.bincount(index, minlength=num_groups)[index] < 2
        adv = torch.where(alone[:, None], torch.zeros_like(adv), adv)
    return adv, returns


def sole_tail(mask: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """``[B, T]`` bool: the positions of a group's single longest response (``mask``'s row sums; no other row of
    the group as long) from the group's second-longest length on; False elsewhere and in a group of one
    (``index``: dense group index per row, ``num_groups`` groups). Rows are left-aligned (position ``t`` is the
    row's token ``t``)."""
    lengths = mask.to(torch.int64).sum(1)
    longest = lengths.new_zeros(num_groups).scatter_reduce(0, index, lengths, "amax", include_self=False)
    at_max = lengths == longest[index]
    count = torch.bincount(index[at_max], minlength=num_groups)
    runner_up = torch.where(at_max, torch.full_like(lengths, -1), lengths)
    second = lengths.new_full((num_groups,), -1).scatter_reduce(0, index, runner_up, "amax", include_self=True)
    sole = at_max & (count[index] == 1) & (second[index] >= 0)
    cols = torch.arange(mask.shape[1], device=mask.device)
    return sole[:, None] & (cols[None, :] >= second[index][:, None]) & mask.bool()
