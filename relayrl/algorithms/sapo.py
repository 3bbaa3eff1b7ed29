"""SAPO: soft adaptive policy optimisation (Gao et al. 2025, Qwen; arXiv 2511.20347).

PPO's clip is a hard gate: a token whose ratio leaves ``[1 - eps, 1 + eps]`` in its advantage's direction
loses its whole gradient, and one inside keeps all of it. SAPO replaces the clip with a smooth gate that fades
the gradient as the ratio moves away from 1, and fades it faster for negative advantages::

    f(r)   = (4 / tau) * sigmoid(tau * (r - 1))           tau = tau_pos if A > 0 else tau_neg
    loss_t = - f(r_t) * A_t
    grad   = - 4 p (1 - p) * r_t * A_t * grad log pi(y_t),    p = sigmoid(tau * (r_t - 1))

On-policy (``r = 1``) the gate ``4 p (1 - p)`` is 1 and the gradient is the policy gradient ``-A grad log pi``
(PPO's); far off-policy it tends to 0 smoothly. SAPO's defaults are ``tau_pos = 1.0``, ``tau_neg = 1.05``
(negative-advantage tokens, which push probability mass onto the rest of the vocabulary, are damped sooner).
The paper aggregates with the per-sequence token mean (``agg="seq-mean-token-mean"``).

Departures: log-ratios are clamped to ``[-20, 20]`` before ``exp`` (:mod:`relayrl.algorithms.ratio`); the
sequence-level ratio (GSPO's) is accepted as for PPO; ``actor/pg_loss`` is the gated surrogate's value, not
comparable with PPO's.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import to_floats
from relayrl.algorithms._ops import masked_mean
from relayrl.algorithms.ratio import RATIO_LEVELS, LossArgs, ratio_metrics, ratio_terms

Tensor = torch.Tensor

__all__ = ["sapo_loss"]


def sapo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, tau_pos: float = 1.0,
              tau_neg: float = 1.05, **common) -> tuple[Tensor, dict[str, float]]:
    """The SAPO loss (to minimise) and its metrics.

    Args:
        logprobs, old_logprobs, advantages, mask: as for :func:`~relayrl.algorithms.losses.policy_loss`.
        tau_pos, tau_neg: the gate's temperature for tokens with a positive / non-positive advantage (> 0;
            larger fades sooner).
        common: :class:`~relayrl.algorithms.ratio.LossArgs` (token or sequence level); the clip bounds are not
            used (the gate replaces the clip) and there is no dual clip.

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/soft_gate_mean`` (the mean gradient gate
        ``4 p (1 - p)`` over valid tokens: 1 on-policy), ``actor/approx_kl``, ``actor/ratio_mean``,
        ``actor/ratio_max``, ``actor/ratio_min``.
    """
    c = LossArgs.of("SAPO", common, levels=RATIO_LEVELS)
    LossArgs.check(logprobs, old_logprobs, advantages, mask, c.is_weights)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"SAPO's temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    t = ratio_terms(logprobs, old_logprobs, advantages, mask, c.level)
    tau = torch.where(t.adv > 0, tau_pos, tau_neg).to(t.ratio.dtype)
    p = torch.sigmoid(tau * (t.ratio - 1.0))
    loss = c.reduce(-(4.0 / tau) * p * t.adv, mask)
    with torch.no_grad():
        gate = 4.0 * p.detach() * (1.0 - p.detach())
        metrics = {"actor/pg_loss": loss.detach(), "actor/soft_gate_mean": masked_mean(gate, t.m), **ratio_metrics(t)}
    return loss, to_floats(metrics)
