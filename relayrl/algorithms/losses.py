"""Clipped policy-gradient loss (PPO / GRPO / DAPO / GSPO) and loss aggregation.

Implements the PPO clipped surrogate (Schulman et al. 2017; DAPO eq. 1) as
a loss to minimise, per token::

    pg_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high))

with

* decoupled bounds ``clip_low`` / ``clip_high`` -- DAPO clip-higher (Yu et al.
  2025, DAPO eq. 10; DAPO uses 0.2 / 0.28). Equal bounds are PPO/GRPO.
* optional dual-clip for negative advantages (Ye et al. 2020, "Mastering
  Complex Control in MOBA Games"): ``pg_t = min(pg_t, -A_t * dual_clip)`` when
  ``A_t < 0``, bounding the loss of a token whose ratio has exploded.
* ``level="sequence"``: GSPO (Zheng et al. 2025) sequence-level ratio
  ``s_i = exp(mean_t log(pi/pi_old))`` (:mod:`relayrl.algorithms.ratio`). With
  ``agg="seq-mean-token-sum"`` each sequence's loss is its length times GSPO's:
  LUSPO (length-unbiased sequence policy optimisation, 2026).
* optional per-token importance weights ``is_weights`` (detached) multiplying
  the token loss: off-policy correction between the rollout engine and the
  trainer (see :mod:`relayrl.algorithms.offpolicy`).

The aggregation over tokens is a separate choice (``agg``, see
:mod:`relayrl.algorithms.aggregation`): GRPO is this loss with equal bounds and
``"seq-mean-token-mean"``; DAPO with ``clip_high > clip_low`` and
``"token-mean"``.

Departures: log-ratios are clamped to ``[-20, 20]`` before ``exp``; metrics are
over this call's valid tokens (a micro-batch), not the global batch.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import to_floats
from relayrl.algorithms._ops import masked_mean
from relayrl.algorithms.aggregation import AGG_MODES, aggregate, count_tokens_and_seqs
from relayrl.algorithms.names import POLICY_LOSS_NAMES
from relayrl.algorithms.ratio import RATIO_LEVELS, LossArgs, ratio_metrics, ratio_terms

Tensor = torch.Tensor

__all__ = ["AGG_MODES", "RATIO_LEVELS", "POLICY_LOSSES", "aggregate", "count_tokens_and_seqs", "policy_loss",
           "policy_loss_fn"]


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    level: str = "token",
    is_weights: Tensor | None = None,
    global_tokens: int | None = None,
    global_seqs: int | None = None,
    constant: float | None = None,
    group_tokens: Tensor | None = None,
    global_groups: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate loss (to minimise) and its metrics.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy
            being trained (requires grad).
        old_logprobs: ``[B, T]`` log-probs under the policy that the ratio is
            taken against (the old policy; detached here).
        advantages: ``[B, T]`` per-token advantages (detached here).
        mask: ``[B, T]`` 1 on valid response tokens.
        clip_low, clip_high: ratio bounds ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: ``c > 1`` bounding the loss of negative-advantage tokens by
            ``-A * c``; ``None`` disables it.
        agg: aggregation mode (:data:`AGG_MODES`).
        level: ``"token"`` (PPO ratio) or ``"sequence"`` (GSPO ratio).
        is_weights: ``[B, T]`` importance weights multiplying the token loss.
        global_tokens, global_seqs, constant, group_tokens, global_groups:
            normalisers passed to :func:`aggregate` for micro-batch /
            data-parallel exactness (the last two: prompt-level aggregation).

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/clip_frac_low``
        (ratio below ``1 - clip_low`` with ``A < 0``: clipped), ``actor/clip_frac_high``
        (ratio above ``1 + clip_high`` with ``A > 0``), ``actor/clip_frac``,
        ``actor/dual_clip_frac``, ``actor/approx_kl`` (k3 estimate ``(r - 1) - log r`` of
        ``KL(pi_old || pi)``), ``actor/ratio_mean``, ``actor/ratio_max``,
        ``actor/ratio_min``.
    """
    c = LossArgs.of("PPO", dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg=agg, level=level,
                                is_weights=is_weights, global_tokens=global_tokens, global_seqs=global_seqs,
                                constant=constant, group_tokens=group_tokens, global_groups=global_groups),
                    levels=RATIO_LEVELS, dual_clip=True, clip=True)
    LossArgs.check(logprobs, old_logprobs, advantages, mask, is_weights)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")

    t = ratio_terms(logprobs, old_logprobs, advantages, mask, level)
    m, valid, adv, ratio = t.m, t.valid, t.adv, t.ratio
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    dual_active = None
    if dual_clip is not None:
        dual_bound = -adv * dual_clip
        dual_active = (adv < 0) & (pg > dual_bound) & valid
        pg = torch.where(adv < 0, torch.minimum(pg, dual_bound), pg)
    loss = c.reduce(pg, mask)

    with torch.no_grad():
        r = ratio.detach()
        low = (r < 1.0 - clip_low) & (adv < 0) & valid
        high = (r > 1.0 + clip_high) & (adv > 0) & valid
        metrics: dict[str, Tensor | float] = {
            "actor/pg_loss": loss.detach(),
            "actor/clip_frac_low": masked_mean(low.to(m.dtype), m),
            "actor/clip_frac_high": masked_mean(high.to(m.dtype), m),
            "actor/clip_frac": masked_mean((low | high).to(m.dtype), m),
            **ratio_metrics(t),
        }
        if dual_active is not None:
            metrics["actor/dual_clip_frac"] = masked_mean(dual_active.to(m.dtype), m)
    return loss, to_floats(metrics)


def _policy_losses() -> dict:
    from relayrl.algorithms.cispo import cispo_loss
    from relayrl.algorithms.covariance import clip_cov_loss, kl_cov_loss
    from relayrl.algorithms.gmpo import gmpo_loss
    from relayrl.algorithms.gpg import gpg_loss
    from relayrl.algorithms.sapo import sapo_loss
    from relayrl.algorithms.vespo import vespo_loss

    return dict(zip(POLICY_LOSS_NAMES, (policy_loss, cispo_loss, sapo_loss, vespo_loss, clip_cov_loss, kl_cov_loss,
                                        gmpo_loss, gpg_loss), strict=True))


POLICY_LOSSES: dict = _policy_losses()
"""``algorithm.policy_loss`` -> the loss function; every one takes :func:`policy_loss`'s arguments (the others as
``**common``: :class:`~relayrl.algorithms.ratio.LossArgs`) and its own options by keyword (SAPO's temperatures,
VESPO's kernel, Clip-Cov's and KL-Cov's token selection)."""


def policy_loss_fn(kind: str):
    """The policy loss ``algorithm.policy_loss=kind``: a registered one (:data:`POLICY_LOSSES`), or a user's at the
    path ``kind`` (:func:`~relayrl.algorithms.plugins.load_policy_loss`: loaded once in the process that asks, its
    return checked at each call)."""
    if kind in POLICY_LOSSES:
        return POLICY_LOSSES[kind]
    from relayrl.algorithms.plugins import load_policy_loss

    return load_policy_loss(kind)
