"""Advantages of a step's rows from their columns: the one place the driver programs turn rewards (and
values, reference log-probs, baselines) into per-token advantages.

A pure function over unpadded rows, so the synchronous loop calls it on the whole batch and the streaming
dataflow calls it on each prompt group as it arrives (estimators that are ``group_relative``) or once on
the complete batch (batch-whitened ones). It knows no estimator by name: the registered
:class:`~relayrl.algorithms.estimators.Estimator` says what it reads. In a training step the advantages of
estimators with a critic are whitened over the batch, as PPO implementations do.

Multi-turn episodes (``loss_masks`` given): every estimator runs on the model's tokens only. Each row is
squeezed to the tokens its loss mask keeps (the environment's tokens are skipped, not zero-reward steps),
the estimator runs on those rows (GAE's recursion then goes from the last token of one model turn
straight to the first token of the next, and whitening counts model tokens only), and the results are put
back in place with 0 on the environment's tokens (which the loss masks out anyway).

Several reward functions combined by GDPO (``reward.user_aggregation=normalize_then_sum``): the rows carry
each function's score (``fn_scores``), and the estimator's outcome reward is their decoupled sum, computed
here from whole groups, the same in every step mode; the ``rewards`` column (what ``reward/mean`` logs)
stays the weighted sum of the scores.
"""

from __future__ import annotations

from typing import Sequence

import torch

from relayrl.algorithms._ops import pad_right
from relayrl.algorithms.advantages import outcome_to_token_rewards
from relayrl.algorithms.distill import distill_advantages
from relayrl.algorithms.estimators import EstimatorInputs, estimator
from relayrl.algorithms.gdpo import decoupled_rewards
from relayrl.algorithms.kl import kl_penalty_rewards

__all__ = ["advantage_rows", "is_weights"]


