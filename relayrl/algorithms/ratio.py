"""The importance ratio ``pi / pi_old`` of the sampled tokens, as every policy loss takes it, and its metrics.

Token level (PPO): ``log r_t = log pi(y_t) - log pi_old(y_t)``. Sequence level (GSPO, Zheng et al. 2025): the
length-normalised sequence ratio ``s_i = exp(mean_t log r_t)`` in its "GSPO-token" form
``sg[s_i] * pi_t / sg[pi_t]``: the value is ``s_i`` on every token and the gradient GSPO's when the advantage is
constant over the sequence. Log-ratios are clamped to ``[-LOG_CLAMP, LOG_CLAMP]`` before ``exp``.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import as_float_mask
from relayrl.algorithms._ops import LOG_CLAMP, masked_mean

Tensor = torch.Tensor

__all__ = ["LEVELS", "RatioTerms", "ratio_terms", "ratio_metrics"]

LEVELS: tuple[str, ...] = ("token", "sequence")


class RatioTerms:
    """What a policy loss needs of a micro-batch: the float mask ``m``, ``valid`` (``m > 0``), the advantages
    (detached, 0 off the mask), the log-ratio (0 off the mask; carries the gradient of ``logprobs``) and the
    ratio ``exp(clamp(log_ratio))``."""

    __slots__ = ("m", "valid", "adv", "log_ratio", "ratio")

    def __init__(self, m: Tensor, valid: Tensor, adv: Tensor, log_ratio: Tensor) -> None:
        self.m, self.valid, self.adv, self.log_ratio = m, valid, adv, log_ratio
        self.ratio = torch.exp(log_ratio.clamp(-LOG_CLAMP, LOG_CLAMP))


def ratio_terms(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                level: str = "token") -> RatioTerms:
    """The ratio of ``logprobs`` (``[B, T]``, with grad) to ``old_logprobs`` at ``level`` (:data:`LEVELS`)."""
    if level not in LEVELS:
        raise ValueError(f"unknown ratio level {level!r}; valid levels: {', '.join(LEVELS)}")
    m = as_float_mask(mask, logprobs)
    valid = m > 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(valid, advantages.detach().to(logprobs.dtype), zero)
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach().to(logprobs.dtype), zero)
    if level == "sequence":
        seq_log_ratio = (log_ratio * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        log_ratio = torch.where(valid, seq_log_ratio.detach().unsqueeze(1) + logprobs - logprobs.detach(), zero)
    return RatioTerms(m, valid, adv, log_ratio)


def ratio_metrics(t: RatioTerms) -> dict[str, Tensor]:
    """``actor/approx_kl`` (k3 estimate ``(r - 1) - log r`` of ``KL(pi_old || pi)``), ``actor/ratio_mean``,
    ``actor/ratio_max``, ``actor/ratio_min`` over the valid tokens (1 when there are none)."""
    with torch.no_grad():
        r, lr = t.ratio.detach(), t.log_ratio.detach()
        r_valid = r[t.valid]
        one = torch.ones((), dtype=r.dtype, device=r.device)
        return {
            "actor/approx_kl": masked_mean(torch.expm1(lr.clamp(-LOG_CLAMP, LOG_CLAMP)) - lr, t.m),
            "actor/ratio_mean": masked_mean(r, t.m),
            "actor/ratio_max": r_valid.max() if r_valid.numel() else one,
            "actor/ratio_min": r_valid.min() if r_valid.numel() else one,
        }
