"""Advantage formulas for RL post-training: pure tensor functions. :mod:`relayrl.algorithms.estimators`
binds each to a config name and declares what it needs.

Implemented (config name -> paper):

* ``"gae"`` -- Generalised Advantage Estimation (Schulman et al. 2016; PPO for
  RLHF as in Ouyang et al. 2022; DAPO eqs. 2-3).
* ``"grpo"`` -- group-normalised outcome advantage (Shao et al. 2024,
  DeepSeekMath; DAPO eq. 4). ``"drgrpo"`` is the same without the std
  division (Liu et al. 2025, Dr.GRPO).
* ``"rloo"`` -- REINFORCE leave-one-out baseline (Ahmadian et al. 2024).
* ``"grpo-loo"`` -- the leave-one-out baseline divided by the other responses' std (NeMo-RL's default GRPO).
* ``"reinforce++"`` -- discounted token returns of the (KL-penalised) token
  rewards, whitened over the batch (Hu 2025, REINFORCE++).
* ``"reinforce++-baseline"`` -- group-mean-subtracted outcome reward, whitened
  over the batch (REINFORCE++ paper, baseline variant).
* ``"remax"`` -- reward minus the reward of the greedy rollout of the same
  prompt (Li et al. 2024, ReMax).

Groups are identified by a ``group_ids [N]`` tensor (any integer ids, in any
order); groups may have different sizes. ``N`` is the number of responses,
``[B, T]`` the response-token layout with ``B == N``.

Departures from the papers:

* GAE and the discounted returns skip masked positions (a masked token neither
  takes part nor cuts the recursion), so responses with holes (tool outputs in
  multi-turn rollouts) still propagate credit; for right-padded masks this is
  the usual recursion.
* A group of one response gets advantage 0 (no baseline information), never
  NaN; all-equal rewards give 0. The GRPO std is the unbiased (Bessel) std
  over the group, and ``eps`` is added to it, not to the variance.
* ``"reinforce++-baseline"`` uses the outcome rewards only; its KL term is
  expected as a loss term (as in the paper), not in ``token_rewards``.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import (
    as_float_mask,
    check_batch,
    check_ndim,
    check_nonempty,
    check_rows,
    check_same_shape,
)
from relayrl.algorithms._ops import (
    group_index,
    group_mean_std,
    group_min_max,
    group_sum_count,
    masked_discounted_returns,
    masked_next_values,
    masked_whiten,
)

Tensor = torch.Tensor


def _grouped(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, int]:
    """What every group estimator starts from: the checked rewards detached in at least float32, each row's
    group index and the number of groups (:func:`group_index`)."""
    check_nonempty("rewards", rewards)
    check_ndim("rewards", rewards, 1)
    check_same_shape(rewards=rewards, group_ids=group_ids)
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    index, num_groups = group_index(group_ids)
    return rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32)), index, num_groups


def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the valid response tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * A_{t+1}`` where ``t+1`` is the next *valid*
    token of the row and ``V`` after the last valid token is 0.

    Args:
        token_rewards: ``[B, T]`` per-token rewards (outcome at the last token,
            optionally minus a per-token KL penalty).
        values: ``[B, T]`` critic values ``V(s_t)`` (detached by the caller or not;
            the result is computed under ``no_grad``).
        mask: ``[B, T]`` 1 on valid response tokens.
        gamma: discount in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.
        whiten: whiten the advantages over the valid tokens of the batch.

    Returns:
        ``(advantages [B, T], returns [B, T])`` with ``returns = A + V``; both 0
        at masked positions.
    """
    check_ndim("token_rewards", token_rewards, 2)
    check_batch(token_rewards=token_rewards, values=values, mask=mask)
    _check_discount("gamma", gamma)
    _check_discount("lam", lam)
    with torch.no_grad():
        m = as_float_mask(mask, values)
        v = values.detach().to(token_rewards.dtype) * m
        r = token_rewards.detach() * m
        delta = (r + gamma * masked_next_values(v, mask) - v) * m
        adv = masked_discounted_returns(delta, mask, gamma * lam)
        returns = (adv + v) * m
        if whiten:
            adv = masked_whiten(adv, m)
    return adv, returns


