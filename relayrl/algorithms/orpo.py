"""ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model"): supervised
fine-tuning on the chosen answers plus an odds-ratio preference term, without a reference model.

With ``a`` an answer's *average* per-token log-prob and ``p = exp(a)`` (the paper's length-normalised
likelihood, eq. 4), ``log odds(y) = log p - log(1 - p) = a - log1mexp(a)``, and over the ``N`` pairs::

    loss = mean(-a_w) + lam * mean(-log sigmoid(log odds(y_w) - log odds(y_l)))

The first term is the chosen answers' NLL (the paper's L_SFT), here the mean over pairs of each answer's
per-token mean; TRL's ``ORPOTrainer`` takes the token mean over all the chosen tokens of the batch instead (the
same when the chosen answers have one length). ``lam`` is the paper's lambda, TRL's ``ORPOConfig.beta``
(default 0.1) and relayrl's ``dpo.beta``. ``log(1 - p)`` is computed as a stable ``log1mexp`` (``log(-expm1(a))``
above ``-log 2``, ``log1p(-exp(a))`` below), and ``a`` is capped at ``-1e-6``: at ``a = 0`` (p = 1) the odds
are infinite and the gradient would be NaN; the cap makes that pair's odds term a constant.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from relayrl.algorithms._checks import check_batch, check_ndim
from relayrl.algorithms.dpo import preference_metrics

Tensor = torch.Tensor

__all__ = ["orpo_loss", "log1mexp", "MAX_AVG_LOGP"]

MAX_AVG_LOGP = -1e-6
"""The cap on an average log-prob before its log-odds (p = 1 would give infinite odds)."""


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0`` (any shape), without the cancellation of the plain form (Maechler
    2012: ``log(-expm1(x))`` for ``x > -log 2``, ``log1p(-exp(x))`` below)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, *, beta: float) -> tuple[Tensor, dict[str, float]]:
    """ORPO over ``N`` (chosen, rejected) pairs.

    Args:
        chosen_avg_logps: ``[N]`` the chosen answers' average per-token log-probs (< 0), policy.
        rejected_avg_logps: ``[N]`` the same for the rejected answers.
        beta: the odds-ratio term's weight (the paper's lambda, > 0).

    Returns:
        ``(loss, metrics)``: the NLL plus ``beta`` times the odds-ratio term, and the ``dpo/*`` figures of
        :func:`~relayrl.algorithms.dpo.preference_metrics` with rewards ``beta * average log-prob`` (TRL's),
        plus ``dpo/log_odds_ratio`` (the mean ``log odds(y_w) - log odds(y_l)``) and ``dpo/or_loss`` (the mean
        ``-log sigmoid`` of it, unweighted).
    """
    check_ndim("chosen_avg_logps", chosen_avg_logps, 1)
    check_batch(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    a_w, a_l = chosen_avg_logps.clamp(max=MAX_AVG_LOGP), rejected_avg_logps.clamp(max=MAX_AVG_LOGP)
    log_odds = (a_w - log1mexp(a_w)) - (a_l - log1mexp(a_l))
    or_loss = -F.logsigmoid(log_odds).mean()
    loss = -chosen_avg_logps.mean() + beta * or_loss
    return loss, preference_metrics(loss, beta * chosen_avg_logps, beta * rejected_avg_logps, chosen_avg_logps,
                                    rejected_avg_logps, **{"dpo/log_odds_ratio": log_odds.mean(),
                                                           "dpo/or_loss": or_loss})
