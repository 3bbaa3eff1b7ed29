"""ReMax (Li et al. 2024): each response's reward minus the reward of the greedy response to its prompt. The
step generates and scores that greedy response (``baseline=True``)."""

from relayrl.algorithms import advantages as A
from relayrl.algorithms.estimators.base import Advantages, Estimator, broadcast

REMAX = Estimator("remax", lambda x: Advantages(broadcast(A.remax(x.rewards, x.baseline), x.mask)),
                  paper="ReMax (Li et al. 2024)", baseline=True)
