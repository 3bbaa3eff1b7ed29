"""GDPO's decoupled reward ("GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward
RL Optimization", NVIDIA 2026, arXiv 2601.05242; TRL's ``multi_objective_aggregation="normalize_then_sum"``).

With several reward functions, GRPO's reward is their weighted sum, normalised per prompt group: distinct
combinations of the functions' scores that add up to the same sum get the same advantage. GDPO normalises
each function's score within its group first, then sums those with the weights::

    z_ik = (s_ik - mean_g(s_k)) / (std_g(s_k) + eps)        over the rows of i's group g that k scored
    c_i  = sum_k w_k z_ik

and the advantage is ``c`` normalised over the whole batch. Every ``z_k`` has group mean 0, so ``c`` does
too: the batch normalisation is ``(c - mean_g(c)) / (std_batch(c) + eps)``, which is the ``grpo-batch-std``
estimator on ``c`` (:func:`relayrl.algorithms.advantages.grpo_batch_std`); :func:`decoupled_rewards` gives
``c``, the estimator the rest.

A function's ``None`` for a row (TRL's "not this function's row") is NaN here: it takes no part in its
group's mean and std and adds nothing to the row's ``c``. A row no function scored has ``c = 0``.

Departures from TRL: a function whose scores are all equal within a group (or that scored one row of it)
gives exactly 0 there, where TRL divides the float noise of ``s - mean`` by ``eps``; a row no function
scored has ``c = 0`` and so counts in the batch's std (TRL leaves it out), and gets advantage 0 as in TRL.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import check_ndim, check_nonempty, check_rows
from relayrl.algorithms._ops import group_index

Tensor = torch.Tensor

__all__ = ["decoupled_rewards", "EPS"]

EPS = 1e-4
"""Added to each function's group std (TRL's value)."""


def decoupled_rewards(scores: Tensor, weights: Tensor, group_ids: Tensor, *, eps: float = EPS) -> Tensor:
    """The weighted sum of each function's group-normalised score (module docstring).

    Args:
        scores: ``[N, K]`` score of each row by each of ``K`` functions; NaN where a function did not score
            the row.
        weights: ``[K]`` weight of each function.
        group_ids: ``[N]`` integer prompt-group id of each row.
        eps: added to each function's group std.

    Returns:
        ``[N]`` the decoupled reward ``c``; its mean over each group is 0 (up to rounding).
    """
    check_nonempty("scores", scores)
    check_ndim("scores", scores, 2)
    check_ndim("weights", weights, 1)
    check_rows("group_ids", group_ids, "scores", scores)
    if weights.numel() != scores.shape[1]:
        raise ValueError(f"weights has {weights.numel()} values for the {scores.shape[1]} functions of scores "
                         f"{tuple(scores.shape)}")
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    with torch.no_grad():
        index, num_groups = group_index(group_ids)
        x = scores.detach().to(torch.promote_types(scores.dtype, torch.float32))
        out = x.new_zeros(x.shape[0])
        for k, w in enumerate(weights.tolist()):
            out += w * _group_normalised(x[:, k], index, num_groups, eps)
    return out


def _group_normalised(x: Tensor, index: Tensor, num_groups: int, eps: float) -> Tensor:
    """``(x - mean_g) / (std_g + eps)`` over each group's non-NaN entries of ``x [N]`` (unbiased std); 0 where
    ``x`` is NaN and in a group whose non-NaN entries are all equal (or number one)."""
    valid = ~torch.isnan(x)
    zero = x.new_zeros(())
    v = torch.where(valid, x, zero)
    counts = x.new_zeros(num_groups).index_add_(0, index, valid.to(x.dtype))
    mean = x.new_zeros(num_groups).index_add_(0, index, v) / counts.clamp(min=1.0)
    dev = torch.where(valid, x - mean[index], zero)
    std = (x.new_zeros(num_groups).index_add_(0, index, dev * dev) / (counts - 1.0).clamp(min=1.0)).sqrt()
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    low = inf.expand(num_groups).scatter_reduce(0, index, torch.where(valid, x, inf), reduce="amin")
    high = (-inf).expand(num_groups).scatter_reduce(0, index, torch.where(valid, x, -inf), reduce="amax")
    varied = (high > low)[index]  # (a group of equal scores: exactly 0, not rounding noise over eps)
    return torch.where(valid & varied, dev / (std[index] + eps), zero)
