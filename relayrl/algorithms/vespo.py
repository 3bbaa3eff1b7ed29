"""VESPO: variational sequence-level soft policy optimisation (arXiv 2602.10693).

Off-policy training (stale rollouts, asynchronous updates, a rollout engine whose numerics differ from the
trainer's) meets sequence-level importance weights ``W = pi(y) / mu(y)`` that range over orders of magnitude.
Rather than clipping tokens (PPO) or normalising the ratio by length (GSPO), VESPO reshapes the sequence
weight with a Gamma-shaped kernel, normalised so that ``phi(1) = 1``, and uses it as a detached factor on the
policy gradient::

    log W  = sum_t log(pi(y_t) / pi_old(y_t))
    phi(W) = W^k * exp(lambda * (1 - W))                     (k, lambda) by the sign of the token's advantage
    loss_t = - sg[phi(W)] * A_t * log pi(y_t)

``phi`` rises as ``W^k`` for small weights and decays as ``exp(-lambda W)`` for large ones; its peak is at
``W = k / lambda``. Defaults (the paper's section 3.4, as TRL): ``k = 2, lambda = 3`` for positive advantages,
``k = 3, lambda = 2`` for the rest. On-policy (``W = 1``) the gradient is the policy gradient ``-A grad log pi``.

The paper's ``W`` is the ratio to the behaviour policy ``mu`` that sampled the tokens: with
``algorithm.old_logprobs=rollout`` pi_old *is* the rollout engine's log-probs and ``W = pi / mu`` (staleness and
engine mismatch included, which is what the kernel is for).

Departures: ``log W`` is clamped to ``[log 1e-8, 20]`` (as the reference implementation); further token factors
(``is_weights``: a rollout correction, a token selection) multiply the token loss as for every policy loss,
where TRL folds its token importance weights into ``W``; ``actor/pg_loss`` is ``-phi A log pi``'s value, not
comparable with PPO's.
"""

from __future__ import annotations

import math

import torch

from relayrl.algorithms._checks import to_floats
from relayrl.algorithms._ops import LOG_CLAMP, masked_mean
from relayrl.algorithms.ratio import LossArgs, ratio_metrics, ratio_terms

Tensor = torch.Tensor

__all__ = ["vespo_loss", "vespo_weight"]

_LOG_W_MIN = math.log(1e-8)


def vespo_weight(log_w: Tensor, positive: Tensor, *, k_pos: float, lambda_pos: float, k_neg: float,
                 lambda_neg: float) -> Tensor:
    """``phi(W) = W^k exp(lambda (1 - W))`` from ``log W`` (broadcast against ``positive``, where the
    positive-advantage ``(k, lambda)`` apply), computed in log space; 0 where it is not finite."""
    log_w = log_w.clamp(_LOG_W_MIN, LOG_CLAMP)
    k = torch.where(positive, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(positive, lambda_pos, lambda_neg).to(log_w.dtype)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, k_pos: float = 2.0,
               lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
               **common) -> tuple[Tensor, dict[str, float]]:
    """The VESPO loss (to minimise) and its metrics.

    Args:
        logprobs, old_logprobs, advantages, mask: as for :func:`~relayrl.algorithms.losses.policy_loss`.
        k_pos, lambda_pos, k_neg, lambda_neg: the kernel's power and decay for tokens with a non-negative /
            negative advantage (``lambda > 0``, ``k >= 0``).
        common: :class:`~relayrl.algorithms.ratio.LossArgs`, token level only (the sequence weight is VESPO's
            own, the product of the token ratios); the clip bounds are not used and there is no dual clip.

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/vespo_weight_mean`` (``phi`` over valid
        tokens: 1 on-policy), ``actor/seq_log_ratio_mean`` (``log W`` over the rows with a valid token),
        ``actor/approx_kl``, ``actor/ratio_mean``, ``actor/ratio_max``, ``actor/ratio_min`` (token ratios).
    """
    c = LossArgs.of("VESPO", common)
    LossArgs.check(logprobs, old_logprobs, advantages, mask, c.is_weights)
    if not (lambda_pos > 0 and lambda_neg > 0 and k_pos >= 0 and k_neg >= 0):
        raise ValueError(f"VESPO's kernel needs lambda > 0 and k >= 0, got k_pos={k_pos}, lambda_pos={lambda_pos}, "
                         f"k_neg={k_neg}, lambda_neg={lambda_neg}")
    t = ratio_terms(logprobs, old_logprobs, advantages, mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    with torch.no_grad():
        log_w = (t.log_ratio.detach().clamp(-LOG_CLAMP, LOG_CLAMP) * t.m).sum(dim=1, keepdim=True)
        phi = vespo_weight(log_w, t.adv >= 0, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                           lambda_neg=lambda_neg)
    loss = c.reduce(-phi * t.adv * torch.where(t.valid, logprobs, zero), mask)
    with torch.no_grad():
        rows = t.valid.any(dim=1)
        metrics = {
            "actor/pg_loss": loss.detach(),
            "actor/vespo_weight_mean": masked_mean(phi, t.m),
            "actor/seq_log_ratio_mean": log_w.squeeze(1)[rows].mean() if bool(rows.any()) else zero,
            **ratio_metrics(t),
        }
    return loss, to_floats(metrics)
