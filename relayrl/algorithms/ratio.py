"""The importance ratio ``pi / pi_old`` of the sampled tokens, as every policy loss takes it, its metrics, and the
arguments every policy loss shares (:class:`LossArgs`).

Token level (PPO): ``log r_t = log pi(y_t) - log pi_old(y_t)``. Sequence level (GSPO, Zheng et al. 2025): the
length-normalised sequence ratio ``s_i = exp(mean_t log r_t)`` in its "GSPO-token" form
``sg[s_i] * pi_t / sg[pi_t]``: the value is ``s_i`` on every token and the gradient GSPO's when the advantage is
constant over the sequence. Log-ratios are clamped to ``[-LOG_CLAMP, LOG_CLAMP]`` before ``exp``.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass, fields

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim
from relayrl.algorithms._ops import LOG_CLAMP, masked_mean
from relayrl.algorithms.aggregation import aggregate

Tensor = torch.Tensor

__all__ = ["RATIO_LEVELS", "LossArgs", "RatioTerms", "ratio_terms", "ratio_metrics"]

RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")


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
    """The ratio of ``logprobs`` (``[B, T]``, with grad) to ``old_logprobs`` at ``level`` (:data:`RATIO_LEVELS`)."""
    if level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio level {level!r}; valid levels: {', '.join(RATIO_LEVELS)}")
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


@dataclass(frozen=True)
class LossArgs:
    """The keyword arguments every policy loss of :data:`~relayrl.algorithms.losses.POLICY_LOSSES` takes besides
    its own options (:func:`~relayrl.algorithms.losses.policy_loss` names them in its signature; the others take
    them as ``**common`` and read them through :meth:`of`)."""

    clip_low: float = 0.2
    """the ratio's lower bound is ``1 - clip_low`` (PPO's clip; GMPO: the log-ratio's)."""
    clip_high: float = 0.2
    dual_clip: float | None = None
    """dual-clip PPO's bound for negative advantages (``None``: off)."""
    agg: str = "token-mean"
    """aggregation mode (:data:`~relayrl.algorithms.aggregation.AGG_MODES`)."""
    level: str = "token"
    """``"token"`` (PPO's ratio) or ``"sequence"`` (GSPO's)."""
    is_weights: torch.Tensor | None = None
    """``[B, T]`` further factors on the token losses (a rollout correction, a token selection; detached)."""
    global_tokens: int | None = None
    global_seqs: int | None = None
    constant: float | None = None
    group_tokens: torch.Tensor | None = None
    global_groups: float | None = None
    """normalisers for :func:`~relayrl.algorithms.aggregation.aggregate` (micro-batch and data-parallel
    exactness; the last two for ``agg="prompt-mean-token-mean"``)."""

    @classmethod
    def of(cls, loss: str, common: dict, *, levels: tuple[str, ...] = ("token",), dual_clip: bool = False,
           aggs: tuple[str, ...] | None = None, clip: bool = False) -> "LossArgs":
        """``common`` (a loss's ``**common``) as :class:`LossArgs`; a name it does not know is a TypeError, a
        ``level``, ``dual_clip`` or ``agg`` the loss ``loss`` has no use for a ValueError naming it; with ``clip``
        (the loss clips the ratio) bounds outside ``0 <= clip_low < 1``, ``clip_high >= 0`` too."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(common) - known)
        if unknown:
            raise TypeError(f"{loss} got unexpected keyword argument(s) {', '.join(unknown)}")
        args = cls(**common)
        if args.level not in levels:
            raise ValueError(f"{loss} takes level {' or '.join(map(repr, levels))}, got {args.level!r}")
        if args.dual_clip is not None and not dual_clip:
            raise ValueError(f"{loss} has no dual clip: dual_clip must be None, got {args.dual_clip}")
        if aggs is not None and args.agg not in aggs:
            raise ValueError(f"{loss} takes agg {' or '.join(map(repr, aggs))}, got {args.agg!r}")
        if clip and not 0 <= args.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {args.clip_low}")
        if clip and args.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0, got {args.clip_high}")
        return args

    @staticmethod
    def check(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              is_weights: torch.Tensor | None) -> None:
        """The shapes every policy loss checks first."""
        check_ndim("logprobs", logprobs, 2)
        check_batch(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                    is_weights=is_weights)

    def reduce(self, token_losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The loss: ``token_losses`` times ``is_weights`` (when given), aggregated by ``agg`` with the
        normalisers."""
        if self.is_weights is not None:
            token_losses = token_losses * self.is_weights.detach().to(token_losses.dtype)
        return aggregate(token_losses, mask, self.agg, global_tokens=self.global_tokens,
                         global_seqs=self.global_seqs, constant=self.constant, group_tokens=self.group_tokens,
                         global_groups=self.global_groups)
