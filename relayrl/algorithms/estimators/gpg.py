"""GPG (Chu et al. 2025): the group-relative advantage scaled by the batch's share of informative responses
(:mod:`relayrl.algorithms.gpg`)."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast


def _gpg(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.gpg import gpg_advantages  # torch: imported when the estimator runs

    adv, _ = gpg_advantages(x.rewards, x.group_ids, normalize_std=x.normalize_std, eps=x.eps)
    return Advantages(broadcast(adv, x.mask))


GPG = Estimator("gpg", _gpg, paper="GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning "
                "(Chu et al. 2025)", min_group=2, group_relative=False, params=frozenset({"normalize_std"}))
