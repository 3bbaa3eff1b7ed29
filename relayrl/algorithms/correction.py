"""Rollout correction: the mismatch between the policy that sampled the tokens and the one being trained.

The rollout engine samples each token from its behaviour policy ``mu`` (stale weights in off-policy and
partial-rollout modes, other kernels or a lower precision even on-policy); the policy loss is taken against
``pi_old``, the trainer's policy before the update. One function, :func:`rollout_correction`, gives the
per-token factor ``c [B, T]`` (detached) that multiplies the token losses (``is_weights`` of
:func:`relayrl.algorithms.losses.policy_loss`), from these parts, each optional::

    log-ratio        l_t   = log pi_old(y_t) - log mu(y_t)             (per valid token)
    level  token     log w = l_t                                        TIS / IcePop
           sequence  log w = sum_t l_t     (the product of the ratios)  sequence-level IS
           geometric log w = mean_t l_t    (their geometric mean)       geometric-mean IS
    mode   truncate  w' = min(w, high)                                  Yao et al. 2025 ("TIS")
           mask      w' = w if low <= w <= high else 0                  IcePop (Ling team / AReaL 2025)
    divergence mask  drop token t of sequence i when
           mean      KL_i = mean_t kl_t > threshold                      DeepSeek-V3.2 (2025),
                     [and A_{i,t} < 0 (negative_only)]                   "off-policy sequence masking"
           sum       KL_i = sum_t kl_t > threshold                       verl rollout_rs=seq_sum_k*
           max       KL_i = max_t kl_t > threshold                       verl rollout_rs=seq_max_k*
           token     kl_t > threshold (that token alone)                 verl rollout_rs=token_k*

The factor is ``c = w' * keep`` (``w' = 1`` without a level), 0 on padding. Each part is a pure function of
its own: :func:`log_ratios`, :func:`level_log_weights` (level), :func:`truncate` and :func:`mask_outside`
(mode), :func:`token_kl`, :func:`kl_statistic` and :func:`divergence_mask` (divergence mask).

``kl_t`` is a per-token estimate of ``KL(mu || pi_old)`` from ``l_t``: k1 ``-l_t = log mu - log pi_old``
(the DeepSeek-V3.2 form; unbiased, may be negative), k2 ``l_t^2 / 2`` (never negative, biased) or k3
``r - 1 - l_t`` with ``r = exp(l_t) = pi_old / mu`` (unbiased and never negative); k1 and k3 are unbiased
because the tokens are sampled from ``mu``. With ``kl_low`` (k1 only) the divergence mask also drops below it,
keeping ``[kl_low, threshold]``: verl's two-sided k1 bounds (``rollout_rs_threshold="lower_upper"``,
``kl_low = log lower``, ``threshold = log upper``).

Edge cases (chosen, and tested):

* non-finite log-probs: a log-ratio of ``+inf`` (``mu = 0``) is clamped to ``+20`` (the ratio is capped or
  the token masked), ``-inf`` (``pi_old = 0``) to ``-20`` (weight ~0; masked below ``low``), and ``NaN``
  (both ``-inf``: a token neither policy could sample) is treated as ``-inf``. Sequence sums are clamped to
  ``[-20, 20]`` again, so a long sequence's product never overflows.
* a row without valid tokens: ratio 1, KL 0, never counted among the sequences of the metrics.
* every token masked: the factor is all 0 (the loss is 0, never NaN) and the metrics are finite.

Departures: masked tokens contribute 0 to the policy loss but still count in its normaliser (as a weight of
0 does; the global token counts are fixed before the loss sees a micro-batch), and only the policy-gradient
term is corrected (the KL and entropy terms are not masked). Metrics are over the call's micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim, to_floats
from relayrl.algorithms._ops import LOG_CLAMP, masked_max, masked_mean

Tensor = torch.Tensor

__all__ = ["WEIGHT_LEVELS", "MODES", "MISMATCH_KL_KINDS", "KL_REDUCES", "Correction", "rollout_correction",
           "log_ratios", "token_kl", "level_log_weights", "truncate", "mask_outside", "kl_statistic", "divergence_mask"]

WEIGHT_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
MODES: tuple[str, ...] = ("truncate", "mask")
MISMATCH_KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")
"""The estimates of the rollout mismatch ``KL(mu || pi_old)`` (:func:`token_kl`); not
:data:`relayrl.algorithms.kl.KL_KINDS`, the estimators of the KL to the reference (which add ``abs`` and aliases)."""
KL_REDUCES: tuple[str, ...] = ("mean", "sum", "max", "token")


def log_ratios(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(l [B, T], m [B, T])``: the clamped token log-ratios ``log pi_old - log mu`` (0 on padding; non-finite
    values as the module docstring says) and the float mask."""
    check_ndim("old_logprobs", old_logprobs, 2)
    check_batch(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    m = as_float_mask(mask, old_logprobs)
    d = old_logprobs.detach() - rollout_logprobs.detach().to(old_logprobs.dtype)
    d = torch.nan_to_num(d, nan=-LOG_CLAMP, posinf=LOG_CLAMP, neginf=-LOG_CLAMP).clamp(-LOG_CLAMP, LOG_CLAMP)
    return torch.where(m > 0, d, torch.zeros((), dtype=d.dtype, device=d.device)), m


def token_kl(lr: Tensor, kind: str) -> Tensor:
    """``[B, T]`` per-token estimate ``kind`` (``k1``, ``k2``, ``k3``) of ``KL(mu || pi_old)`` from the token
    log-ratios ``lr [B, T] = log pi_old - log mu`` (module docstring); 0 where ``lr`` is 0 (padding)."""
    if kind == "k1":
        return -lr
    if kind == "k2":
        return 0.5 * lr.square()
    if kind == "k3":
        return torch.expm1(lr) - lr
    raise ValueError(f"unknown kl_kind {kind!r}; valid kinds: {', '.join(MISMATCH_KL_KINDS)}")


def rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor | None = None,
    *,
    level: str | None = "token",
    mode: str = "truncate",
    high: float = 2.0,
    low: float | None = None,
    kl_threshold: float | None = None,
    kl_kind: str = "k1",
    negative_only: bool = False,
    kl_reduce: str = "mean",
    kl_low: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The per-token correction factor of the module docstring and what it did.

    Args:
        old_logprobs: ``[B, T]`` log-probs of the sampled tokens under ``pi_old``.
        rollout_logprobs: ``[B, T]`` the rollout engine's (behaviour, ``mu``) log-probs of the same tokens.
        mask: ``[B, T]`` 1 on valid response tokens.
        advantages: ``[B, T]``; read only with ``negative_only``.
        level: ``"token"``, ``"sequence"``, ``"geometric"`` or ``None`` (no importance weight: only the
            divergence mask).
        mode: ``"truncate"`` (cap at ``high``) or ``"mask"`` (drop outside ``[low, high]``).
        high: upper bound of the weight (> 0).
        low: lower bound, mask mode only (default ``1 / high``); 0 masks only above ``high``.
        kl_threshold: drop sequences (or tokens) whose ``KL(mu || pi_old)`` estimate, reduced by
            ``kl_reduce``, exceeds it (``None``: off).
        kl_kind: ``"k1"``, ``"k2"`` or ``"k3"``, the per-token estimate (:func:`token_kl`).
        negative_only: the divergence mask drops only tokens with a negative advantage (DeepSeek-V3.2).
        kl_reduce: ``"mean"``, ``"sum"`` or ``"max"`` of the per-token estimates over a sequence's valid
            tokens (the whole sequence is dropped above ``kl_threshold``), or ``"token"`` (each token is
            dropped on its own estimate).
        kl_low: with ``kl_kind="k1"`` and ``kl_threshold``, also drop where the reduced estimate is below it.

    Returns:
        ``(factor [B, T] detached, metrics)``, metrics (this call's tokens; fractions of valid tokens or of
        sequences with a valid token): ``correction/ratio_mean``, ``correction/ratio_max`` (the level's
        ratio before the correction; the token ratio without a level), ``correction/weight_mean`` (the
        factor), ``correction/token_capped_frac``, ``correction/token_masked_frac`` (factor 0 on a valid
        token, by either mask), ``correction/seq_capped_frac``, ``correction/seq_masked_frac`` (every
        token masked), ``correction/kl_k1``, ``correction/kl_k3`` (token means of ``KL(mu || pi_old)``),
        ``correction/seq_kl_max`` (the largest value compared with ``kl_threshold``: of a sequence's
        ``kl_reduce``, of a token with ``token``; computed without a threshold too) and
        ``correction/kl_masked_frac`` (tokens dropped by the divergence mask).
    """
    _check(level, mode, high, low, kl_threshold, kl_kind, kl_reduce, kl_low, negative_only, advantages)
    with torch.no_grad():
        lr, m = log_ratios(old_logprobs, rollout_logprobs, mask)
        if advantages is not None:
            check_batch(old_logprobs=old_logprobs, advantages=advantages)
        valid = m > 0
        log_w = level_log_weights(lr, m, level)
        no_token = torch.zeros_like(valid)
        if level is None:
            weight, capped, out = torch.ones_like(lr), no_token, no_token
        elif mode == "truncate":
            (weight, capped), out = truncate(log_w, valid, high), no_token
        else:
            (weight, out), capped = mask_outside(log_w, valid, high, low), no_token
        stat, kl_max = kl_statistic(token_kl(lr, kl_kind), m, kl_reduce)
        dropped = no_token if kl_threshold is None else divergence_mask(
            stat, valid, kl_threshold, kl_low, advantages if negative_only else None)
        factor = torch.where(dropped, torch.zeros((), dtype=m.dtype, device=m.device), weight) * m
        metrics = _metrics(lr, m, torch.exp(log_w), factor, capped, (out | dropped) & valid, dropped, kl_max)
    return factor, to_floats(metrics)


def _check(level: str | None, mode: str, high: float, low: float | None, kl_threshold: float | None, kl_kind: str,
           kl_reduce: str, kl_low: float | None, negative_only: bool, advantages: Tensor | None) -> None:
    """:func:`rollout_correction`'s settings, refused with the reason."""
    if level is not None and level not in WEIGHT_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(WEIGHT_LEVELS)} (or None)")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if kl_kind not in MISMATCH_KL_KINDS:
        raise ValueError(f"unknown kl_kind {kl_kind!r}; valid kinds: {', '.join(MISMATCH_KL_KINDS)}")
    if kl_reduce not in KL_REDUCES:
        raise ValueError(f"unknown kl_reduce {kl_reduce!r}; valid reductions: {', '.join(KL_REDUCES)}")
    if not high > 0:
        raise ValueError(f"high must be > 0, got {high}")
    if low is not None and not 0 <= low <= high:
        raise ValueError(f"low must be in [0, high={high}], got {low}")
    if low is not None and mode == "truncate":
        raise ValueError("low bounds the mask mode; truncation caps the weight at high only")
    if negative_only and advantages is None:
        raise ValueError("negative_only needs the advantages")
    if kl_threshold is not None and not kl_threshold >= 0:
        raise ValueError(f"kl_threshold must be >= 0, got {kl_threshold}")
    if kl_low is not None and (kl_threshold is None or kl_kind != "k1" or not kl_low < kl_threshold):
        raise ValueError(f"kl_low={kl_low} needs kl_kind='k1' and a kl_threshold above it (got kl_kind={kl_kind!r}, "
                         f"kl_threshold={kl_threshold})")


