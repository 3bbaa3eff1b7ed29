"""GPG: group policy gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
Model Reasoning", arXiv 2504.02546).

GPG drops PPO's surrogate, the critic, the reference and the KL term, and optimises the policy gradient itself
with a group-relative advantage corrected for the responses that carry no signal::

    A_i    = alpha * (r_i - mean_g(r)) / F_norm          F_norm: the group's std (normalize_std) or 1
    alpha  = B / (B - M)                                 B responses in the batch, M of them with A = 0
    loss_t = - A_i * log pi(y_t)                         (no ratio, no clip)

A group whose rewards are all equal has ``A = 0`` on every response: its responses add nothing to the
gradient but still count in the mean over the batch, which shrinks the gradient by ``(B - M) / B``; ``alpha``
puts that scale back (the paper's "accurate gradient estimation").

Departures: ``M`` counts the responses whose centred reward is 0 (the paper's zero-gradient samples; verl's
``gpg`` estimator counts the responses whose *reward* is non-zero instead, which is the same only when every
informative group has no zero reward). ``F_norm`` follows ``algorithm.normalize_std`` (verl's default is 1:
``normalize_std=false``). The loss's value is ``-A log pi``, not an objective comparable with PPO's
``actor/pg_loss``. The paper's threshold that resamples a batch with too few informative groups is
``algorithm.dynamic_sampling`` here (which drops those groups, so ``alpha`` is then 1).
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import to_floats
from relayrl.algorithms.ratio import LossArgs, ratio_metrics, ratio_terms

Tensor = torch.Tensor

__all__ = ["gpg_advantages", "gpg_loss"]


def gpg_advantages(rewards: Tensor, group_ids: Tensor, *, normalize_std: bool = True,
                   eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """GPG's advantages ``alpha * (r - mean_g r) / F_norm`` and ``alpha``.

    Args:
        rewards: ``[N]`` scalar reward per response (``N`` = the whole batch: ``alpha`` counts over it).
        group_ids: ``[N]`` integer id of each response's prompt group.
        normalize_std: divide by the group's std (+ ``eps``); else ``F_norm = 1``.

    Returns:
        ``([N] advantages, alpha)``; alpha is ``N / (N - M)`` with ``M`` the responses whose centred reward is
        0, and 1 when every response has 0 (nothing to scale).
    """
    from relayrl.algorithms.advantages import grpo

    centred = grpo(rewards, group_ids, normalize_std=normalize_std, eps=eps)
    informative = int((centred != 0).sum())
    alpha = rewards.numel() / informative if informative else 1.0
    return centred * alpha, torch.tensor(alpha)


def gpg_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             **common) -> tuple[Tensor, dict[str, float]]:
    """GPG's loss ``-A_t log pi(y_t)`` (to minimise), aggregated by ``agg``, and its metrics.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy being trained (requires grad).
        old_logprobs: ``[B, T]`` log-probs under ``pi_old``: not in the loss (GPG has no ratio), only in the
            ratio metrics, which show how far the policy moved from them.
        advantages: ``[B, T]`` per-token advantages (detached here).
        mask: ``[B, T]`` 1 on valid response tokens.
        common: :class:`~relayrl.algorithms.ratio.LossArgs`; token level, no dual clip; ``clip_low`` /
            ``clip_high`` are not read.

    Returns:
        ``(loss, metrics)``; metrics: ``actor/pg_loss``, ``actor/approx_kl``, ``actor/ratio_mean``,
        ``actor/ratio_max``, ``actor/ratio_min``.
    """
    c = LossArgs.of("GPG", common)
    LossArgs.check(logprobs, old_logprobs, advantages, mask, c.is_weights)
    t = ratio_terms(logprobs, old_logprobs, advantages, mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    loss = c.reduce(-t.adv * torch.where(t.valid, logprobs, zero), mask)
    return loss, to_floats({"actor/pg_loss": loss.detach(), **ratio_metrics(t)})
