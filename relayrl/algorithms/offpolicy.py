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
:func:`relayrl.algorithms.losses.policy_loss`. Departure: log-ratios are
clamped to ``[-20, 20]`` before ``exp``; the cap is applied in log space, so
a huge sequence ratio never overflows.
"""

from __future__ import annotations

import math

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim, to_floats
from relayrl.algorithms._ops import masked_mean

Tensor = torch.Tensor

IS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
IS_MODES: tuple[str, ...] = ("truncate", "mask")
_LOG_CLAMP = 20.0


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
    check_ndim("train_logprobs", train_logprobs, 2)
    check_batch(train_logprobs=train_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    if level not in IS_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(IS_MODES)}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    with torch.no_grad():
        m = as_float_mask(mask, train_logprobs)
        valid = m > 0
        zero = torch.zeros((), dtype=m.dtype, device=m.device)
        lr = torch.where(valid, train_logprobs.detach() - rollout_logprobs.detach().to(m.dtype), zero)
        if level == "token":
            log_w = lr
        else:
            seq = lr.sum(dim=1)
            if level == "geometric":
                seq = seq / m.sum(dim=1).clamp(min=1.0)
            log_w = seq.unsqueeze(1).expand_as(lr)
        log_w = log_w.clamp(-_LOG_CLAMP, _LOG_CLAMP)
        log_cap = math.log(cap)
        over = (log_w > log_cap) & valid
        if mode == "truncate":
            weights = torch.exp(log_w.clamp(max=log_cap))
        else:
            weights = torch.where(over, zero, torch.exp(log_w.clamp(max=log_cap)))
        weights = weights * m
        raw = torch.exp(log_w)
        raw_valid = raw[valid]
        metrics = {
            "offpolicy/is_weight_mean": masked_mean(weights, m),
            "offpolicy/is_weight_max": raw_valid.max() if raw_valid.numel() else torch.ones(()),
            "offpolicy/capped_frac": masked_mean(over.to(m.dtype), m),
            "offpolicy/kl_k1": masked_mean(-lr, m),
            "offpolicy/kl_k3": masked_mean(torch.expm1(lr.clamp(-_LOG_CLAMP, _LOG_CLAMP)) - lr, m),
        }
    return weights, to_floats(metrics)
