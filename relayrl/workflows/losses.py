"""Loss functions the workflows hand to training engines, composed from ``relayrl.algorithms``.

Each is a small picklable object (it may travel to a worker process) whose
``__call__(MicroBatch) -> (loss, metrics)`` follows the engine's contract: the
loss of a micro-batch is normalised by the mini-batch's *global* counts, so
gradient accumulation over micro-batches and ranks is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relayrl.algorithms._checks import metric_value
from relayrl.algorithms.correction import Correction
from relayrl.algorithms.cpo import cpo_loss
from relayrl.algorithms.dpo import dpo_loss
from relayrl.algorithms.names import AVERAGED_KINDS, KTO_LOSSES, REFERENCE_FREE_KINDS, SMOOTHED_KINDS
from relayrl.algorithms.orpo import orpo_loss
from relayrl.algorithms.entropy import high_entropy_mask
from relayrl.algorithms.kl import kl_loss
from relayrl.algorithms.kto import kto_terms, measured_kinds
from relayrl.algorithms.aggregation import normalized_by
from relayrl.algorithms.losses import aggregate, policy_loss_fn
from relayrl.algorithms.mismatch import logprob_error
from relayrl.algorithms.ratio import ratio_terms
from relayrl.algorithms.reward_model import bradley_terry_loss
from relayrl.algorithms.sft import perplexity, sft_loss
from relayrl.algorithms.simpo import simpo_loss
from relayrl.algorithms.value import EV_TERMS, explained_variance_of, explained_variance_terms, value_loss
from relayrl.engines.training.base import GROUP_TOKENS_FIELD, MicroBatch

__all__ = ["PolicyLoss", "ValueLoss", "SFTLoss", "DPOLoss", "KTOLoss", "BTLoss", "pair_order", "last_values"]


def _check_constant(owner: str, agg: str, constant: float | None,
                    fix: str = "pass agg_constant (Dr.GRPO's maximum response length; the GRPO workflow passes "
                               "rollout.max_new_tokens), or take another agg") -> None:
    """``seq-mean-token-sum-norm`` divides each response's token sum by a constant the loss must be given: left
    to :func:`~relayrl.algorithms.aggregation.aggregate`'s default, each micro-batch's padded width, the loss
    would depend on how the engine cut the rows into micro-batches and data-parallel ranks (one rank and two
    gave losses of 0.075 and 0.188 on one batch)."""
    if agg == "seq-mean-token-sum-norm" and constant is None:
        raise ValueError(f"{owner}(agg='seq-mean-token-sum-norm') divides each response's token sum by a constant: "
                         f"{fix}")


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss (+ KL to the reference, - entropy bonus): PPO-clip (GRPO/DAPO/GSPO by configuration)
    or another of :data:`~relayrl.algorithms.losses.POLICY_LOSSES` (``kind``: CISPO, SAPO, VESPO, Clip-Cov,
    KL-Cov, GMPO) or a user's (``kind`` a path), with an optional rollout correction and an optional selection
    of the high-entropy tokens (``top_entropy``).

    Fields read from the micro-batch: ``advantages`` [B, T], ``old_logprobs``
    [B, T] when present (otherwise the current log-probs, detached: exactly
    on-policy, ratio 1, for one update per batch), ``ref_logprobs`` [B, T] when
    there is a reference model (a loss term when ``kl_coef > 0``; with the KL in the rewards,
    ``kl_coef=0``, only the ``actor/ref_kl_k1`` metric), ``gen_logprobs`` [B, T] for the
    train/generation mismatch metric and, with a ``correction``, for the factor
    :func:`~relayrl.algorithms.correction.rollout_correction` puts on the token losses
    (importance weights ``pi_old / mu`` truncated or masked, divergent sequences dropped: decoupled PPO
    for stale rollouts, clip against ``pi_old``, correct for ``mu``).
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
    kind: str = "ppo"
    """The policy loss by name (:data:`relayrl.algorithms.losses.POLICY_LOSSES`), or a user's by path
    (``file.py:fn``): the loss travels with the path and each process that calls it loads the function itself
    (:func:`~relayrl.algorithms.losses.policy_loss_fn`)."""
    correction: Correction | None = None
    old_key: str = "old_logprobs"
    """field holding pi_old (``gen_logprobs``: the rollout engine's log-probs)"""
    options: tuple[tuple[str, Any], ...] = ()
    """the policy loss's own options by keyword (SAPO's temperatures, VESPO's kernel, the covariance losses', a
    user loss's ``algorithm.policy_loss_options``)"""
    top_entropy: float = 1.0
    """keep in the policy loss and the entropy bonus only the tokens in the top fraction of the micro-batch's
    by entropy (:func:`~relayrl.algorithms.entropy.high_entropy_mask`); 1: every token"""
    kl_ratio_weighted: bool = False
    """weigh the KL term's tokens by ``pi / pi_old`` (the unbiased estimate, :func:`~relayrl.algorithms.kl.kl_loss`)"""

    def __post_init__(self) -> None:
        _check_constant("PolicyLoss", self.agg, self.agg_constant)

    @property
    def normalized_by(self) -> str:
        """The global count every term (policy loss, KL term, entropy bonus) divides by: ``agg``'s (``"groups"``
        for ``prompt-mean-token-mean``, which also reads the ``group_tokens`` field the engine fills)."""
        return normalized_by(self.agg)

    @staticmethod
    def trainer_logprobs(mb: MicroBatch) -> torch.Tensor:
        """The trainer's log-probs of the sampled tokens [B, T] that ``rollout/logprob_error`` compares with the
        generator's: the recomputed ``old_logprobs`` (the weights before this batch's update) when the batch
        carries them, else the current policy's (detached). Never ``pi_old`` as such: with
        ``old_logprobs=rollout`` pi_old *is* the generator's, and the metric would be 1.0 by construction."""
        return (mb.fields["old_logprobs"] if "old_logprobs" in mb.fields else mb.logprobs).detach()

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        f = mb.fields
        old = f[self.old_key] if self.old_key in f else mb.logprobs.detach()
        counts = dict(global_tokens=mb.global_tokens, global_seqs=mb.global_seqs, constant=self.agg_constant,
                      group_tokens=f.get(GROUP_TOKENS_FIELD), global_groups=mb.global_groups)
        is_weights, is_metrics = None, {}
        if self.correction is not None:  # the rollout policy mu sampled the tokens; the ratio is taken against pi_old
            if "gen_logprobs" not in f:
                raise ValueError("the rollout correction needs gen_logprobs (the rollout's log-probs) in the batch")
            is_weights, is_metrics = self.correction(old, f["gen_logprobs"], mb.mask, f["advantages"])
        kept = None
        if self.top_entropy < 1.0:  # the high-entropy ("forking") tokens only
            if mb.entropy is None:
                raise ValueError("top_entropy < 1 selects tokens by entropy: the engine must compute it (with_entropy)")
            kept, kept_metrics = high_entropy_mask(mb.entropy, mb.mask, self.top_entropy)
            is_weights = kept if is_weights is None else is_weights * kept
            is_metrics = {**is_metrics, **kept_metrics}
        loss, metrics = policy_loss_fn(self.kind)(
            mb.logprobs, old, f["advantages"], mb.mask,
            clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
            agg=self.agg, level=self.level, is_weights=is_weights, **counts, **dict(self.options),
        )
        metrics.update(is_metrics)
        if self.kl_coef > 0 and "ref_logprobs" in f:
            ratio = (ratio_terms(mb.logprobs, old, f["advantages"], mb.mask, self.level).ratio
                     if self.kl_ratio_weighted else None)
            kl, kl_metrics = kl_loss(mb.logprobs, f["ref_logprobs"], mb.mask, kind=self.kl_kind, agg=self.agg,
                                     ratio=ratio, **counts)
            loss = loss + self.kl_coef * kl
            metrics.update(kl_metrics)
        elif "ref_logprobs" in f:  # the KL is in the rewards (kl_in_reward): report the same k1 estimate, no loss
            with torch.no_grad():
                _, kl_metrics = kl_loss(mb.logprobs, f["ref_logprobs"], mb.mask, kind="k1", agg=self.agg, **counts)
            metrics["actor/ref_kl_k1"] = kl_metrics["actor/ref_kl_k1"]
        if mb.entropy is not None:
            ent = aggregate(mb.entropy if kept is None else mb.entropy * kept, mb.mask, self.agg, **counts)
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * ent
            with torch.no_grad():
                metrics["actor/entropy"] = metric_value((mb.entropy * mb.mask).sum() / mb.mask.sum().clamp_min(1))
        if "gen_logprobs" in f:  # train/generation mismatch: the trainer's own log-probs against the generator's
            with torch.no_grad():
                metrics.update(logprob_error(f["gen_logprobs"], self.trainer_logprobs(mb), mb.mask))
        metrics["actor/loss"] = metric_value(loss)
        return loss, metrics


@dataclass(frozen=True)
class ValueLoss:
    """The critic's clipped value loss (``relayrl.algorithms.value``) against the ``returns`` field, clipped
    around the ``values`` field (the critic's values when the batch was generated). The engine of a critic
    puts its current values where a policy's log-probs go (``mb.logprobs``). ``critic/explained_variance`` is
    the batch's: each micro-batch gives its sums (:data:`~relayrl.algorithms.value.EV_TERMS`), which the
    engine adds up, and :meth:`finish` turns them into the figure."""

    clip: float | None = 0.5
    agg: str = "token-mean"
    summed: tuple[str, ...] = EV_TERMS

    def __post_init__(self) -> None:
        _check_constant("ValueLoss", self.agg, None, "it takes none; use agg='token-mean' or a seq-mean-* mode")

    @property
    def normalized_by(self) -> str:
        return normalized_by(self.agg)

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = value_loss(mb.logprobs, mb.fields["values"], mb.fields["returns"], mb.mask, clip=self.clip,
                                   agg=self.agg, global_tokens=mb.global_tokens, global_seqs=mb.global_seqs)
        metrics.pop("critic/explained_variance")
        return loss, {**metrics, **explained_variance_terms(mb.logprobs, mb.fields["returns"], mb.mask)}

    @staticmethod
    def finish(metrics: dict[str, float]) -> dict[str, float]:
        """An update's metrics with ``critic/explained_variance`` from the summed terms (which it drops)."""
        if EV_TERMS[0] not in metrics:
            return metrics
        out = {k: v for k, v in metrics.items() if k not in EV_TERMS and k != "_ev/r_abs_max"}
        return {**out, "critic/explained_variance": explained_variance_of(metrics)}


@dataclass(frozen=True)
class SFTLoss:
    """Masked token cross-entropy on the response tokens. Its metrics hold no ``sft/ppl``: the engine's token
    mean of micro-batch perplexities is not the batch's; :meth:`finish` adds it from the reduced ``sft/nll``."""

    agg: str = "token-mean"

    def __post_init__(self) -> None:
        _check_constant("SFTLoss", self.agg, None, "it takes none; use agg='token-mean' or a seq-mean-* mode")

    @property
    def normalized_by(self) -> str:
        return normalized_by(self.agg)

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = sft_loss(mb.logprobs, mb.mask, agg=self.agg,
                                 global_tokens=mb.global_tokens, global_seqs=mb.global_seqs)
        metrics.pop("sft/ppl")
        return loss, metrics

    @staticmethod
    def finish(metrics: dict[str, float]) -> dict[str, float]:
        """An update's metrics with ``sft/ppl``, the perplexity of the batch's token-mean NLL."""
        return {**metrics, "sft/ppl": perplexity(metrics["sft/nll"])} if "sft/nll" in metrics else metrics


_DPO_METRICS = ("dpo/loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/reward_accuracy", "dpo/reward_margin",
                "dpo/logps_chosen", "dpo/logps_rejected", "dpo/nll_chosen", "dpo/log_odds_ratio", "dpo/or_loss")


@dataclass(frozen=True)
class DPOLoss:
    """DPO / IPO / hinge / APO, or the reference-free SimPO / ORPO / CPO, over the (chosen, rejected) pairs of a
    micro-batch.

    Rows come in pairs: field ``pair`` (the pair's id) and ``chosen`` (1 for the
    chosen answer, 0 for the rejected one) per row, ``ref_logp`` the row's summed
    reference log-prob. The reference-free kinds (``reference_free``) read no
    ``ref_logp``; SimPO and ORPO take each row's average per-token log-prob (its sum
    over its ``mask`` count), the others the sums. Both rows of a pair must be in the
    micro-batch (the engine's shared-prompt packing keeps a prompt group together).
    The loss and every metric are this micro-batch's share of the mean over all
    pairs of the mini-batch (``global_seqs / 2``), so the engine sums them.

    ``nll_weight`` > 0 adds the chosen answers' negative log-likelihood (mean
    over pairs of the per-token mean), as in RPO (Pang et al. 2024, TRL's
    ``rpo_alpha``): plain DPO can lower the chosen answers' likelihood along
    with the rejected ones'. With SimPO that is CPO-SimPO, with CPO the CPO paper's
    full loss at ``nll_weight=1`` (TRL's ``cpo_alpha``, default 1); ORPO's loss holds
    that NLL already, and refuses it.
    """

    beta: float = 0.1
    kind: str = "sigmoid"
    label_smoothing: float = 0.0
    nll_weight: float = 0.0
    gamma: float = 0.5
    """SimPO's target reward margin (kind ``simpo`` only)"""
    summed: tuple[str, ...] = _DPO_METRICS

    def __post_init__(self) -> None:
        if self.label_smoothing and self.kind not in SMOOTHED_KINDS:
            raise ValueError(f"label_smoothing is only defined for kind={' or '.join(map(repr, SMOOTHED_KINDS))}, got "
                             f"kind={self.kind!r}")
        if self.kind == "orpo" and self.nll_weight:
            raise ValueError("kind='orpo' holds the chosen answers' NLL already (weight 1): nll_weight must be 0")

    @property
    def reference_free(self) -> bool:
        """Whether the loss reads no reference log-probs (SimPO, ORPO, CPO): the workflow builds no reference."""
        return self.kind in REFERENCE_FREE_KINDS

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        f = mb.fields
        seq_logp = (mb.logprobs * mb.mask).sum(-1)
        c, r = pair_order(f)
        if self.kind in AVERAGED_KINDS:  # length-normalised: the mean log-prob over each answer's tokens
            avg = seq_logp / mb.mask.sum(-1).clamp_min(1)
            loss, metrics = (simpo_loss(avg[c], avg[r], beta=self.beta, gamma=self.gamma) if self.kind == "simpo"
                             else orpo_loss(avg[c], avg[r], beta=self.beta))
        elif self.kind == "cpo":
            loss, metrics = cpo_loss(seq_logp[c], seq_logp[r], beta=self.beta, label_smoothing=self.label_smoothing)
        else:
            loss, metrics = dpo_loss(seq_logp[c], seq_logp[r], f["ref_logp"][c], f["ref_logp"][r], beta=self.beta,
                                     kind=self.kind, label_smoothing=self.label_smoothing)
        share = len(c) / (mb.global_seqs / 2)  # this micro-batch's pairs among the mini-batch's
        nll, _ = sft_loss(mb.logprobs[c], mb.mask[c], agg="seq-mean-token-mean", global_seqs=mb.global_seqs // 2)
        metrics = {k: v * share for k, v in metrics.items()}
        metrics["dpo/nll_chosen"] = metric_value(nll)  # already this micro-batch's share
        loss = loss * share
        if self.nll_weight > 0:
            loss = loss + self.nll_weight * nll
            metrics["dpo/loss"] = metric_value(loss)
        return loss, metrics


_KTO_COUNTS = ("_kto/desirable", "_kto/undesirable")
"""Each kind's examples in the update, summed like the figures and dropped by :meth:`KTOLoss.finish` (which
reads them on the host after the engine's one read, so no micro-batch waits on the device)."""
_KTO_METRICS = ("kto/loss", "kto/kl", "kto/rewards_desirable", "kto/rewards_undesirable", "kto/reward_margin",
                "kto/logps_desirable", "kto/logps_undesirable", "kto/desirable_fraction", *_KTO_COUNTS)


@dataclass(frozen=True)
class KTOLoss:
    """KTO or its unpaired APO-zero (:mod:`relayrl.algorithms.kto`, ``loss``) over the labelled examples of a
    micro-batch, one row each.

    Fields per row: ``desirable`` (1 or 0), ``ref_logp`` (the row's summed reference log-prob), ``kto_kl``
    (with ``loss="kto"`` only: the batch's ``z0``, the same on every row: the workflow estimates it from the batch's
    mismatched rows before the update, :func:`~relayrl.algorithms.kto.kl_estimate`, so it takes no gradient;
    ``apo_zero_unpaired`` is KTO against ``z0 = 0``, reads none and reports no ``kto/kl``), and
    ``n_desirable`` / ``n_undesirable`` (the mini-batch's counts of each kind, the same on every row). The
    loss and every metric are this micro-batch's share of the mean over the mini-batch's examples (the
    rewards and log-probs: over its examples of that kind), so the engine sums them. A kind the update has no
    example of logs no reward and log-prob, and then no margin (:meth:`finish`).
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss: str = "kto"
    """``kto`` or ``apo_zero_unpaired`` (:data:`~relayrl.algorithms.names.KTO_LOSSES`)"""
    summed: tuple[str, ...] = _KTO_METRICS

    def __post_init__(self) -> None:
        if self.loss not in KTO_LOSSES:
            raise ValueError(f"unknown KTO loss {self.loss!r}; valid: {', '.join(KTO_LOSSES)}")

    @property
    def estimates_kl(self) -> bool:
        """Whether the loss reads the batch's KL estimate ``z0`` (field ``kto_kl``): the workflow builds the
        mismatched rows and runs the actor's KL pass only then."""
        return self.loss == "kto"

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        f = mb.fields
        seq_logp = (mb.logprobs * mb.mask).sum(-1)
        d = f["desirable"] > 0.5
        z0 = f["kto_kl"][0] if self.estimates_kl else 0.0
        losses, rewards = kto_terms(seq_logp, f["ref_logp"], z0, d, beta=self.beta,
                                    desirable_weight=self.desirable_weight,
                                    undesirable_weight=self.undesirable_weight)
        n = max(mb.global_seqs, 1)
        n_d, n_u = f["n_desirable"][0].clamp_min(1), f["n_undesirable"][0].clamp_min(1)
        loss = losses.sum() / n
        with torch.no_grad():
            lp = seq_logp.detach()
            r_d, r_u = (rewards * d).sum() / n_d, (rewards * ~d).sum() / n_u
            metrics = {"kto/loss": metric_value(loss),
                       "kto/rewards_desirable": metric_value(r_d), "kto/rewards_undesirable": metric_value(r_u),
                       "kto/reward_margin": metric_value(r_d - r_u),
                       "kto/logps_desirable": metric_value((lp * d).sum() / n_d),
                       "kto/logps_undesirable": metric_value((lp * ~d).sum() / n_u),
                       "kto/desirable_fraction": metric_value(d.sum() / n),
                       "_kto/desirable": metric_value(d.sum()), "_kto/undesirable": metric_value((~d).sum())}
            if self.estimates_kl:
                metrics["kto/kl"] = metric_value(z0 * len(d) / n)
        return loss, metrics

    @staticmethod
    def finish(metrics: dict[str, float]) -> dict[str, float]:
        """An update's metrics without the figures of a kind it had no example of (they would read 0, as if
        measured: :func:`~relayrl.algorithms.kto.measured_kinds`), and without the counts that tell it."""
        if _KTO_COUNTS[0] not in metrics:
            return metrics
        out = {k: v for k, v in metrics.items() if k not in _KTO_COUNTS}
        return measured_kinds(out, metrics[_KTO_COUNTS[0]], metrics[_KTO_COUNTS[1]])


def pair_order(fields: dict, what: str = "DPO") -> tuple[torch.Tensor, torch.Tensor]:
    """Row indexes ``(chosen [N], rejected [N])`` of the pairs of a micro-batch whose rows carry the fields
    ``pair`` (the pair's id) and ``chosen`` (1 for the chosen row, 0 for the rejected one)."""
    pair, chosen = fields["pair"].long(), fields["chosen"] > 0.5
    order = torch.argsort(pair * 2 + (~chosen).long())  # chosen then rejected, pair by pair
    if len(order) % 2 or not (torch.equal(pair[order][0::2], pair[order][1::2])
                              and bool(chosen[order][0::2].all()) and not bool(chosen[order][1::2].any())):
        raise ValueError(f"{what}: a micro-batch holds an incomplete (chosen, rejected) pair; a pair longer than "
                         "engine.token_budget is split by the engine: raise engine.token_budget")
    return order[0::2], order[1::2]


def last_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's value at its last response position (``values``, ``mask`` ``[B, T]``): a reward
    model's score of the whole sequence (:mod:`relayrl.models.reward`)."""
    pos = torch.arange(mask.shape[-1], device=mask.device)
    last = (pos * (mask > 0)).argmax(-1)
    return values.gather(-1, last[:, None]).squeeze(-1)


_RM_METRICS = ("rm/loss", "rm/accuracy", "rm/reward_margin", "rm/chosen_mean", "rm/rejected_mean")


@dataclass(frozen=True)
class BTLoss:
    """Bradley-Terry loss of a reward model (``relayrl.algorithms.reward_model``) over the (chosen,
    rejected) pairs of a micro-batch, laid out as for :class:`DPOLoss` (fields ``pair`` and ``chosen``;
    optional ``margin`` per row, the pair's margin on both rows). The engine of a reward model puts its
    per-position values where a policy's log-probs go; a row's score is the value at its last position.
    The loss and metrics are this micro-batch's share of the mean over the mini-batch's pairs."""

    margin: float = 0.0
    summed: tuple[str, ...] = _RM_METRICS

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        f = mb.fields
        c, r = pair_order(f, "workflow rm")
        scores = last_values(mb.logprobs, mb.mask)
        margin = f["margin"][c] if "margin" in f else self.margin
        loss, metrics = bradley_terry_loss(scores[c], scores[r], margin=margin)
        share = len(c) / (mb.global_seqs / 2)
        return loss * share, {k: v * share for k, v in metrics.items()}
