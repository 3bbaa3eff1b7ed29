"""REINFORCE++ (Hu 2025): discounted returns of the (KL-penalised) token rewards, whitened over the batch;
and its baseline variant: the group-mean-subtracted outcome reward, whitened over the batch (its KL term
belongs in the loss, as in the paper, so it reads no token rewards)."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, token_rewards

_PAPER = "REINFORCE++ (Hu 2025)"


def _reinforce_pp(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import reinforce_pp  # torch: imported when it runs (package docstring)

    return Advantages(reinforce_pp(token_rewards(x), x.mask, gamma=x.gamma))


def _reinforce_pp_baseline(x: EstimatorInputs) -> Advantages:
    from relayrl.algorithms.advantages import reinforce_pp_baseline

    return Advantages(reinforce_pp_baseline(x.rewards, x.group_ids, x.mask))


REINFORCE_PP = Estimator("reinforce++", _reinforce_pp, paper=_PAPER, reads_token_rewards=True, group_relative=False,
                         params=frozenset({"gamma"}))

REINFORCE_PP_BASELINE = Estimator("reinforce++-baseline", _reinforce_pp_baseline, paper=_PAPER,
                                  group_relative=False, min_group=2, group_baseline=True)
