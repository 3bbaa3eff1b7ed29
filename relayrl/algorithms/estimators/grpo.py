"""GRPO (Shao et al. 2024, DeepSeekMath) and Dr.GRPO (Liu et al. 2025): the group-normalised outcome reward.
Dr.GRPO drops the division by the group's std (``algorithm.normalize_std`` does not apply to it);
``grpo-batch-std`` divides by the whole batch's std instead (Lite PPO; TRL's ``scale_rewards="batch"``), so it
waits for the whole batch."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast


def _grpo(x: EstimatorInputs, normalize_std: bool) -> Advantages:
    from relayrl.algorithms.advantages import grpo  # torch: imported when an estimator runs (package docstring)

    return Advantages(broadcast(grpo(x.rewards, x.group_ids, normalize_std=normalize_std, eps=x.eps), x.mask))


GRPO = Estimator("grpo", lambda x: _grpo(x, x.normalize_std),
                 paper="DeepSeekMath (Shao et al. 2024)", min_group=2, group_baseline=True,
                 params=frozenset({"normalize_std"}))

DRGRPO = Estimator("drgrpo", lambda x: _grpo(x, False), paper="Dr.GRPO (Liu et al. 2025)", min_group=2,
                   group_baseline=True)


def _grpo_batch_std(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import grpo_batch_std

    return Advantages(broadcast(grpo_batch_std(x.rewards, x.group_ids, eps=x.eps), x.mask))


GRPO_BATCH_STD = Estimator("grpo-batch-std", _grpo_batch_std, paper="Lite PPO (Liu et al. 2025, Tricks or Traps)",
                           min_group=2, group_relative=False, group_baseline=True)
