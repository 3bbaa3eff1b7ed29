"""The names the config accepts for the loss options (``algorithm.loss_agg``, ``algorithm.policy_loss``), kept
apart from the tensor functions they name: the config checks read them while a recipe is validated, before
torch is imported. :mod:`~relayrl.algorithms.aggregation` and :mod:`~relayrl.algorithms.losses` implement them."""

from __future__ import annotations

__all__ = ["AGG_MODES", "POLICY_LOSS_NAMES"]

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
"""``algorithm.loss_agg``: how :func:`~relayrl.algorithms.aggregation.aggregate` reduces token losses."""

POLICY_LOSS_NAMES: tuple[str, ...] = ("ppo", "cispo", "sapo", "vespo", "clip_cov", "kl_cov", "gmpo", "gpg")
"""``algorithm.policy_loss``: the keys of :data:`~relayrl.algorithms.losses.POLICY_LOSSES`, in its order."""
