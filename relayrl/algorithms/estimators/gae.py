"""GAE (Schulman et al. 2016) with a critic, as PPO for RLHF uses it (Ouyang et al. 2022): per-token
advantages from the token rewards and the critic's values, and the critic's targets (``returns``). In a
training step the advantages are whitened over the batch, so they wait for the whole batch."""

from relayrl.algorithms.estimators.base import Advantages, Estimator, token_rewards


def _gae(x) -> Advantages:
    from relayrl.algorithms import advantages as A  # torch: imported when the estimator runs (package docstring)

    adv, returns = A.gae(token_rewards(x), x.values, x.mask, x.gamma, x.lam, whiten=x.whiten)
    return Advantages(adv, returns)


GAE = Estimator("gae", _gae, paper="GAE (Schulman et al. 2016); PPO (Schulman et al. 2017)", values=True,
                reads_token_rewards=True, group_relative=False, params=frozenset({"gamma", "lam"}))
