"""Reward-model losses and reward normalisation (InstructGPT, Ouyang et al. 2022; Bradley & Terry 1952).

* :func:`bradley_terry_loss` -- ``-log sigmoid(r_c - r_r - m)``: the negative log-likelihood that the
  chosen response beats the rejected one under the Bradley-Terry model, with an optional margin ``m``
  per pair (Llama 2's margin loss, Touvron et al. 2023: a pair known to differ a lot must be separated
  by more). The mean over the ``N`` pairs.
* :func:`normalize_rewards` -- rewards whitened by the moments it is given (a step's: every reward of the
  earlier steps, :class:`RunningMoments`), then clipped to ``[-clip, clip]``; no moments yet (count 0):
  left as they are, then clipped.

Departures: InstructGPT also normalises the trained RM so reference answers score 0 on average; here
the scale is left as trained and a run may whiten rewards online instead (``reward.normalize``). TRL's
PPO score scaling (``use_score_norm``) adds a step's scores to its running moments and then whitens them by
those, which needs every score of the step first; a step here is whitened by the moments of the steps
before it, frozen at its start, so its groups can be scored and written as they land in any number of
calls, and the step's rewards join the moments in one update at its end (the caller's: the reward engine's
:meth:`~relayrl.engines.reward.engine.RewardEngine.fold_moments`). The first step has none before it: unwhitened.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from relayrl.algorithms._checks import check_batch, check_ndim, to_floats

Tensor = torch.Tensor

__all__ = ["bradley_terry_loss", "RunningMoments", "normalize_rewards"]


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, *,
                       margin: Tensor | float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """Bradley-Terry loss over ``N`` (chosen, rejected) pairs.

    Args:
        chosen_rewards: ``[N]`` scalar scores of the chosen responses.
        rejected_rewards: ``[N]`` scores of the rejected responses.
        margin: ``[N]`` or a float, the margin each pair must clear (0: plain Bradley-Terry).

    Returns:
        ``(loss, metrics)``: ``loss`` the mean of ``-log sigmoid(r_c - r_r - margin)`` (a scalar with
        grad); metrics ``rm/loss``, ``rm/accuracy`` (fraction of pairs with ``r_c > r_r``, the margin not
        counted), ``rm/reward_margin`` (mean ``r_c - r_r``), ``rm/chosen_mean``, ``rm/rejected_mean``.
    """
    check_ndim("chosen_rewards", chosen_rewards, 1)
    margin_t = margin if isinstance(margin, Tensor) else torch.full_like(chosen_rewards, float(margin))
    check_batch(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards, margin=margin_t)
    diff = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(diff - margin_t.to(diff.dtype)).mean()
    with torch.no_grad():
        d = diff.detach().float()
        metrics = to_floats({
            "rm/loss": loss.detach(),
            "rm/accuracy": (d > 0).float().mean(),
            "rm/reward_margin": d.mean(),
            "rm/chosen_mean": chosen_rewards.detach().float().mean(),
            "rm/rejected_mean": rejected_rewards.detach().float().mean(),
        })
    return loss, metrics


class RunningMoments:
    """Count, mean and sum of squared deviations of every value seen (Chan et al.'s parallel Welford
    update, so a batch joins in one step); a plain record, saved with the run as a dict."""

    def __init__(self, count: float = 0.0, mean: float = 0.0, m2: float = 0.0) -> None:
        self.count, self.mean, self.m2 = count, mean, m2

    def update(self, x: Tensor) -> None:
        """Add the values of ``x`` (any shape) as one batch, taken in sorted order: the same values in any
        order give the same moments, bit for bit."""
        n = float(x.numel())
        if n == 0:
            return
        x = x.detach().double().flatten().sort().values
        bm, bv = float(x.mean()), float(x.var(unbiased=False))
        total = self.count + n
        delta = bm - self.mean
        self.mean += delta * n / total
        self.m2 += bv * n + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def state(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load(self, state: dict[str, float]) -> None:
        """Back to :meth:`state`'s moments (a resumed run's)."""
        self.count, self.mean, self.m2 = (float(state[k]) for k in ("count", "mean", "m2"))


def normalize_rewards(rewards: Tensor, moments: RunningMoments | None, *, clip: float | None = None,
                      eps: float = 1e-6) -> tuple[Tensor, dict[str, float]]:
    """Whiten ``rewards`` ``[N]`` by ``moments`` as they are (not updated here), ``(r - mean) / (std + eps)``;
    ``None``: no whitening; moments of nothing yet (count 0): mean 0 and std 1, the rewards as they are. Then
    clip to ``[-clip, clip]`` (``None``: no clipping).

    Returns ``(rewards [N], metrics)`` with ``reward/norm_mean`` and ``reward/norm_std`` (the moments used)
    when whitening, ``reward/clip_frac`` (rows clipped) when clipping.
    """
    check_ndim("rewards", rewards, 1)
    metrics: dict[str, float] = {}
    out = rewards.float()
    if moments is not None:
        mean, std = (moments.mean, moments.std) if moments.count else (0.0, 1.0)
        if moments.count:
            out = (out - mean) / (std + eps)
        metrics.update({"reward/norm_mean": mean, "reward/norm_std": std})
    if clip is not None:
        metrics["reward/clip_frac"] = float((out.abs() > clip).float().mean()) if out.numel() else 0.0
        out = out.clamp(-clip, clip)
    return out, metrics
