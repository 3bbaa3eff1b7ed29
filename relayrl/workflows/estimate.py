"""Advantages of a step's rows from their columns: the one place the driver programs turn rewards (and
values, reference log-probs, baselines) into per-token advantages.

A pure function over unpadded rows, so the synchronous loop calls it on the whole batch and the streaming
dataflow calls it on each prompt group as it arrives (estimators whose ``NEEDS[...].group_relative`` is
true) or once on the complete batch (batch-whitened estimators: GAE, REINFORCE++).
"""

from __future__ import annotations

from typing import Sequence

import torch

from relayrl.algorithms import advantages as adv_lib
from relayrl.algorithms.kl import kl_penalty_rewards
from relayrl.engines.training.torch_engine import pad_right

__all__ = ["advantage_rows"]


def advantage_rows(a, rewards: torch.Tensor, lengths: Sequence[int], groups: torch.Tensor, *,
                   gen_logprobs: list[torch.Tensor] | None = None, ref_logprobs: list[torch.Tensor] | None = None,
                   values: list[torch.Tensor] | None = None, baseline: torch.Tensor | None = None,
                   ) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
    """``({"advantages": rows[, "returns": rows]}, kl_metrics)`` for rows with outcome ``rewards [N]``.

    ``a`` is the ``algorithm`` config section. With ``a.kl_in_reward`` and reference log-probs given, the
    per-token reward is the outcome at the last token minus ``kl_coef`` x KL (REINFORCE++), and the KL
    metrics come back. GAE (``values`` given) also returns the critic's targets ``returns``.
    """
    mask = pad_right([torch.ones(L) for L in lengths])
    token_rewards, kl_metrics = None, {}
    if a.kl_in_reward and ref_logprobs is not None:
        token_rewards, kl_metrics = kl_penalty_rewards(
            adv_lib.outcome_to_token_rewards(rewards, mask), pad_right(gen_logprobs), pad_right(ref_logprobs),
            mask, a.kl_coef, kind=a.kl_kind)

    def rows(x: torch.Tensor) -> list[torch.Tensor]:
        return [x[i, :L].float() for i, L in enumerate(lengths)]

    if adv_lib.NEEDS[a.advantage].values:  # whitened over the batch, as PPO implementations do
        if token_rewards is None:
            token_rewards = adv_lib.outcome_to_token_rewards(rewards, mask)
        adv, returns = adv_lib.gae(token_rewards, pad_right(values), mask, a.gamma, a.lam, whiten=True)
        return {"advantages": rows(adv), "returns": rows(returns)}, kl_metrics
    adv = adv_lib.compute(a.advantage, rewards=rewards, group_ids=groups, mask=mask, token_rewards=token_rewards,
                          baseline_rewards=baseline, gamma=a.gamma,
                          normalize_std=a.normalize_std and a.advantage != "drgrpo")
    return {"advantages": rows(adv)}, kl_metrics
