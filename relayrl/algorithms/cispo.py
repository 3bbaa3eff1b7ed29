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

from relayrl.algorithms._checks import to_floats
from relayrl.algorithms._ops import masked_mean
from relayrl.algorithms.ratio import LossArgs, ratio_metrics, ratio_terms

Tensor = torch.Tensor

__all__ = ["cispo_loss"]


def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
               **common) -> tuple[Tensor, dict[str, float]]:
    """The CISPO loss (to minimise) and its metrics.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy being trained (requires grad).
        old_logprobs: ``[B, T]`` log-probs under ``pi_old`` (detached here).
        advantages: ``[B, T]`` per-token advantages (detached here).
        mask: ``[B, T]`` 1 on valid response tokens.
        common: :class:`~relayrl.algorithms.ratio.LossArgs`; the weight is clipped to
            ``[1 - clip_low, 1 + clip_high]``; no dual clip, token level only.

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/clip_frac_low`` / ``_high`` (tokens whose
        weight was clipped from below / above, whatever the advantage's sign: every one still has a
        gradient), ``actor/clip_frac``, ``actor/approx_kl`` (k3 of ``KL(pi_old || pi)``),
        ``actor/ratio_mean``, ``actor/ratio_max``, ``actor/ratio_min``.
    """
    c = LossArgs.of("CISPO", common, clip=True)
    LossArgs.check(logprobs, old_logprobs, advantages, mask, c.is_weights)
    clip_low, clip_high = c.clip_low, c.clip_high
    t = ratio_terms(logprobs, old_logprobs, advantages, mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    with torch.no_grad():
        ratio = t.ratio.detach()
        weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = c.reduce(-weight * t.adv * torch.where(t.valid, logprobs, zero), mask)
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
