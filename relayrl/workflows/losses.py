"""Loss functions the workflows hand to training engines, composed from ``relayrl.algorithms``.

Each is a small picklable object (it may travel to a worker process) whose
``__call__(MicroBatch) -> (loss, metrics)`` follows the engine's contract: the
loss of a micro-batch is normalised by the mini-batch's *global* counts, so
gradient accumulation over micro-batches and ranks is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relayrl.algorithms.kl import kl_loss
from relayrl.algorithms.losses import aggregate, policy_loss
from relayrl.algorithms.mismatch import logprob_error
from relayrl.algorithms.offpolicy import truncated_is_weights
from relayrl.algorithms.sft import sft_loss
from relayrl.engines.training.base import MicroBatch

__all__ = ["PolicyLoss", "SFTLoss"]


@dataclass(frozen=True)
class PolicyLoss:
    """PPO-clip surrogate (+ KL to the reference, - entropy bonus), GRPO/DAPO by configuration.

    Fields read from the micro-batch: ``advantages`` [B, T], ``old_logprobs``
    [B, T] when present (otherwise the current log-probs, detached: exactly
    on-policy, ratio 1, for one update per batch), ``ref_logprobs`` [B, T] when
    ``kl_coef > 0`` and the KL is a loss term, ``gen_logprobs`` [B, T] for the
    train/generation mismatch metric and, with ``tis_cap``, for truncated
    importance weights ``min(pi_old / mu, tis_cap)`` on the token losses
    (decoupled PPO for stale rollouts: clip against ``pi_old``, correct for
    ``mu``).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "seq-mean-token-mean"
    level: str = "token"
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    agg_constant: float | None = None
    tis_cap: float | None = None
    old_key: str = "old_logprobs"
    """field holding pi_old (``gen_logprobs``: the rollout engine's log-probs)"""

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        f = mb.fields
        old = f[self.old_key] if self.old_key in f else mb.logprobs.detach()
        counts = dict(global_tokens=mb.global_tokens, global_seqs=mb.global_seqs, constant=self.agg_constant)
        is_weights, is_metrics = None, {}
        if self.tis_cap is not None:  # the rollout policy mu sampled the tokens; the ratio is taken against pi_old
            if self.old_key not in f or "gen_logprobs" not in f:
                raise ValueError(f"tis_cap needs {self.old_key} and gen_logprobs in the batch")
            is_weights, is_metrics = truncated_is_weights(old, f["gen_logprobs"], mb.mask, cap=self.tis_cap)
        loss, metrics = policy_loss(
            mb.logprobs, old, f["advantages"], mb.mask,
            clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
            agg=self.agg, level=self.level, is_weights=is_weights, **counts,
        )
        metrics.update(is_metrics)
        if self.kl_coef > 0 and "ref_logprobs" in f:
            kl, kl_metrics = kl_loss(mb.logprobs, f["ref_logprobs"], mb.mask, kind=self.kl_kind, agg=self.agg, **counts)
            loss = loss + self.kl_coef * kl
            metrics.update(kl_metrics)
        if mb.entropy is not None:
            ent = aggregate(mb.entropy, mb.mask, self.agg, **counts)
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * ent
            with torch.no_grad():
                metrics["actor/entropy"] = float((mb.entropy * mb.mask).sum() / mb.mask.sum().clamp_min(1))
        if "gen_logprobs" in f:  # train/generation mismatch: against pi_old, or the current (= old) policy
            with torch.no_grad():
                metrics.update(logprob_error(f["gen_logprobs"], old.detach(), mb.mask))
        metrics["actor/loss"] = float(loss.detach())
        return loss, metrics


@dataclass(frozen=True)
class SFTLoss:
    """Masked token cross-entropy on the response tokens."""

    agg: str = "token-mean"

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = sft_loss(mb.logprobs, mb.mask, agg=self.agg,
                                 global_tokens=mb.global_tokens, global_seqs=mb.global_seqs)
        return loss, metrics
