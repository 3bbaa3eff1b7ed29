"""GRPO (Shao et al. 2024, DeepSeekMath) and Dr.GRPO (Liu et al. 2025): the group-normalised outcome reward.
Dr.GRPO drops the division by the group's std (``algorithm.normalize_std`` does not apply to it)."""

from relayrl.algorithms import advantages as A
from relayrl.algorithms.estimators.base import Advantages, Estimator, broadcast

GRPO = Estimator("grpo", lambda x: Advantages(broadcast(
    A.grpo(x.rewards, x.group_ids, normalize_std=x.normalize_std, eps=x.eps), x.mask)),
    paper="DeepSeekMath (Shao et al. 2024)", min_group=2, params=frozenset({"normalize_std"}))

DRGRPO = Estimator("drgrpo", lambda x: Advantages(broadcast(
    A.grpo(x.rewards, x.group_ids, normalize_std=False, eps=x.eps), x.mask)),
    paper="Dr.GRPO (Liu et al. 2025)", min_group=2)
