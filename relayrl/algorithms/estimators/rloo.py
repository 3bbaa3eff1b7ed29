"""RLOO (Ahmadian et al. 2024): each response's reward minus the mean of the other responses to its prompt."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast


def _rloo(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import rloo  # torch: imported when the estimator runs (package docstring)

    return Advantages(broadcast(rloo(x.rewards, x.group_ids), x.mask))


RLOO = Estimator("rloo", _rloo, paper="Back to Basics: REINFORCE-style optimization (Ahmadian et al. 2024)",
                 min_group=2, group_baseline=True)
