"""REINFORCE++ (Hu 2025): discounted returns of the (KL-penalised) token rewards, whitened over the batch;
and its baseline variant: the group-mean-subtracted outcome reward, whitened over the batch (its KL term
belongs in the loss, as in the paper, so it reads no token rewards)."""

from relayrl.algorithms import advantages as A
from relayrl.algorithms.estimators.base import Advantages, Estimator, token_rewards

_PAPER = "REINFORCE++ (Hu 2025)"

REINFORCE_PP = Estimator("reinforce++", lambda x: Advantages(A.reinforce_pp(token_rewards(x), x.mask, gamma=x.gamma)),
                         paper=_PAPER, reads_token_rewards=True, group_relative=False, params=frozenset({"gamma"}))

REINFORCE_PP_BASELINE = Estimator(
    "reinforce++-baseline", lambda x: Advantages(A.reinforce_pp_baseline(x.rewards, x.group_ids, x.mask)),
    paper=_PAPER, group_relative=False, min_group=2)