def grpo(
    rewards: Tensor, group_ids: Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO outcome advantage ``(r_i - mean_g) / (std_g + eps)`` (DAPO eq. 4).

    Args:
        rewards: ``[N]`` scalar reward per response.
        group_ids: ``[N]`` integer id of each response's prompt group.
        normalize_std: divide by the group std; ``False`` is Dr.GRPO.
        eps: added to the std.

    Returns:
        ``[N]`` advantages (0 for a group of one or with all-equal rewards).
    """
    x, index, num_groups = _grouped(rewards, group_ids)
    with torch.no_grad():
        mean, std, _ = group_mean_std(x, index, num_groups)
        adv = x - mean
        if normalize_std:
            adv = adv / (std + eps)
    return adv


def grpo_batch_std(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """The group-mean baseline scaled by the whole batch's reward std, ``(r_i - mean_g) / (std_batch + eps)``:
    "group-level mean, batch-level std" (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning", Lite PPO; TRL's ``scale_rewards="batch"``). A group whose rewards are all equal still gets 0,
    but one with a small spread is not blown up by its own small std.

    Args:
        rewards: ``[N]`` scalar reward per response.
        group_ids: ``[N]`` integer id of each response's prompt group.
        eps: added to the std.

    Returns:
        ``[N]`` advantages; the std is the unbiased std of all ``N`` rewards (0 for one reward).
    """
    x, index, num_groups = _grouped(rewards, group_ids)
    with torch.no_grad():
        mean, _, _ = group_mean_std(x, index, num_groups)
        std = x.std() if x.numel() > 1 else x.new_zeros(())
        return (x - mean) / (std + eps)


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantage ``r_i - mean_{j != i} r_j`` within each group.

    Args:
        rewards: ``[N]``; group_ids: ``[N]``.

    Returns:
        ``[N]`` advantages; 0 for a group of one.
    """
    x, index, num_groups = _grouped(rewards, group_ids)
    with torch.no_grad():
        mean, _, n = group_mean_std(x, index, num_groups)  # (exact for a group of equal rewards: 0, not 6e-8)
        adv = torch.where(n > 1, (x - mean) * n / (n - 1.0).clamp(min=1.0), torch.zeros_like(x))
    return adv


def grpo_loo(rewards: Tensor, group_ids: Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """NeMo-RL's GRPO advantage (its defaults ``use_leave_one_out_baseline: true``, ``normalize_rewards: true``):
    ``(r_i - mean_{j != i} r_j) / (std_{j != i} r_j + eps)``, baseline and std both over the group's *other*
    responses (the std unbiased over them); where the others are all equal (std 0) the difference is left
    undivided, as NeMo-RL leaves it. ``normalize_std=False`` is RLOO's advantage (:func:`rloo`).

    Departs from :func:`grpo` on purpose: a group's lone correct answer among n-1 wrong ones gets
    ``1``, undivided (its others have std 0), where GRPO gives it ``(1 - 1/n) / std``.

    Args:
        rewards: ``[N]`` scalar reward per response.
        group_ids: ``[N]`` integer id of each response's prompt group.
        normalize_std: divide by the others' std; ``False``: RLOO.
        eps: added to a non-zero std.

    Returns:
        ``[N]`` advantages (0 for a group of one or with all-equal rewards).
    """
    x, index, num_groups = _grouped(rewards, group_ids)
    with torch.no_grad():
        mean, _, n = group_mean_std(x, index, num_groups)
        others = (n - 1.0).clamp(min=1.0)
        d = x - mean
        adv = torch.where(n > 1, d * n / others, torch.zeros_like(x))  # r_i - mean of the others
        if not normalize_std:
            return adv
        sq, _ = group_sum_count(d * d, index, num_groups)
        spread = (sq[index] - d * d) - d * d / others  # the others' squared deviations from their own mean
        std = (spread.clamp(min=0.0) / (others - 1.0).clamp(min=1.0)).sqrt()
        std = torch.where(_others_equal(x, index, num_groups, n), torch.zeros_like(std), std)
        return torch.where(std > 0, adv / (std + eps), adv)


def _others_equal(x: Tensor, index: Tensor, num_groups: int, n: Tensor) -> Tensor:
    """``[N]`` whether the other members of each member's group are all equal: exactly, where the std above
    would leave a rounding residue (the whole group equal, or it the one member apart from the rest)."""
    inf = torch.full((num_groups,), float("inf"), dtype=x.dtype, device=x.device)
    lo = inf.scatter_reduce(0, index, x, "amin")[index]
    hi = (-inf).scatter_reduce(0, index, x, "amax")[index]
    n_lo, _ = group_sum_count((x == lo).to(x.dtype), index, num_groups)
    n_hi, _ = group_sum_count((x == hi).to(x.dtype), index, num_groups)
    n_lo, n_hi = n_lo[index], n_hi[index]
    alone_low = (x == lo) & (n_lo == 1) & (n_hi == n - 1)
    alone_high = (x == hi) & (n_hi == 1) & (n_lo == n - 1)
    return (n <= 2) | (lo == hi) | alone_low | alone_high


def opo(rewards: Tensor, group_ids: Tensor, lengths: Tensor) -> Tensor:
    """OPO's optimal baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): ``r_i - b_g`` with
    ``b_g = sum_j |y_j| r_j / sum_j |y_j|`` the length-weighted mean reward of the group (the variance-minimising
    baseline when the gradient's norm grows with the response length); no std division.

    Args:
        rewards: ``[N]`` scalar reward per response.
        group_ids: ``[N]`` integer id of each response's prompt group.
        lengths: ``[N]`` response lengths in tokens.

    Returns:
        ``[N]`` advantages (0 for a group of one, whose baseline is its own reward, and for equal rewards).
    """
    x, index, num_groups = _grouped(rewards, group_ids)
    check_batch(rewards=rewards, lengths=lengths)
    with torch.no_grad():
        w = lengths.detach().to(x.dtype).clamp(min=1.0)
        weighted, _ = group_sum_count(w * x, index, num_groups)
        total, _ = group_sum_count(w, index, num_groups)
        lo, hi = group_min_max(x, index, num_groups)  # equal rewards: the baseline is exactly their value
        return x - torch.where((lo == hi)[index], x, (weighted / total)[index])


def grpo_passk(rewards: Tensor, group_ids: Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Pass@k advantage (Walder and Karkhanis 2025, "Pass@K Policy Optimization", arXiv 2503.19595, in verl's
    form): only each group's best response gets an advantage, ``r_max - r_second`` (divided by the group's
    std with ``normalize_std``); every other response gets 0, so the update pushes up the best of k samples,
    not the average one. A tie for the best gives 0.

    Args:
        rewards: ``[N]`` scalar reward per response.
        group_ids: ``[N]`` integer id of each response's prompt group (at least 2 responses each).
        normalize_std, eps: as for :func:`grpo`.

    Returns:
        ``[N]`` advantages, nonzero on at most one response per group (the first of the best).
    """
    x, index, num_groups = _grouped(rewards, group_ids)
    with torch.no_grad():
        _, std, size = group_mean_std(x, index, num_groups)
        if bool((size < 2).any()):
            raise ValueError("grpo_passk needs at least 2 responses per group (the best against the second best)")
        order = torch.argsort(-x, stable=True)  # best first, then grouped (stable: the best stay first)
        order = order[torch.argsort(index[order], stable=True)]
        first = torch.ones_like(index, dtype=torch.bool)
        first[1:] = index[order][1:] != index[order][:-1]
        best, second = order[first], order[first.roll(1)]  # the element after each group's first is its second
        adv = torch.zeros_like(x)
        gap = x[best] - x[second]
        adv[best] = gap / (std[best] + eps) if normalize_std else gap
    return adv


def outcome_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each ``rewards [N]`` on the last valid token of ``mask [N, T]``."""
    check_nonempty("rewards", rewards)
    check_rows("rewards", rewards, "mask", mask)
    valid = mask.bool()
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device).expand_as(valid)
    last = torch.where(valid, pos, torch.full_like(pos, -1)).amax(dim=1)
    out = torch.zeros(mask.shape, dtype=torch.promote_types(rewards.dtype, torch.float32), device=mask.device)
    has = last >= 0
    out[has, last[has]] = rewards[has].to(out.dtype)
    return out


def reinforce_pp(
    token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, eps: float = 1e-8
) -> Tensor:
    """REINFORCE++: discounted token returns, whitened over the batch's valid tokens.

    Args:
        token_rewards: ``[B, T]`` rewards with the KL penalty already folded in
            (see :func:`relayrl.algorithms.kl.kl_penalty_rewards`).
        mask: ``[B, T]``.
        gamma: discount.

    Returns:
        ``[B, T]`` advantages, 0 at masked positions.
    """
    check_ndim("token_rewards", token_rewards, 2)
    check_batch(token_rewards=token_rewards, mask=mask)
    _check_discount("gamma", gamma)
    with torch.no_grad():
        m = as_float_mask(mask, token_rewards)
        returns = masked_discounted_returns(token_rewards.detach() * m, mask, gamma)
        return masked_whiten(returns, m, eps=eps)


def reinforce_pp_baseline(
    rewards: Tensor, group_ids: Tensor, mask: Tensor, *, eps: float = 1e-8
) -> Tensor:
    """REINFORCE++-baseline: ``r_i - mean_g``, broadcast over tokens, whitened over the batch.

    Args:
        rewards: ``[N]``; group_ids: ``[N]``; mask: ``[N, T]``.

    Returns:
        ``[N, T]`` advantages, 0 at masked positions.
    """
    centred = grpo(rewards, group_ids, normalize_std=False)
    check_rows("rewards", rewards, "mask", mask)
    with torch.no_grad():
        m = as_float_mask(mask, centred)
        return masked_whiten(centred.unsqueeze(1) * m, m, eps=eps)


def remax(rewards: Tensor, baseline_rewards: Tensor) -> Tensor:
    """ReMax advantage ``r_i - b_i`` with ``b_i`` the reward of the greedy rollout.

    Args:
        rewards: ``[N]`` sampled-response rewards.
        baseline_rewards: ``[N]`` reward of the greedy response to the same prompt.

    Returns:
        ``[N]`` advantages.
    """
    check_nonempty("rewards", rewards)
    check_ndim("rewards", rewards, 1)
    check_same_shape(rewards=rewards, baseline_rewards=baseline_rewards)
    return (rewards.detach() - baseline_rewards.detach().to(rewards.dtype)).to(
        torch.promote_types(rewards.dtype, torch.float32)
    )


def _check_discount(name: str, x: float) -> None:
    if not 0.0 <= float(x) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {x}")
