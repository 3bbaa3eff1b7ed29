"""Online DPO: DPO on pairs the policy samples itself, one pair per prompt group (Guo et al. 2024, "Direct
Language Model Alignment from Online AI Feedback"; the online and semi-online DPO of Lanchantin et al. 2025,
"Bridging Offline and Online Reinforcement Learning for LLMs", arXiv 2506.21495; TRL's ``OnlineDPOTrainer``).

Each step the policy samples ``n >= 2`` responses per prompt and the reward scores them. Within each prompt group
the response with the highest reward is chosen (``y_w``) and the one with the lowest rejected (``y_l``)
(:func:`best_worst_pairs`). A tie for the highest (or the lowest) reward goes to the row that comes first in the
batch, i.e. in the group's rollout order, which is the order of sampling and says nothing of the text; a group
whose rewards are all equal gives no pair. The loss is :func:`relayrl.algorithms.dpo.dpo_loss` on those pairs,
the mean over the ``P`` pairs of the batch::

    s_i = sum_t log pi(y_i,t),   r_i = sum_t log pi_ref(y_i,t)           (summed over the response's tokens)
    m   = (s_w - r_w) - (s_l - r_l)
    L   = mean_pairs -log sigmoid(beta m)         (dpo_loss's kind=sigmoid; ipo, hinge, apo_zero, apo_down too)
          [+ nll_weight * mean_pairs(-s_w / |y_w|)]                      (RPO's NLL of the chosen, Pang et al. 2024)

**How it trains: DPO's gradient as per-response advantages.** ``L`` depends on the policy only through each
response's summed log-prob ``s_i``, so ``grad L = sum_i g_i grad s_i`` with ``g_i = dL/ds_i`` one number per
response (sigmoid: ``g_w = -beta sigmoid(-beta m) / P``, ``g_l = +beta sigmoid(-beta m) / P``; 0 for a response
in no pair). :func:`online_dpo_coefficients` computes ``g`` by autograd through ``dpo_loss`` itself, from the
policy's log-probs before the update and the reference's, so every kind that function has comes with its exact
coefficients; :func:`online_dpo_advantages` writes ``A_i = -g_i * S`` on every token of response ``i``, ``S`` the
batch's responses. The GRPO pipeline's ratio-free policy-gradient loss (``algorithm.policy_loss=gpg``,
``-A log pi``) summed over each response and averaged over the ``S`` responses
(``algorithm.loss_agg=seq-mean-token-sum``) is then ``sum_i -A_i s_i / S = sum_i g_i s_i``, whose gradient is
DPO's (tested against ``dpo_loss``'s own to 1e-6).

Departures:

* The coefficients come from the pass before the update. With one optimizer step per batch (the default) the
  update is DPO's exactly; with several (``trainer.mini_batches``, ``trainer.epochs``) the later steps keep the
  first margins (DPO would recompute them), and each mini-batch's gradient is its responses' terms scaled to the
  mini-batch (``S / S_k``): an unbiased estimate of the batch's DPO gradient, not the DPO gradient of the pairs
  inside it (a pair's two responses may fall into different mini-batches).
* The loss value DPO's trainers log is ``online_dpo/loss`` here (``L`` at the weights of the update); the policy
  loss's own ``actor/pg_loss`` is the surrogate ``sum_i g_i s_i``, whose gradient, not its value, is DPO's.
* The log-probs (policy and reference) are under ``softmax(logits / rollout.temperature)``, as the trainer's
  every pass in the pipeline; TRL's trainer takes them at temperature 1 (the same with ``rollout.temperature=1``).
* Pairs are best against worst of ``n`` samples (Lanchantin et al.'s choice; TRL samples 2 a prompt). Rewards
  are compared exactly: a group whose rewards differ by any amount gives a pair.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim, check_nonempty, check_rows, to_floats
from relayrl.algorithms.dpo import dpo_loss, preference_metrics

Tensor = torch.Tensor

__all__ = ["best_worst_pairs", "online_dpo_coefficients", "online_dpo_advantages"]

_FROM_DPO = {"dpo/rewards_chosen": "online_dpo/rewards_chosen", "dpo/rewards_rejected": "online_dpo/rewards_rejected",
             "dpo/reward_accuracy": "online_dpo/reward_accuracy", "dpo/reward_margin": "online_dpo/reward_margin",
             "dpo/logps_chosen": "online_dpo/logps_chosen", "dpo/logps_rejected": "online_dpo/logps_rejected"}
"""``dpo_loss``'s figures under online DPO's names (its ``dpo/loss``: ``online_dpo/loss``, with the NLL term)."""


def best_worst_pairs(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, int]:
    """The (chosen, rejected) pair of each prompt group: its highest- and its lowest-reward rows.

    Args:
        rewards: ``[N]`` reward per response (finite).
        group_ids: ``[N]`` integer prompt-group id per response (any integers, any order).

    Returns:
        ``(chosen [P], rejected [P], groups)``: row indexes (long) of the ``P`` pairs, in the order of the groups'
        ids; ``groups`` is the number of groups. A tie goes to the row that comes first; a group whose rewards are
        all equal (a group of one among them) gives no pair.
    """
    check_ndim("rewards", rewards, 1)
    check_batch(rewards=rewards, group_ids=group_ids)
    if group_ids.dtype.is_floating_point:
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        raise ValueError(f"rewards must be finite to rank a group's responses; row {int(bad.nonzero()[0])} is "
                         f"{float(rewards[bad][0])}")
    ids = torch.unique(group_ids)
    chosen, rejected = [], []
    for g in ids.tolist():
        rows = (group_ids == g).nonzero().squeeze(1)  # ascending: the first row of a tie comes first
        r = rewards[rows]
        hi, lo = r.max(), r.min()
        if hi > lo:
            chosen.append(int(rows[(r == hi).nonzero()[0, 0]]))
            rejected.append(int(rows[(r == lo).nonzero()[0, 0]]))
    as_long = dict(dtype=torch.long, device=rewards.device)
    return torch.tensor(chosen, **as_long), torch.tensor(rejected, **as_long), len(ids)


def online_dpo_coefficients(logps: Tensor, ref_logps: Tensor, lengths: Tensor, rewards: Tensor, group_ids: Tensor,
                            *, beta: float = 0.1, kind: str = "sigmoid", label_smoothing: float = 0.0,
                            nll_weight: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """``g = dL/ds`` of each response, ``L`` the DPO loss over the batch's best-worst pairs (module docstring).

    Args:
        logps: ``[N]`` summed log-probs ``s`` of each response under the policy (detached here: the margins).
        ref_logps: ``[N]`` the same under the reference model.
        lengths: ``[N]`` each response's token count (the NLL term's per-token mean).
        rewards, group_ids: ``[N]``, as :func:`best_worst_pairs`.
        beta, kind, label_smoothing: :func:`~relayrl.algorithms.dpo.dpo_loss`'s.
        nll_weight: weight of the chosen responses' NLL ``mean_pairs(-s_w / |y_w|)`` (RPO); 0: none.

    Returns:
        ``(g [N], metrics)``: ``g`` in ``logps``' dtype, 0 on rows in no pair (all 0 when no group gave a pair).
        Metrics: ``online_dpo/pairs``, ``online_dpo/pair_frac`` (the share of groups that gave a pair) and, when
        there is a pair, ``online_dpo/loss`` (``L``), ``online_dpo/reward_accuracy``, ``online_dpo/reward_margin``,
        ``online_dpo/rewards_chosen`` / ``_rejected`` (the implicit rewards ``beta (s - r)``),
        ``online_dpo/logps_chosen`` / ``_rejected``, ``online_dpo/nll_chosen`` and ``online_dpo/score_margin``
        (the mean reward of the chosen minus the rejected).
    """
    check_ndim("logps", logps, 1)
    check_nonempty("logps", logps)
    check_batch(logps=logps, ref_logps=ref_logps, lengths=lengths, rewards=rewards, group_ids=group_ids)
    if nll_weight < 0:
        raise ValueError(f"nll_weight must be >= 0, got {nll_weight}")
    chosen, rejected, groups = best_worst_pairs(rewards, group_ids)
    g = torch.zeros_like(logps)
    counts = {"online_dpo/pairs": float(len(chosen)), "online_dpo/pair_frac": len(chosen) / groups}
    if len(chosen) == 0:
        return g, counts
    with torch.enable_grad():  # (the advantages stage may run under no_grad)
        s = logps.detach().double().requires_grad_(True)
        ref = ref_logps.detach().double()
        loss, m = dpo_loss(s[chosen], s[rejected], ref[chosen], ref[rejected], beta=beta, kind=kind,
                           label_smoothing=label_smoothing)
        nll = (-s[chosen] / lengths[chosen].double().clamp_min(1.0)).mean()
        total = loss + nll_weight * nll if nll_weight else loss
        (grad,) = torch.autograd.grad(total, s)
    g = grad.to(logps.dtype)
    metrics = {_FROM_DPO[k]: v for k, v in m.items() if k in _FROM_DPO}
    metrics["online_dpo/loss"] = float(total.detach())
    metrics.update(to_floats({"online_dpo/nll_chosen": nll.detach(),
                              "online_dpo/score_margin": (rewards[chosen] - rewards[rejected]).mean()}))
    return g, {**counts, **metrics}


def online_dpo_advantages(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor,
                          **options: float | str) -> tuple[Tensor, dict[str, float]]:
    """Per-token advantages ``A_i = -g_i * S`` whose ratio-free loss summed per response and averaged over the
    ``S`` responses (``policy_loss=gpg``, ``loss_agg=seq-mean-token-sum``) has DPO's gradient (module docstring).

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy before the update.
        ref_logprobs: ``[B, T]`` the same under the reference model.
        mask: ``[B, T]`` 1 on the response tokens the loss trains.
        rewards, group_ids: ``[N]`` (``N == B``), as :func:`best_worst_pairs`.
        options: :func:`online_dpo_coefficients`' ``beta``, ``kind``, ``label_smoothing``, ``nll_weight``.

    Returns:
        ``(advantages [B, T], metrics)``: ``A_i`` on every valid token of row ``i`` (0 at masked positions and on
        rows in no pair); ``S`` counts the rows with a valid token, as the aggregation's sequence count does.
    """
    check_batch(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    check_rows("rewards", rewards, "mask", mask)
    m = as_float_mask(mask, logprobs)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lengths = m.sum(dim=1)
    s = torch.where(m > 0, logprobs, zero).sum(dim=1)
    r = torch.where(m > 0, ref_logprobs, zero).sum(dim=1)
    g, metrics = online_dpo_coefficients(s, r, lengths, rewards, group_ids, **options)
    seqs = float((lengths > 0).sum())
    return (-g * seqs).unsqueeze(1) * m, metrics
