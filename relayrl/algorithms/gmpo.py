"""GMPO: geometric-mean policy optimisation (Zhao et al. 2025, "Geometric-Mean Policy Optimization").

GRPO averages token ratios arithmetically, so one token with an extreme ratio moves its sequence's objective a
lot; GMPO takes the geometric mean of the token ratios, clipped token by token in log space, and optimises a
sequence-level surrogate::

    l_t    = log(pi(y_t) / pi_old(y_t))
    c_t    = sgn(A) * min(sgn(A) * l_t, sgn(A) * clip(l_t, -clip_low, clip_high))   (PPO's pessimism, in log space)
    r_i    = exp(mean_t c_t)                                                      (the geometric mean)
    loss_i = - A_i * r_i,   averaged over sequences

``clip_low`` and ``clip_high`` bound the *log*-ratio here (GMPO's paper uses 0.4 each: ratios in
``[e^-0.4, e^0.4]``; verl's ``geo_mean`` reads its clip ratios the same way). ``A_i`` is the sequence's mean
advantage (outcome advantages are constant over a sequence). On-policy the gradient is the policy gradient
averaged per token, as GRPO's with ``seq-mean-token-mean``.

Departures: ``mean_t c_t`` is clamped to ``[-20, 20]`` before ``exp``; further token factors (``is_weights``: a
rollout correction, a token selection) multiply each token's share of its sequence's loss (their arithmetic mean
scales the sequence, where verl takes a geometric mean of the correction's weights).
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import to_floats
from relayrl.algorithms._ops import LOG_CLAMP, masked_mean
from relayrl.algorithms.ratio import LossArgs, ratio_metrics, ratio_terms

Tensor = torch.Tensor

__all__ = ["gmpo_loss"]


def gmpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              **common) -> tuple[Tensor, dict[str, float]]:
    """The GMPO loss (to minimise) and its metrics.

    Args:
        logprobs, old_logprobs, advantages, mask: as for :func:`~relayrl.algorithms.losses.policy_loss`.
        common: :class:`~relayrl.algorithms.ratio.LossArgs`: ``clip_low``, ``clip_high`` bound each token's
            log-ratio, ``[-clip_low, clip_high]`` (default 0.4 each, the paper's); ``agg`` must be
            ``"seq-mean-token-mean"`` (GMPO's mean over sequences, the default here); token level (the sequence
            ratio is GMPO's own), no dual clip.

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/clip_frac_low`` / ``_high`` / ``actor/clip_frac``
        (tokens whose log-ratio the clip held, with a negative / positive advantage), ``actor/seq_ratio_mean``
        (the geometric means), ``actor/approx_kl``, ``actor/ratio_*`` (token ratios).
    """
    common = {"agg": "seq-mean-token-mean", "clip_low": 0.4, "clip_high": 0.4, **common}  # (the paper's)
    c = LossArgs.of("GMPO", common, aggs=("seq-mean-token-mean",))
    LossArgs.check(logprobs, old_logprobs, advantages, mask, c.is_weights)
    clip_low, clip_high = c.clip_low, c.clip_high
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"GMPO's log-ratio bounds must be >= 0, got {clip_low}, {clip_high}")
    t = ratio_terms(logprobs, old_logprobs, advantages, mask)
    sign = torch.sign(t.adv)
    held = t.log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * t.log_ratio, sign * held)
    n = t.m.sum(dim=1).clamp(min=1.0)
    seq_ratio = torch.exp(((pessimistic * t.m).sum(dim=1) / n).clamp(-LOG_CLAMP, LOG_CLAMP))
    seq_adv = (t.adv * t.m).sum(dim=1) / n
    loss = c.reduce((-seq_adv * seq_ratio).unsqueeze(1) * t.m, mask)  # the sequence's loss on each of its tokens
    with torch.no_grad():
        clipped = (pessimistic != t.log_ratio) & t.valid  # the clip took the token (its gradient is 0)
        low, high = clipped & (t.adv < 0), clipped & (t.adv > 0)
        rows = t.valid.any(dim=1)
        metrics = {
            "actor/pg_loss": loss.detach(),
            "actor/clip_frac_low": masked_mean(low.to(t.m.dtype), t.m),
            "actor/clip_frac_high": masked_mean(high.to(t.m.dtype), t.m),
            "actor/clip_frac": masked_mean((low | high).to(t.m.dtype), t.m),
            "actor/seq_ratio_mean": seq_ratio.detach()[rows].mean() if bool(rows.any()) else torch.ones(()),
            **ratio_metrics(t),
        }
    return loss, to_floats(metrics)
