"""DAPO's sample-level techniques (Yu et al. 2025, §3).

* :func:`overlong_penalty` -- soft overlong punishment, DAPO eq. 13: 0 up
  to ``max_len - cache_len`` tokens, then a linear ramp to -1 over the cache
  interval, and -1 beyond ``max_len``. Added to the rule-based reward.
* :func:`overlong_filter_mask` -- overlong filtering: truncated samples are
  masked out of the loss.
* :func:`dynamic_sampling_filter` -- dynamic sampling (eq. 11): keep only
  groups whose rewards are not all equal (accuracy strictly between 0 and 1),
  since an all-equal group has zero GRPO advantage and no gradient.

Departures: the dynamic-sampling test is "rewards not all equal" (within
``atol``), which equals the paper's ``0 < #correct < G`` for binary rewards
and extends it to graded rewards. The filter only reports which rows to keep;
re-sampling until the batch is full is the workflow's job, and so is the
choice of value compared (``algorithm.dynamic_sampling_metric``: the
verifier's score, as the paper's accuracy, or the reward after overlong
shaping; :meth:`relayrl.config.plan.StepPlan.keep_groups`).
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import check_ndim, check_nonempty, check_rows, check_same_shape
from relayrl.algorithms._ops import group_index, group_min_max, group_sum_count

Tensor = torch.Tensor


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """Soft overlong punishment ``R_length`` (DAPO eq. 13).

    Args:
        lengths: ``[N]`` response lengths in tokens.
        max_len: ``L_max``, the length beyond which the penalty is -1.
        cache_len: ``L_cache``, width of the linear ramp ending at ``max_len``.

    Returns:
        ``[N]`` float penalties in ``[-1, 0]``.
    """
    check_nonempty("lengths", lengths)
    check_ndim("lengths", lengths, 1)
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len must be in (0, max_len={max_len}], got {cache_len}")
    length = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    start = float(max_len - cache_len)
    ramp = (start - length) / float(cache_len)
    out = torch.where(length <= start, torch.zeros_like(length), ramp)
    return torch.where(length > max_len, torch.full_like(length, -1.0), out)


def overlong_filter_mask(truncated: Tensor, mask: Tensor) -> Tensor:
    """Zero the rows of ``mask [N, T]`` whose ``truncated [N]`` flag is set.

    Returns a new mask of ``mask``'s dtype.
    """
    check_nonempty("truncated", truncated)
    check_rows("truncated", truncated, "mask", mask)
    keep = (~truncated.bool()).unsqueeze(1)
    if mask.dtype == torch.bool:
        return mask & keep
    return mask * keep.to(mask.dtype)


def dynamic_sampling_filter(
    rewards: Tensor, group_ids: Tensor, *, atol: float = 0.0
) -> tuple[Tensor, dict[str, float]]:
    """Keep the responses of groups whose rewards are not all equal.

    Args:
        rewards: ``[N]``; group_ids: ``[N]`` integer group ids.
        atol: rewards within ``atol`` of each other count as equal.

    Returns:
        ``(keep [N] bool, metrics)`` with ``dapo/groups_total``,
        ``dapo/groups_kept``, ``dapo/groups_dropped``,
        ``dapo/groups_dropped_frac``, ``dapo/dropped_reward_mean`` (mean reward
        of the dropped groups: near the maximum when they were all solved,
        near the minimum when all failed) and ``dapo/rows_kept``.
    """
    check_nonempty("rewards", rewards)
    check_ndim("rewards", rewards, 1)
    check_same_shape(rewards=rewards, group_ids=group_ids)
    with torch.no_grad():
        index, num_groups = group_index(group_ids)
        x = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
        gmin, gmax = group_min_max(x, index, num_groups)
        varied = (gmax - gmin) > atol
        keep = varied[index]
        dropped = num_groups - int(varied.sum().item())
        sums, counts = group_sum_count(x, index, num_groups)
        flat = (~varied).to(x.dtype)
        dropped_reward = (sums / counts * flat).sum() / flat.sum().clamp(min=1.0)
        metrics = {
            "dapo/groups_total": float(num_groups),
            "dapo/groups_kept": float(num_groups - dropped),
            "dapo/groups_dropped": float(dropped),
            "dapo/groups_dropped_frac": dropped / num_groups,
            "dapo/dropped_reward_mean": float(dropped_reward.item()),
            "dapo/rows_kept": float((counts * varied.to(counts.dtype)).sum().item()),
        }
    return keep, metrics
