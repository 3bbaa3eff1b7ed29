"""Critic loss with value clipping, and the explained-variance metric (PPO).

The clipped value loss follows the PPO implementation used for RLHF
(Schulman et al. 2017; Ouyang et al. 2022; DAPO §2, PPO)::

    v_clip = old_v + clip(v - old_v, -clip, clip)
    loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2)

Departures: none in the formula; ``clip=None`` gives the plain squared error.
Explained variance is ``1 - Var(R - V) / Var(R)`` over valid tokens and is NaN
when the returns have zero variance (it is undefined there).
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim, metric_value, to_floats
from relayrl.algorithms._ops import masked_mean
from relayrl.algorithms.aggregation import aggregate

Tensor = torch.Tensor


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    global_tokens: int | None = None,
    global_seqs: int | None = None,
    constant: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss.

    Args:
        values: ``[B, T]`` current critic predictions (requires grad).
        old_values: ``[B, T]`` predictions at rollout time (detached here).
        returns: ``[B, T]`` targets, e.g. GAE returns (detached here).
        mask: ``[B, T]``.
        clip: clip range around ``old_values``; ``None`` disables clipping.
        agg, global_tokens, global_seqs, constant: see
            :func:`relayrl.algorithms.aggregation.aggregate`.

    Returns:
        ``(loss, metrics)`` with ``critic/vf_loss``, ``critic/vf_clip_frac``,
        ``critic/vpred_mean``, ``critic/returns_mean``, ``critic/explained_variance``.
    """
    check_ndim("values", values, 2)
    check_batch(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    m = as_float_mask(mask, values)
    valid = m > 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    old = torch.where(valid, old_values.detach().to(values.dtype), zero)
    target = torch.where(valid, returns.detach().to(values.dtype), zero)
    v = torch.where(valid, values, zero)
    err = (v - target).square()
    if clip is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clip = torch.clamp(v, old - clip, old + clip)  # (v itself inside the range: old + (v - old) is not, by
        # a rounding, and counted as clipped a token that moved less than clip)
        err_clip = (v_clip - target).square()
        per_token = 0.5 * torch.maximum(err, err_clip)
        clipped = err_clip > err
    loss = aggregate(
        per_token, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, constant=constant
    )
    with torch.no_grad():
        metrics = to_floats(
            {
                "critic/vf_loss": loss.detach(),
                "critic/vf_clip_frac": masked_mean((clipped & valid).to(m.dtype), m),
                "critic/vpred_mean": masked_mean(v.detach(), m),
                "critic/returns_mean": masked_mean(target, m),
            }
        )
    metrics["critic/explained_variance"] = explained_variance(values, returns, mask)
    return loss, metrics


_CONSTANT_RTOL = 1e-6  # explained_variance: returns whose std is below this share of their magnitude are constant


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor | float:
    """``1 - Var(R - V) / Var(R)`` over valid tokens of ``[B, T]`` tensors.

    1 is a perfect critic, 0 no better than a constant, negative worse; NaN
    when the returns are constant (or fewer than two valid tokens).

    "Constant" has a tolerance: the returns' standard deviation at most
    ``_CONSTANT_RTOL`` (1e-6) times their largest magnitude. Exact ``var == 0``
    misses constant float64 returns whose mean rounds (``var`` about 1e-33),
    and then ``1 - Var(R - V) / Var(R)`` is about -1e31. A spread below one
    part in a million is under float32's resolution (eps 1.2e-7) after a few
    roundings, so there is no variance a critic could explain.
    """
    check_batch(values=values, returns=returns, mask=mask)
    with torch.no_grad():  # masked sums rather than x[valid]: no host read until the metric is (metric_value)
        valid = mask.bool()
        zero = torch.zeros((), dtype=torch.float64, device=values.device)
        r = torch.where(valid, returns.detach().double(), zero)
        d = r - torch.where(valid, values.detach().double(), zero)
        n = valid.sum()

        def var(x: Tensor) -> Tensor:  # unbiased, over the valid tokens (as torch.var)
            centred = torch.where(valid, x - x.sum() / n.clamp(min=1), zero)
            return centred.square().sum() / (n - 1).clamp(min=1)

        var_r = var(r)
        defined = (n >= 2) & (var_r > (_CONSTANT_RTOL * r.abs().max()) ** 2)
        ev = torch.where(defined, 1.0 - var(d) / torch.where(defined, var_r, 1.0), float("nan"))
        return metric_value(ev)


EV_TERMS = ("_ev/count", "_ev/r_sum", "_ev/r_sq", "_ev/d_sum", "_ev/d_sq")
"""The sums :func:`explained_variance_terms` returns (``d = R - V``): what adds up over micro-batches and ranks
(``_ev/r_abs_max`` beside them, an extreme). Not logged: ``ValueLoss.finish`` turns them into the metric."""


def explained_variance_terms(values: Tensor, returns: Tensor, mask: Tensor) -> dict[str, Tensor | float]:
    """The sums over valid tokens of ``[B, T]`` tensors that :func:`explained_variance_of` turns into
    :func:`explained_variance` once they are added up over the micro-batches (and ranks) of a batch: the
    batch's explained variance, which the mean of its micro-batches' is not (a micro-batch whose returns are
    all equal, one prompt's group of equal rewards, has none: NaN)."""
    check_batch(values=values, returns=returns, mask=mask)
    with torch.no_grad():
        valid = mask.bool()
        zero = torch.zeros((), dtype=torch.float64, device=values.device)
        r = torch.where(valid, returns.detach().double(), zero)
        d = r - torch.where(valid, values.detach().double(), zero)
        sums = (valid.sum().double(), r.sum(), r.square().sum(), d.sum(), d.square().sum())
        out = {k: metric_value(v) for k, v in zip(EV_TERMS, sums)}
        out["_ev/r_abs_max"] = metric_value(r.abs().max() if r.numel() else zero)
        return out


def explained_variance_of(terms: dict[str, float]) -> float:
    """``1 - Var(R - V) / Var(R)`` from the summed :func:`explained_variance_terms` (the same NaN rule as
    :func:`explained_variance`). The sums may all be scaled by one factor (averaged over optimizer steps)."""
    n, r1, r2, d1, d2 = (float(terms[k]) for k in EV_TERMS)
    if n <= 0:
        return float("nan")
    var_r, var_d = r2 / n - (r1 / n) ** 2, d2 / n - (d1 / n) ** 2  # (population: the ratio is the unbiased one's)
    if not var_r > (_CONSTANT_RTOL * float(terms["_ev/r_abs_max"])) ** 2:
        return float("nan")
    return 1.0 - var_d / var_r
