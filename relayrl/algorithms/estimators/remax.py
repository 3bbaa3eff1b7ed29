"""ReMax (Li et al. 2024): each response's reward minus the reward of the greedy response to its prompt. The
step generates and scores that greedy response (``baseline=True``)."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast


def _remax(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import remax  # torch: imported when the estimator runs (package docstring)

    return Advantages(broadcast(remax(x.rewards, x.baseline), x.mask))


REMAX = Estimator("remax", _remax, paper="ReMax (Li et al. 2024)", baseline=True)