def level_log_weights(lr: Tensor, m: Tensor, level: str | None) -> Tensor:
    """``log w [B, T]`` at ``level`` from the token log-ratios ``lr [B, T]`` and the float mask ``m [B, T]``: ``lr``
    itself (``token``, and ``None``, whose ratio the metrics report), or the sequence's sum (``sequence``) or mean
    (``geometric``) of it, clamped to ``[-20, 20]`` and broadcast over the sequence."""
    if level is None or level == "token":
        return lr
    seq = lr.sum(dim=1)
    if level == "geometric":
        seq = seq / m.sum(dim=1).clamp(min=1.0)
    return seq.clamp(-LOG_CLAMP, LOG_CLAMP).unsqueeze(1).expand_as(lr)


def truncate(log_w: Tensor, valid: Tensor, high: float) -> tuple[Tensor, Tensor]:
    """TIS: ``(min(w, high) [B, T], capped [B, T])``, capped: the valid tokens whose ``w`` was above ``high``."""
    return torch.exp(log_w.clamp(max=math.log(high))), (log_w > math.log(high)) & valid


def mask_outside(log_w: Tensor, valid: Tensor, high: float, low: float | None) -> tuple[Tensor, Tensor]:
    """IcePop: ``(w or 0 [B, T], out [B, T])``, 0 on the valid tokens whose ``w`` is outside ``[low, high]``
    (``low``: ``1 / high`` by default; 0 drops only above ``high``)."""
    lo = 1.0 / high if low is None else low
    log_lo = math.log(lo) if lo > 0 else -math.inf
    out = ((log_w > math.log(high)) | (log_w < log_lo)) & valid
    return torch.where(out, torch.zeros((), dtype=log_w.dtype, device=log_w.device), torch.exp(log_w)), out


