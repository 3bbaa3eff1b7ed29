"""Truncated importance weights between the trainer and the rollout engine.

With asynchronous or k-step off-policy training (AsyncFlow, NeMo RL), and even
on-policy when the generation engine's numerics differ from the trainer's,
the tokens were sampled by the rollout policy ``mu`` while the loss is taken
for the training policy ``pi``. The ratio ``w = pi / mu`` corrects for that;
truncating it bounds the variance (truncated importance sampling, as in
IMPALA's V-trace, Espeholt et al. 2018, and the "TIS" correction of Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training").

* ``level="token"``: ``w_t = exp(log pi_t - log mu_t)``.
* ``level="sequence"``: ``w_i = exp(sum_t (log pi_t - log mu_t))``, the
  product of the token ratios, broadcast over the sequence.
* ``level="geometric"``: ``exp(mean_t ...)``, the per-token geometric mean.
* ``mode="truncate"``: ``min(w, cap)``; ``mode="mask"``: ``w`` where
  ``w <= cap`` and 0 elsewhere (the token or sequence is dropped).

The weights are detached; pass them as ``is_weights`` to
:func:`relayrl.algorithms.losses.policy_loss`. This is the upper-bound case of
:func:`relayrl.algorithms.correction.rollout_correction` (which also masks
below a lower bound and by divergence), under its older metric names; the
math, clamping included, is that function's.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import check_batch
from relayrl.algorithms.correction import MODES, WEIGHT_LEVELS, rollout_correction

Tensor = torch.Tensor

IS_LEVELS: tuple[str, ...] = WEIGHT_LEVELS
"""The levels of :func:`truncated_is_weights`: the correction's (it computes them), without its ``None``."""
IS_MODES: tuple[str, ...] = MODES


def truncated_is_weights(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights ``pi / mu``, truncated or masked above ``cap``.

    Args:
        train_logprobs: ``[B, T]`` log-probs under the training policy (old
            policy of the update, or the current one).
        rollout_logprobs: ``[B, T]`` log-probs reported by the rollout engine.
        mask: ``[B, T]``.
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        mode: ``"truncate"`` or ``"mask"``.
        cap: upper bound on the weight (> 0).

    Returns:
        ``(weights [B, T] detached, 0 at masked positions, metrics)`` with
        ``offpolicy/is_weight_mean``, ``offpolicy/is_weight_max`` (before
        truncation), ``offpolicy/capped_frac`` (fraction of tokens whose weight
        was truncated or masked), ``offpolicy/kl_k1`` and ``offpolicy/kl_k3``
        (``KL(mu || pi)`` estimates per token).
    """
    check_batch(train_logprobs=train_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    if level not in IS_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(IS_LEVELS)}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    weights, m = rollout_correction(train_logprobs, rollout_logprobs, mask, level=level, mode=mode, high=cap,
                                    low=0.0 if mode == "mask" else None)
    over = m["correction/token_capped_frac"] if mode == "truncate" else m["correction/token_masked_frac"]
    return weights, {"offpolicy/is_weight_mean": m["correction/weight_mean"],
                     "offpolicy/is_weight_max": m["correction/ratio_max"], "offpolicy/capped_frac": over,
                     "offpolicy/kl_k1": m["correction/kl_k1"], "offpolicy/kl_k3": m["correction/kl_k3"]}
