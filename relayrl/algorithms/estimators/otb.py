"""OTB, the Optimal Token Baseline (arXiv 2602.07078; verl's ``optimal_token_baseline``): each token's reward-to-go
minus a per-position group baseline weighted by each response's realized energy
(:mod:`relayrl.algorithms.otb`). It reads the trainer's pre-update log-probs and ``sum_v p_v^2`` per token
(``token_stats``), so the step plan runs the pi_old pass for it."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, token_rewards


def _otb(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.otb import optimal_token_baseline  # torch: imported when it runs (package docstring)

    adv, _ = optimal_token_baseline(token_rewards(x), x.logprobs, x.sum_sq, x.group_ids, x.mask)
    return Advantages(adv)  # (no critic: the returns are not written)


OTB = Estimator("otb", _otb, paper="The Optimal Token Baseline (Li, Xu et al. 2026, arXiv 2602.07078)", reads_token_rewards=True,
                min_group=2, token_stats=True)
