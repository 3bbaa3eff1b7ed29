"""The names the config accepts for the loss options (``algorithm.loss_agg``, ``algorithm.policy_loss``,
``dpo.kind``, ``kto.loss``), kept apart from the tensor functions they name: the config checks read them while a
recipe is validated, before torch is imported. :mod:`~relayrl.algorithms.aggregation`,
:mod:`~relayrl.algorithms.losses` and the preference losses' modules implement them."""

from __future__ import annotations

__all__ = ["AGG_MODES", "GROUP_AGG_MODES", "POLICY_LOSS_NAMES", "PREFERENCE_KINDS", "REFERENCE_FREE_KINDS",
           "AVERAGED_KINDS", "SMOOTHED_KINDS", "KTO_LOSSES", "RATIO_FREE_LOSSES", "REFERENCE_KINDS"]

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "prompt-mean-token-mean",
)
"""``algorithm.loss_agg``: how :func:`~relayrl.algorithms.aggregation.aggregate` reduces token losses."""

GROUP_AGG_MODES: tuple[str, ...] = ("prompt-mean-token-mean",)
"""The :data:`AGG_MODES` that weigh prompt groups (ScaleRL's prompt-level average): they need each row's group, so
only a GRPO-family step with ``rollout.n >= 2`` can use them."""

POLICY_LOSS_NAMES: tuple[str, ...] = ("ppo", "cispo", "sapo", "vespo", "clip_cov", "kl_cov", "gmpo", "gpg")
"""``algorithm.policy_loss``: the keys of :data:`~relayrl.algorithms.losses.POLICY_LOSSES`, in its order."""

RATIO_FREE_LOSSES: tuple[str, ...] = ("gpg",)
"""The ``algorithm.policy_loss`` values whose gradient takes no ratio ``pi / pi_old`` (GPG's ``-A log pi``): a
batch trained in several mini-batches needs no pi_old pass for them (unless a rollout correction weighs
``pi_old / mu``)."""

PREFERENCE_KINDS: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "apo_zero", "apo_down", "simpo", "orpo", "cpo")
"""``dpo.kind``: the preference losses of :mod:`~relayrl.algorithms.dpo` (with a reference model) and
:mod:`~relayrl.algorithms.simpo` / :mod:`~relayrl.algorithms.orpo` / :mod:`~relayrl.algorithms.cpo` (without one)."""

REFERENCE_FREE_KINDS: tuple[str, ...] = ("simpo", "orpo", "cpo")
"""The ``dpo.kind`` values whose loss needs no reference model: the workflow builds none and runs no reference
pass."""

REFERENCE_KINDS: tuple[str, ...] = tuple(k for k in PREFERENCE_KINDS if k not in REFERENCE_FREE_KINDS)
"""The ``dpo.kind`` values with a reference model (:func:`~relayrl.algorithms.dpo.dpo_loss`'s kinds); online DPO
(``algorithm.online_dpo.kind``) takes these."""

AVERAGED_KINDS: tuple[str, ...] = ("simpo", "orpo")
"""The ``dpo.kind`` values that take each answer's average per-token log-prob (its sum over its token count); the
others take the sums."""

SMOOTHED_KINDS: tuple[str, ...] = ("sigmoid", "cpo")
"""The ``dpo.kind`` values that read ``dpo.label_smoothing`` (conservative DPO's ``eps``)."""

KTO_LOSSES: tuple[str, ...] = ("kto", "apo_zero_unpaired")
"""``kto.loss``: :func:`~relayrl.algorithms.kto.kto_loss` (against the batch's KL estimate ``z0``) and
:func:`~relayrl.algorithms.kto.apo_zero_unpaired_loss` (against 0: no KL estimate)."""
