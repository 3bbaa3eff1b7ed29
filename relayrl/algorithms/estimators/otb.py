"""OTB, the Optimal Token Baseline (arXiv 2602.07078; verl's ``optimal_token_baseline``): each token's reward-to-go
minus a per-position group baseline weighted by each response's realized energy
(:mod:`relayrl.algorithms.otb`). It reads the trainer's pre-update log-probs and ``sum_v p_v^2`` per token
(``token_stats``), so the step plan runs the pi_old pass for it. ``otb-tir`` (verl's
``tir_optimal_token_baseline``) gives a group's single longest response its reward-to-go past the others'
lengths (``zero_tail``)."""

from functools import partial

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, token_rewards


def _otb(x: EstimatorInputs, *, zero_tail: bool = False) -> Advantages:
    from relayrl.algorithms.otb import optimal_token_baseline  # torch: imported when it runs (package docstring)

    adv, _ = optimal_token_baseline(token_rewards(x), x.logprobs, x.sum_sq, x.group_ids, x.mask,
                                    zero_tail=zero_tail, is_weights=x.is_weights)
    return Advantages(adv)  # (no critic: the returns are not written)


OTB = Estimator("otb", _otb, paper="The Optimal Token Baseline (Li, Xu et al. 2026, arXiv 2602.07078)", reads_token_rewards=True,
                min_group=2, token_stats=True)
OTB_TIR = Estimator("otb-tir", partial(_otb, zero_tail=True), paper="The Optimal Token Baseline (Li, Xu et al. 2026, "
                    "arXiv 2602.07078); verl's tir_optimal_token_baseline", reads_token_rewards=True, min_group=2,
                    token_stats=True)