def kl_statistic(per_tok: Tensor, m: Tensor, reduce: str) -> tuple[Tensor, Tensor]:
    """``(stat, largest)``: what the divergence mask compares with its threshold, from the per-token estimates
    ``per_tok [B, T]``: each token's own (``token``: ``[B, T]``) or its sequence's ``mean``, ``sum`` or ``max``
    over the valid tokens of ``m [B, T]`` (``[B, 1]``, 0 for a row without any); ``largest`` is the largest of
    them (of the rows with a valid token)."""
    valid = m > 0
    if reduce == "token":
        return per_tok, masked_max(per_tok, valid)
    n_tok = m.sum(dim=1)
    has_tok = n_tok > 0
    if reduce == "max":
        seq_kl = torch.where(valid, per_tok, torch.full((), -math.inf, dtype=m.dtype, device=m.device))
        seq_kl = torch.where(has_tok, seq_kl.amax(dim=1), torch.zeros((), dtype=m.dtype, device=m.device))
    else:
        seq_kl = (per_tok * m).sum(dim=1)
        if reduce == "mean":
            seq_kl = seq_kl / n_tok.clamp(min=1.0)
    return seq_kl.unsqueeze(1), masked_max(seq_kl, has_tok)


def divergence_mask(stat: Tensor, valid: Tensor, threshold: float, low: float | None,
                    advantages: Tensor | None) -> Tensor:
    """``[B, T]`` the valid tokens to drop: where ``stat`` (:func:`kl_statistic`, broadcast) is above
    ``threshold`` or below ``low``; with ``advantages`` (``negative_only``) only those with ``A < 0``."""
    over = stat > threshold if low is None else (stat > threshold) | (stat < low)
    dropped = over & valid
    return dropped if advantages is None else dropped & (advantages.detach() < 0)


