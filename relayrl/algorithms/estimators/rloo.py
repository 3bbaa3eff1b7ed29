"""RLOO (Ahmadian et al. 2024): each response's reward minus the mean of the other responses to its prompt; and
``grpo-loo``, NeMo-RL's default GRPO advantage: that difference divided by the other responses' std
(``algorithm.normalize_std``; false: RLOO's)."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast


def _rloo(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import rloo  # torch: imported when the estimator runs (package docstring)

    return Advantages(broadcast(rloo(x.rewards, x.group_ids), x.mask))


RLOO = Estimator("rloo", _rloo, paper="Back to Basics: REINFORCE-style optimization (Ahmadian et al. 2024)",
                 min_group=2, group_baseline=True)


def _grpo_loo(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import grpo_loo

    return Advantages(broadcast(grpo_loo(x.rewards, x.group_ids, normalize_std=x.normalize_std, eps=x.eps), x.mask))


GRPO_LOO = Estimator("grpo-loo", _grpo_loo, paper="NeMo-RL's GRPO with use_leave_one_out_baseline (RLOO's baseline, "
                     "Ahmadian et al. 2024)", min_group=2, group_baseline=True, params=frozenset({"normalize_std"}))
