"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, MiniMax 2025, eq. 4).

PPO's clip zeroes the gradient of a token whose ratio left the trust region in the direction its advantage
pushes; in long reasoning traces these are often the rare "fork" tokens (*however*, *wait*) that matter
most. CISPO clips the importance weight instead and keeps every token's policy gradient::

    r_t    = pi(y_t) / pi_old(y_t)
    loss_t = - sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * log pi(y_t)
    grad   = - clip(r_t, ...) * A_t * grad log pi(y_t)        (never 0 for A_t != 0)

On-policy (``r = 1``) this is the REINFORCE gradient ``-A grad log pi``, the same as PPO's. MiniMax-M1
aggregates with the token mean over the batch (``agg="token-mean"``) and sets no lower bound on the weight
(tuning only ``clip_high``); here both bounds are options (``clip_low`` near 1 removes the lower one).

Departures: log-ratios are clamped to ``[-20, 20]`` before ``exp`` (as in
:func:`relayrl.algorithms.losses.policy_loss`); the loss's *value* is ``-w A log pi``, not a surrogate
that equals the objective, so ``actor/pg_loss`` is not comparable with PPO's.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import check_batch, check_ndim, to_floats
from relayrl.algorithms._ops import masked_mean
from relayrl.algorithms.aggregation import aggregate
from relayrl.algorithms.ratio import ratio_metrics, ratio_terms

Tensor = torch.Tensor

__all__ = ["cispo_loss"]


def cispo_loss(
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
) -> tuple[Tensor, dict[str, float]]:
    """The CISPO loss (to minimise) and its metrics.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy being trained (requires grad).
        old_logprobs: ``[B, T]`` log-probs under ``pi_old`` (detached here).
        advantages: ``[B, T]`` per-token advantages (detached here).
        mask: ``[B, T]`` 1 on valid response tokens.
        clip_low, clip_high: the weight is clipped to ``[1 - clip_low, 1 + clip_high]``.
        dual_clip, level: :func:`~relayrl.algorithms.losses.policy_loss`'s options, accepted so that both
            losses take the same arguments; only ``None`` and ``"token"`` are valid (CISPO has neither).
        agg: aggregation mode (:data:`relayrl.algorithms.aggregation.AGG_MODES`).
        is_weights: ``[B, T]`` further factors on the token loss (a rollout correction, detached).
        global_tokens, global_seqs, constant: normalisers for :func:`aggregate`.

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/clip_frac_low`` / ``_high`` (tokens whose
        weight was clipped from below / above, whatever the advantage's sign: every one still has a
        gradient), ``actor/clip_frac``, ``actor/approx_kl`` (k3 of ``KL(pi_old || pi)``),
        ``actor/ratio_mean``, ``actor/ratio_max``, ``actor/ratio_min``.
    """
    check_ndim("logprobs", logprobs, 2)
    check_batch(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask, is_weights=is_weights)
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None or level != "token":
        raise ValueError(f"CISPO clips each token's own weight: dual_clip must be None and level 'token' (got "
                         f"{dual_clip!r}, {level!r})")
    t = ratio_terms(logprobs, old_logprobs, advantages, mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    with torch.no_grad():
        ratio = t.ratio.detach()
        weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        if is_weights is not None:
            weight = weight * is_weights.detach().to(weight.dtype)
    pg = -weight * t.adv * torch.where(t.valid, logprobs, zero)
    loss = aggregate(pg, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, constant=constant)
    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & t.valid
        high = (ratio > 1.0 + clip_high) & t.valid
        metrics = {
            "actor/pg_loss": loss.detach(),
            "actor/clip_frac_low": masked_mean(low.to(t.m.dtype), t.m),
            "actor/clip_frac_high": masked_mean(high.to(t.m.dtype), t.m),
            "actor/clip_frac": masked_mean((low | high).to(t.m.dtype), t.m),
            **ratio_metrics(t),
        }
    return loss, to_floats(metrics)
