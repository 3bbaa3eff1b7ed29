"""On-policy distillation: the student samples, a teacher scores every token, the per-token reverse KL
is the learning signal.

GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes") trains the student on its own samples against the teacher's token distribution; Thinking
Machines' "On-Policy Distillation" (Lu et al. 2025) runs it inside an RL loop by making the negative
per-token reverse KL the advantage, with no discount, so that the policy-gradient loss minimises
``KL(pi_student || pi_teacher)`` on the student's own trajectories::

    A_t = - coef * (log pi_student(y_t) - log pi_teacher(y_t))  [ + reward_weight * A^reward_t ]

``log pi_student`` is the rollout engine's log-prob of the sampled token (the sampler's, as the Thinking
Machines recipe uses), ``log pi_teacher`` the teacher's on the same context; each token's advantage is
the single-sample (k1) estimate of the reverse KL at that position, so a token the teacher finds likely
is pushed up and one it finds unlikely pushed down. ``reward_weight > 0`` adds the verifier's advantages
(GRPO's, say): distillation mixed with RL.

Departures: the per-token difference is clamped to ``[-20, 20]`` (a token the teacher gives probability 0
would otherwise have an infinite advantage); non-finite log-probs map to the clamp (NaN: a token neither
model could produce, advantage 0).
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim, to_floats
from relayrl.algorithms._ops import LOG_CLAMP, masked_max, masked_mean

Tensor = torch.Tensor

__all__ = ["distill_advantages"]



def distill_advantages(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    reward_advantages: Tensor | None = None,
    *,
    coef: float = 1.0,
    reward_weight: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token advantages of on-policy distillation (module docstring).

    Args:
        student_logprobs: ``[B, T]`` the student's (sampler's) log-probs of its sampled tokens.
        teacher_logprobs: ``[B, T]`` the teacher's log-probs of the same tokens.
        mask: ``[B, T]`` 1 on valid response tokens.
        reward_advantages: ``[B, T]`` the verifier reward's advantages (needed when ``reward_weight != 0``).
        coef: weight of the reverse-KL term (> 0).
        reward_weight: weight of ``reward_advantages``.

    Returns:
        ``(advantages [B, T], 0 on padding, metrics)``: ``distill/reverse_kl`` (token mean of the k1
        estimate ``log pi_s - log pi_t``), ``distill/reverse_kl_seq_max`` (the largest per-sequence mean),
        ``distill/teacher_logprob_mean``, ``distill/student_logprob_mean``.
    """
    check_ndim("student_logprobs", student_logprobs, 2)
    check_batch(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, mask=mask,
                reward_advantages=reward_advantages)
    if not coef > 0:
        raise ValueError(f"coef must be > 0, got {coef}")
    if reward_weight and reward_advantages is None:
        raise ValueError(f"reward_weight={reward_weight} needs reward_advantages")
    with torch.no_grad():
        m = as_float_mask(mask, student_logprobs)
        valid = m > 0
        zero = torch.zeros((), dtype=m.dtype, device=m.device)
        d = student_logprobs.detach() - teacher_logprobs.detach().to(m.dtype)
        d = torch.nan_to_num(d, nan=0.0, posinf=LOG_CLAMP, neginf=-LOG_CLAMP).clamp(-LOG_CLAMP, LOG_CLAMP)
        d = torch.where(valid, d, zero)
        adv = -coef * d
        if reward_weight:
            adv = adv + reward_weight * torch.where(valid, reward_advantages.detach().to(m.dtype), zero)
        n = m.sum(dim=1)
        per_seq = d.sum(dim=1) / n.clamp(min=1.0)
        finite = lambda x: torch.where(valid, torch.nan_to_num(x.detach().to(m.dtype), neginf=-1e4), zero)  # noqa: E731
        metrics = {
            "distill/reverse_kl": masked_mean(d, m),
            "distill/reverse_kl_seq_max": masked_max(per_seq, n > 0),
            "distill/teacher_logprob_mean": masked_mean(finite(teacher_logprobs), m),
            "distill/student_logprob_mean": masked_mean(finite(student_logprobs), m),
        }
    return adv, to_floats(metrics)
