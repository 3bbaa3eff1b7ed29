"""OPO (Hao et al. 2025): the length-weighted group mean as the baseline, and Pass@k (Walder and Karkhanis 2025):
only each group's best response learns, by its margin over the second best."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast


def _opo(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import opo  # torch: imported when the estimator runs (package docstring)

    return Advantages(broadcast(opo(x.rewards, x.group_ids, x.mask.sum(dim=1)), x.mask))


OPO = Estimator("opo", _opo, paper="On-Policy RL with Optimal Reward Baseline (Hao et al. 2025)", min_group=2,
                group_baseline=True)


def _passk(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import grpo_passk

    return Advantages(broadcast(grpo_passk(x.rewards, x.group_ids, normalize_std=x.normalize_std, eps=x.eps),
                                x.mask))


GRPO_PASSK = Estimator("grpo-passk", _passk, paper="Pass@K Policy Optimization (Walder and Karkhanis 2025)",
                       min_group=2, params=frozenset({"normalize_std"}))
