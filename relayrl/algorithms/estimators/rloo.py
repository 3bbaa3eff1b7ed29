"""RLOO (Ahmadian et al. 2024): each response's reward minus the mean of the other responses to its prompt."""

from relayrl.algorithms import advantages as A
from relayrl.algorithms.estimators.base import Advantages, Estimator, broadcast

RLOO = Estimator("rloo", lambda x: Advantages(broadcast(A.rloo(x.rewards, x.group_ids), x.mask)),
                 paper="Back to Basics: REINFORCE-style optimization (Ahmadian et al. 2024)", min_group=2)
