"""Advantage estimators by config name (``algorithm.advantage``): a registry of small records
(:class:`~relayrl.algorithms.estimators.base.Estimator`) that declare what they need and compute.

Adding an estimator that needs only rewards: a file here defining
``MINE = Estimator("mine", lambda x: Advantages(broadcast(my_formula(x.rewards, x.group_ids), x.mask)), paper=...)``
and its line in ``ESTIMATORS`` below; the config accepts ``algorithm.advantage=mine`` and every step mode
runs it (``docs/algorithms.md`` shows it whole). An estimator of a user's own, outside relayrl, is named by
path instead (``algorithm.advantage=path/to/mine.py:MINE``: :mod:`relayrl.algorithms.plugins`), and
:func:`estimator` loads it in whichever process asks.

The registry imports no torch (the config checks read it while a recipe is validated): an estimator's
function imports the formulas of :mod:`relayrl.algorithms.advantages` when it first runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs
from relayrl.algorithms.estimators.gae import GAE
from relayrl.algorithms.estimators.gpg import GPG
from relayrl.algorithms.estimators.online_dpo import ONLINE_DPO
from relayrl.algorithms.estimators.grpo import DRGRPO, GRPO, GRPO_BATCH_STD
from relayrl.algorithms.estimators.opo import GRPO_PASSK, OPO
from relayrl.algorithms.estimators.otb import OTB, OTB_TIR
from relayrl.algorithms.estimators.reinforce import REINFORCE_PP, REINFORCE_PP_BASELINE
from relayrl.algorithms.estimators.remax import REMAX
from relayrl.algorithms.estimators.rloo import GRPO_LOO, RLOO

if TYPE_CHECKING:
    import torch

    from relayrl.algorithms.estimators.online_dpo import DPOSpec

__all__ = ["ESTIMATORS", "Advantages", "Estimator", "EstimatorInputs", "compute", "estimator"]

ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    GRPO,
    DRGRPO,
    RLOO,
    GRPO_LOO,
    REINFORCE_PP,
    REINFORCE_PP_BASELINE,
    REMAX,
    GAE,
    GRPO_BATCH_STD,
    OPO,
    GRPO_PASSK,
    GPG,
    OTB,
    OTB_TIR,
    ONLINE_DPO,
)}


def estimator(name: str) -> Estimator:
    """The estimator registered as ``name``, or a user's at the path ``name`` (``file.py:NAME``,
    ``package.module:NAME``; loaded once per process, :func:`~relayrl.algorithms.plugins.load_estimator`); a
    ValueError lists the valid names (a :class:`~relayrl.plugins.PluginError` says why a path cannot be used)."""
    from relayrl.plugins import is_path

    if name in ESTIMATORS:
        return ESTIMATORS[name]
    if is_path(name):
        from relayrl.algorithms.plugins import load_estimator

        return load_estimator(name)
    raise ValueError(f"unknown advantage estimator {name!r}; valid names: {', '.join(ESTIMATORS)}, or a path to "
                     f"your own (path/to/file.py:NAME, package.module:NAME)")


def compute(name: str, *, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
            token_rewards: torch.Tensor | None = None, values: torch.Tensor | None = None,
            baseline_rewards: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
            normalize_std: bool = True, eps: float = 1e-6, whiten: bool = False,
            logprobs: torch.Tensor | None = None, sum_sq: torch.Tensor | None = None,
            ref_logprobs: torch.Tensor | None = None, dpo: DPOSpec | None = None) -> torch.Tensor:
    """Advantages ``[B, T]`` of estimator ``name`` (shapes as in :class:`EstimatorInputs`); GAE's returns and an
    estimator's metrics are dropped (call the estimator itself for them)."""
    from relayrl.algorithms._checks import check_nonempty, check_rows, check_same_shape

    est = estimator(name)
    check_nonempty("rewards", rewards)
    check_rows("rewards", rewards, "mask", mask)
    check_same_shape(mask=mask, token_rewards=token_rewards, values=values, logprobs=logprobs, sum_sq=sum_sq,
                     ref_logprobs=ref_logprobs)
    return est(EstimatorInputs(rewards, group_ids, mask, token_rewards, values, baseline_rewards, gamma, lam,
                               normalize_std, eps, whiten, logprobs, sum_sq, ref_logprobs, dpo)).advantages
