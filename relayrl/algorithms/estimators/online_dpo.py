"""Online DPO (Guo et al. 2024; Lanchantin et al. 2025, arXiv 2506.21495; TRL's ``OnlineDPOTrainer``): each prompt
group's best and worst response as a DPO pair, DPO's gradient as each response's advantage
(:mod:`relayrl.algorithms.online_dpo`, whose docstring says why it is an estimator and where it departs).

It reads the policy's log-probs before the update (``old_logprobs``: the step plan runs the pi_old pass) and the
reference's (``reference``: the step builds a reference with ``algorithm.kl_coef=0``), waits for the whole batch
(the advantages scale by the batch's pair count), and its advantages are DPO's gradient only under
``policy_loss=gpg`` with ``loss_agg=seq-mean-token-sum`` (``own_loss``: the config refuses the rest)."""

from __future__ import annotations

from relayrl.algorithms.estimators.base import Advantages, DPOSpec, Estimator, EstimatorInputs

__all__ = ["DPOSpec", "ONLINE_DPO"]


def _online_dpo(x: EstimatorInputs) -> Advantages:
    from dataclasses import asdict

    from relayrl.algorithms.online_dpo import online_dpo_advantages  # torch: imported when it runs

    adv, metrics = online_dpo_advantages(x.logprobs, x.ref_logprobs, x.mask, x.rewards, x.group_ids,
                                         **asdict(x.dpo or DPOSpec()))
    return Advantages(adv, metrics=metrics)


ONLINE_DPO = Estimator("online-dpo", _online_dpo, paper="Direct Language Model Alignment from Online AI Feedback "
                       "(Guo et al. 2024); Bridging Offline and Online Reinforcement Learning for LLMs (Lanchantin et "
                       "al. 2025, arXiv 2506.21495)", min_group=2, group_relative=False, old_logprobs=True,
                       reference=True, own_loss="DPO", params=frozenset({"online_dpo"}))