def advantage_rows(a, rewards: torch.Tensor, lengths: Sequence[int], groups: torch.Tensor, *,
                   gen_logprobs: list[torch.Tensor] | None = None, ref_logprobs: list[torch.Tensor] | None = None,
                   values: list[torch.Tensor] | None = None, baseline: torch.Tensor | None = None,
                   loss_masks: list[torch.Tensor] | None = None, kl_coef: float | None = None,
                   teacher_logprobs: list[torch.Tensor] | None = None, fn_scores: torch.Tensor | None = None,
                   fn_weights: torch.Tensor | None = None, old_logprobs: list[torch.Tensor] | None = None,
                   sum_sq: list[torch.Tensor] | None = None,
                   ) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
    """``({"advantages": rows[, "returns": rows]}, kl_metrics)`` for rows with outcome ``rewards [N]``.

    ``a`` is the ``algorithm`` config section. With ``a.kl_in_reward`` and reference log-probs given, the
    per-token reward is the outcome at the last token minus ``kl_coef`` x KL (REINFORCE++), and the KL
    metrics come back. GAE (``values`` given) also returns the critic's targets ``returns``.
    ``loss_masks`` (one ``[L_i]`` row of 0/1 per row): compute over the 1 tokens only (module docstring).
    ``kl_coef``: the step's coefficient (an adaptive KL controller's); None: ``a.kl_coef``.
    ``teacher_logprobs`` (on-policy distillation, ``a.distill``): the advantages become the negative
    per-token reverse KL between the student's ``gen_logprobs`` and the teacher's, plus
    ``a.distill.reward_weight`` x the estimator's (:func:`~relayrl.algorithms.distill.distill_advantages`);
    its ``distill/*`` metrics come back with the KL ones.
    ``fn_scores [N, K]`` with ``fn_weights [K]`` (GDPO, ``reward.user_aggregation=normalize_then_sum``): the
    estimator's outcome reward is each function's group-normalised score, weighted and summed
    (:func:`~relayrl.algorithms.gdpo.decoupled_rewards`), in place of ``rewards``.
    ``old_logprobs`` and ``sum_sq`` (estimators with ``token_stats``, OTB): the trainer's pre-update log-probs of
    the sampled tokens and ``sum_v p_v^2`` per token; with ``a.correction`` on and ``gen_logprobs`` given, the
    estimator also gets the correction's per-token factor (:func:`is_weights`). An estimator with ``reference``
    (online DPO) reads ``ref_logprobs`` and ``old_logprobs``; its own metrics come back with the KL ones.
    """
    if fn_scores is not None:
        rewards = decoupled_rewards(fn_scores, fn_weights, groups)
    if loss_masks is not None:
        keep = [m.bool() for m in loss_masks]
        for i, (k, L) in enumerate(zip(keep, lengths)):
            if k.numel() != L:
                raise ValueError(f"row {i}: loss mask of {k.numel()} tokens for a response of {L}")

        def squeeze(rows: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if rows is None else [r[k] for r, k in zip(rows, keep)]

        out, kl_metrics = advantage_rows(a, rewards, [int(k.sum()) for k in keep], groups,
                                         gen_logprobs=squeeze(gen_logprobs), ref_logprobs=squeeze(ref_logprobs),
                                         values=squeeze(values), baseline=baseline, kl_coef=kl_coef,
                                         teacher_logprobs=squeeze(teacher_logprobs),
                                         old_logprobs=squeeze(old_logprobs), sum_sq=squeeze(sum_sq))
        return {name: [_unsqueeze(r, k) for r, k in zip(rows, keep)] for name, rows in out.items()}, kl_metrics
    mask = pad_right([torch.ones(L) for L in lengths])
    token_rewards, kl_metrics = None, {}
    if a.kl_in_reward and ref_logprobs is not None:
        token_rewards, kl_metrics = kl_penalty_rewards(
            outcome_to_token_rewards(rewards, mask), pad_right(gen_logprobs), pad_right(ref_logprobs),
            mask, a.kl_coef if kl_coef is None else kl_coef, kind=a.kl_kind)
    est = estimator(a.advantage)
    padded = {k: None if v is None else pad_right(v) for k, v in (("values", values), ("logprobs", old_logprobs),
                                                                  ("sum_sq", sum_sq))}
    rho = None
    if est.token_stats and a.correction.enabled and gen_logprobs is not None:
        rho = is_weights(a.correction, padded["logprobs"], pad_right(gen_logprobs), mask)
    ref = pad_right(ref_logprobs) if est.reference and ref_logprobs is not None else None
    out = est(EstimatorInputs(rewards, groups, mask, token_rewards=token_rewards, baseline=baseline, gamma=a.gamma,
                              lam=a.lam, normalize_std=a.normalize_std, whiten=est.values, is_weights=rho,
                              ref_logprobs=ref, dpo=a.online_dpo.spec() if "online_dpo" in est.params else None,
                              **padded))
    if out.metrics:  # (the estimator's own figures: online DPO's)
        kl_metrics = {**kl_metrics, **out.metrics}

    advantages = out.advantages
    if teacher_logprobs is not None:
        if gen_logprobs is None:
            raise ValueError("on-policy distillation needs the student's gen_logprobs beside teacher_logprobs")
        d = a.distill
        advantages, distill_metrics = distill_advantages(
            pad_right(gen_logprobs), pad_right(teacher_logprobs), mask, out.advantages.to(mask.dtype),
            coef=d.coef, reward_weight=d.reward_weight)
        kl_metrics = {**kl_metrics, **distill_metrics}

    def rows(x: torch.Tensor) -> list[torch.Tensor]:
        return [x[i, :L].float() for i, L in enumerate(lengths)]

    return {"advantages": rows(advantages),
            **({"returns": rows(out.returns)} if out.returns is not None else {})}, kl_metrics


def is_weights(correction, old_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` the factor ``algorithm.correction`` (``correction``, the config section) gives each token before
    the advantages exist: its importance weight, truncated or masked, and its divergence mask, except that with
    ``negative_only`` (which needs the advantages' signs) the divergence mask is left out."""
    from dataclasses import replace

    spec = correction.spec()
    if spec.negative_only:
        spec = replace(spec, negative_only=False, kl_threshold=None, kl_low=None)
    factor, _ = spec(old_logprobs, gen_logprobs, mask)
    return factor


def _unsqueeze(row: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``row`` (one value per kept token) back at full length, 0 where ``keep`` is False."""
    full = torch.zeros(keep.numel(), dtype=row.dtype)
    full[keep] = row
    return full
