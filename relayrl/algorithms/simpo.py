"""SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward"): a preference
loss without a reference model.

With ``a_w``, ``a_l`` the *average* per-token log-probs of the chosen and rejected answers (the sequence
log-prob over its length, ``log pi(y) / |y|``)::

    loss = -log sigmoid(beta * a_w - beta * a_l - gamma)

averaged over the ``N`` pairs: the implicit reward is ``beta * a`` and ``gamma`` is the target margin between
the chosen and the rejected rewards (the paper's eq. 6). TRL's ``CPOTrainer(loss_type="simpo")`` computes the
same with ``simpo_gamma`` = ``gamma`` (it subtracts ``simpo_gamma / beta`` inside ``beta * (...)``), default
0.5; the paper tunes ``beta`` in 2-10 and ``gamma / beta`` around 0.5. TRL's CPO trainer adds its behaviour
cloning term (``cpo_alpha``, default 1: CPO-SimPO) unless it is set to 0; in relayrl that term is
``dpo.nll_weight`` (default 0: SimPO as in the paper).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relayrl.algorithms._checks import check_batch, check_ndim
from relayrl.algorithms.dpo import preference_metrics

Tensor = torch.Tensor

__all__ = ["simpo_loss"]


def simpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, *, beta: float,
               gamma: float) -> tuple[Tensor, dict[str, float]]:
    """SimPO over ``N`` (chosen, rejected) pairs.

    Args:
        chosen_avg_logps: ``[N]`` the chosen answers' average per-token log-probs (summed log-probs over
            the answer's token count), policy.
        rejected_avg_logps: ``[N]`` the same for the rejected answers.
        beta: reward scale (> 0).
        gamma: target reward margin (>= 0; TRL's ``simpo_gamma``).

    Returns:
        ``(loss, metrics)``: the mean over pairs, and the ``dpo/*`` figures of
        :func:`~relayrl.algorithms.dpo.preference_metrics` with rewards ``beta * average log-prob`` (as TRL
        logs them) and ``dpo/logps_*`` the average log-probs.
    """
    check_ndim("chosen_avg_logps", chosen_avg_logps, 1)
    check_batch(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not gamma >= 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    r_c, r_r = beta * chosen_avg_logps, beta * rejected_avg_logps
    loss = -F.logsigmoid(r_c - r_r - gamma).mean()
    return loss, preference_metrics(loss, r_c, r_r, chosen_avg_logps, rejected_avg_logps)
