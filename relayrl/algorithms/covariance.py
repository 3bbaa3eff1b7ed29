"""Clip-Cov and KL-Cov: entropy control through the tokens whose log-prob moves with their advantage (Cui et al.
2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models").

The paper shows that the policy's entropy falls in proportion to the covariance, over tokens, between a token's
log-prob and its advantage: a few tokens with a large ``cov_t = (A_t - mean A) * (log pi_t - mean log pi)``
(already likely and rewarded) drive the collapse. Both losses act on those tokens only, in each call's
micro-batch:

* **Clip-Cov** (``clip_cov_loss``): PPO's clipped surrogate, and among the tokens PPO did not clip whose
  covariance lies in ``[cov_low, cov_high]``, a random fraction ``cov_ratio`` of all valid tokens has its loss
  (and gradient) removed;
* **KL-Cov** (``kl_cov_loss``): the unclipped surrogate ``-A r`` plus, on the top ``cov_ratio`` fraction of
  tokens by covariance, a penalty ``kl_coef * |log r|`` that holds them near pi_old.

Defaults are verl's (``clip_cov_ratio=0.0002``, bounds 1 and 5; ``kl_cov_ratio=0.0002``, ``ppo_kl_coef=0.1``);
at least one token is chosen when any qualifies. Departures: log-ratios are clamped to ``[-20, 20]`` before
``exp``; Clip-Cov draws its tokens with torch's global generator (the update seeds it per step).
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import to_floats
from relayrl.algorithms._ops import masked_mean
from relayrl.algorithms.ratio import LossArgs, ratio_metrics, ratio_terms

Tensor = torch.Tensor

__all__ = ["clip_cov_loss", "kl_cov_loss", "token_covariance"]


def token_covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]``: each valid token's ``(A - mean A) * (log pi - mean log pi)`` over the valid tokens (no
    gradient); ``-inf`` off the mask."""
    with torch.no_grad():
        m = mask > 0
        lp, adv = logprobs.detach().float(), advantages.detach().float()
        cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
        return torch.where(m, cov, torch.full_like(cov, float("-inf")))


def _chosen(count: int, ratio: float) -> int:
    return max(int(ratio * count), 1)


def clip_cov_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                  cov_ratio: float = 0.0002, cov_low: float = 1.0, cov_high: float = 5.0, kl_coef: float = 0.1,
                  **common) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov (to minimise) and its metrics.

    Args:
        logprobs, old_logprobs, advantages, mask: as for :func:`~relayrl.algorithms.losses.policy_loss`.
        cov_ratio: the fraction of valid tokens whose loss is removed.
        cov_low, cov_high: the covariance range a removed token is drawn from.
        kl_coef: KL-Cov's; not used here (both losses of this module take the same options).
        common: :class:`~relayrl.algorithms.ratio.LossArgs` (PPO's clip bounds; token level, no dual clip).

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/clip_frac_low``/``_high``/``actor/clip_frac``
        (PPO's clip), ``actor/cov_frac`` (tokens removed), ``actor/approx_kl``, ``actor/ratio_*``.
    """
    c = LossArgs.of("Clip-Cov", common, clip=True)
    LossArgs.check(logprobs, old_logprobs, advantages, mask, c.is_weights)
    clip_low, clip_high = c.clip_low, c.clip_high
    if not 0 < cov_ratio <= 1 or cov_low >= cov_high:
        raise ValueError(f"Clip-Cov needs 0 < cov_ratio <= 1 and cov_low < cov_high, got {cov_ratio}, "
                         f"[{cov_low}, {cov_high}]")
    t = ratio_terms(logprobs, old_logprobs, advantages, mask)
    unclipped = -t.adv * t.ratio
    clipped = -t.adv * t.ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        by_clip = (clipped > unclipped) & t.valid
        cov = token_covariance(logprobs, t.adv, t.m)
        candidates = torch.nonzero((cov > cov_low) & (cov < cov_high) & t.valid & ~by_clip)
        keep = torch.ones_like(t.m)
        if len(candidates):
            n = min(_chosen(int(t.valid.sum()), cov_ratio), len(candidates))
            pick = candidates[torch.randperm(len(candidates), device=candidates.device)[:n]]
            keep[pick[:, 0], pick[:, 1]] = 0.0
    loss = c.reduce(torch.maximum(unclipped, clipped) * keep, mask)
    with torch.no_grad():
        r = t.ratio.detach()
        low = (r < 1.0 - clip_low) & (t.adv < 0) & t.valid
        high = (r > 1.0 + clip_high) & (t.adv > 0) & t.valid
        metrics = {
            "actor/pg_loss": loss.detach(),
            "actor/clip_frac_low": masked_mean(low.to(t.m.dtype), t.m),
            "actor/clip_frac_high": masked_mean(high.to(t.m.dtype), t.m),
            "actor/clip_frac": masked_mean((low | high).to(t.m.dtype), t.m),
            "actor/cov_frac": masked_mean(1.0 - keep, t.m),
            **ratio_metrics(t),
        }
    return loss, to_floats(metrics)


def kl_cov_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                cov_ratio: float = 0.0002, cov_low: float = 1.0, cov_high: float = 5.0, kl_coef: float = 0.1,
                **common) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov (to minimise) and its metrics.

    Args:
        logprobs, old_logprobs, advantages, mask: as for :func:`~relayrl.algorithms.losses.policy_loss`.
        cov_ratio: the fraction of valid tokens, the largest covariances, that take the penalty.
        kl_coef: the penalty's weight on ``|log r|``.
        cov_low, cov_high: Clip-Cov's; not used here.
        common: :class:`~relayrl.algorithms.ratio.LossArgs`, token level; the clip bounds are not used (KL-Cov
            has no clip) and there is no dual clip.

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/cov_frac`` (tokens penalised),
        ``actor/approx_kl``, ``actor/ratio_*``.
    """
    c = LossArgs.of("KL-Cov", common)
    LossArgs.check(logprobs, old_logprobs, advantages, mask, c.is_weights)
    if not 0 < cov_ratio <= 1 or kl_coef < 0:
        raise ValueError(f"KL-Cov needs 0 < cov_ratio <= 1 and kl_coef >= 0, got {cov_ratio}, {kl_coef}")
    t = ratio_terms(logprobs, old_logprobs, advantages, mask)
    with torch.no_grad():
        cov = token_covariance(logprobs, t.adv, t.m).flatten()
        penalised = torch.zeros_like(t.m)
        valid = int(t.valid.sum())
        if valid:
            top = torch.topk(cov, min(_chosen(valid, cov_ratio), valid)).indices
            penalised.view(-1)[top] = 1.0
    loss = c.reduce(-t.adv * t.ratio + kl_coef * penalised * t.log_ratio.abs(), mask)
    with torch.no_grad():
        metrics = {"actor/pg_loss": loss.detach(), "actor/cov_frac": masked_mean(penalised, t.m), **ratio_metrics(t)}
    return loss, to_floats(metrics)