def _metrics(lr: Tensor, m: Tensor, ratio: Tensor, factor: Tensor, capped: Tensor, masked: Tensor, dropped: Tensor,
             kl_max: Tensor) -> dict[str, Tensor]:
    """:func:`rollout_correction`'s metrics (its docstring) from its parts, each ``[B, T]`` but ``kl_max``."""
    valid = m > 0
    n_tok = m.sum(dim=1)
    seqs = (n_tok > 0).to(m.dtype)
    n_seqs = seqs.sum().clamp(min=1.0)
    seq_all_masked = ((masked.sum(dim=1) == n_tok) & (n_tok > 0)).to(m.dtype)
    return {
        "correction/ratio_mean": masked_mean(ratio, m),
        "correction/ratio_max": masked_max(ratio, valid, empty=1.0),
        "correction/weight_mean": masked_mean(factor, m),
        "correction/token_capped_frac": masked_mean(capped.to(m.dtype), m),
        "correction/token_masked_frac": masked_mean(masked.to(m.dtype), m),
        "correction/seq_capped_frac": (capped.any(dim=1).to(m.dtype) * seqs).sum() / n_seqs,
        "correction/seq_masked_frac": seq_all_masked.sum() / n_seqs,
        "correction/kl_k1": masked_mean(token_kl(lr, "k1"), m),
        "correction/kl_k3": masked_mean(token_kl(lr, "k3"), m),
        "correction/seq_kl_max": kl_max,
        "correction/kl_masked_frac": masked_mean(dropped.to(m.dtype), m),
    }


@dataclass(frozen=True)
class Correction:
    """The settings of :func:`rollout_correction` (``algorithm.correction``), picklable, for a loss object."""

    level: str | None = "token"
    mode: str = "truncate"
    high: float = 2.0
    low: float | None = None
    kl_threshold: float | None = None
    kl_kind: str = "k1"
    negative_only: bool = False
    kl_reduce: str = "mean"
    kl_low: float | None = None

    def __call__(self, old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                 advantages: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        return rollout_correction(old_logprobs, rollout_logprobs, mask, advantages, level=self.level,
                                  mode=self.mode, high=self.high, low=self.low, kl_threshold=self.kl_threshold,
                                  kl_kind=self.kl_kind, negative_only=self.negative_only,
                                  kl_reduce=self.kl_reduce, kl_low=self.kl_low)
