"""GRPO (Shao et al. 2024, DeepSeekMath) and Dr.GRPO (Liu et al. 2025): the group-normalised outcome reward.
Dr.GRPO drops the division by the group's std (``algorithm.normalize_std`` does not apply to it)."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast


def _grpo(x: EstimatorInputs, normalize_std: bool) -> Advantages:
    from relayrl.algorithms.advantages import grpo  # torch: imported when an estimator runs (package docstring)

    return Advantages(broadcast(grpo(x.rewards, x.group_ids, normalize_std=normalize_std, eps=x.eps), x.mask))


GRPO = Estimator("grpo", lambda x: _grpo(x, x.normalize_std),
                 paper="DeepSeekMath (Shao et al. 2024)", min_group=2, params=frozenset({"normalize_std"}))

DRGRPO = Estimator("drgrpo", lambda x: _grpo(x, False), paper="Dr.GRPO (Liu et al. 2025)", min_group=2)
