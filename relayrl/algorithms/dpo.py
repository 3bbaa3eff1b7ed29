"""Direct preference optimisation losses (NeMo RL lists DPO among its algorithms).

With ``h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))``:

* ``"sigmoid"`` -- DPO (Rafailov et al. 2023): ``-log sigmoid(beta * h)``;
  with ``label_smoothing = eps`` the conservative DPO of Mitchell (2023):
  ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.
* ``"ipo"`` -- IPO (Azar et al. 2023): ``(h - 1 / (2 beta))^2``.
* ``"hinge"`` -- SLiC-HF hinge (Zhao et al. 2023): ``max(0, 1 - beta h)``.
* ``"apo_zero"`` / ``"apo_down"`` -- APO (D'Oosterlinck et al. 2024, "Anchored Preference Optimization",
  eqs. 7 and 8; TRL's ``loss_type`` of the same names). With ``c = log pi(y_w) - log pi_ref(y_w)`` and
  ``r = log pi(y_l) - log pi_ref(y_l)`` (so ``h = c - r``), ``apo_zero``:
  ``1 - sigmoid(beta c) + sigmoid(beta r)`` (push the chosen answers up and the rejected down, each against
  the reference: for chosen answers better than the model's own); ``apo_down``:
  ``sigmoid(beta c) + 1 - sigmoid(beta h)`` (push both down, the rejected further: for chosen answers worse
  than the model's own).

The loss is the mean over the ``N`` pairs. Implicit rewards are
``beta * (log pi - log pi_ref)`` and are reported as metrics.

Departures: the IPO paper uses length-normalised (average per-token) log-probs;
this function takes whatever sequence log-probs it is given, so pass averages
for paper-faithful IPO. Label smoothing is defined for ``"sigmoid"`` only and
is rejected for the other kinds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relayrl.algorithms._checks import check_batch, check_ndim, to_floats
from relayrl.algorithms.names import REFERENCE_KINDS

Tensor = torch.Tensor

DPO_KINDS: tuple[str, ...] = REFERENCE_KINDS
"""The kinds with a reference model (``dpo.kind``'s others, SimPO and ORPO, are :mod:`~relayrl.algorithms.simpo`
and :mod:`~relayrl.algorithms.orpo`)."""


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Preference loss over ``N`` (chosen, rejected) pairs.

    Args:
        chosen_logps: ``[N]`` summed log-probs of the chosen responses (policy).
        rejected_logps: ``[N]`` same for the rejected responses.
        ref_chosen_logps, ref_rejected_logps: ``[N]`` under the reference model
            (detached here).
        beta: inverse temperature (> 0).
        kind: ``"sigmoid"``, ``"ipo"``, ``"hinge"``, ``"apo_zero"`` or ``"apo_down"``.
        label_smoothing: in ``[0, 0.5)``; sigmoid only.

    Returns:
        ``(loss, metrics)`` with ``dpo/loss``, ``dpo/rewards_chosen``,
        ``dpo/rewards_rejected``, ``dpo/reward_accuracy``, ``dpo/reward_margin``,
        ``dpo/logps_chosen``, ``dpo/logps_rejected``.
    """
    check_ndim("chosen_logps", chosen_logps, 1)
    check_batch(
        chosen_logps=chosen_logps, rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
    )
    if kind not in DPO_KINDS:
        raise ValueError(f"unknown DPO kind {kind!r}; valid kinds: {', '.join(DPO_KINDS)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and kind != "sigmoid":
        raise ValueError(f"label_smoothing is only defined for kind='sigmoid', got kind={kind!r}")

    chosen_ratio = chosen_logps - ref_chosen_logps.detach()
    rejected_ratio = rejected_logps - ref_rejected_logps.detach()
    h = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).square()
    elif kind == "hinge":
        losses = torch.relu(1.0 - beta * h)
    elif kind == "apo_zero":
        losses = 1.0 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    else:  # apo_down
        losses = torch.sigmoid(beta * chosen_ratio) + 1.0 - torch.sigmoid(beta * h)
    loss = losses.mean()
    return loss, preference_metrics(loss, beta * chosen_ratio, beta * rejected_ratio, chosen_logps, rejected_logps)


def preference_metrics(loss: Tensor, rewards_chosen: Tensor, rewards_rejected: Tensor, chosen_logps: Tensor,
                       rejected_logps: Tensor, **extra: Tensor) -> dict[str, float]:
    """The ``dpo/*`` figures of a preference loss over ``N`` pairs (every tensor ``[N]`` but the scalar
    ``loss``; detached here): the loss, the mean (implicit) rewards and their margin, the fraction of pairs
    whose reward prefers the chosen answer, the mean log-probs as the loss took them; ``extra``: more scalar
    figures by name, converted with them (one device sync)."""
    with torch.no_grad():
        r_c, r_r = rewards_chosen.detach(), rewards_rejected.detach()
        return to_floats(
            {
                "dpo/loss": loss.detach(),
                "dpo/rewards_chosen": r_c.mean(),
                "dpo/rewards_rejected": r_r.mean(),
                "dpo/reward_accuracy": (r_c > r_r).to(r_c.dtype).mean(),
                "dpo/reward_margin": (r_c - r_r).mean(),
                "dpo/logps_chosen": chosen_logps.detach().mean(),
                "dpo/logps_rejected": rejected_logps.detach().mean(),
                **{k: v.detach() for k, v in extra.items()},
            }
        )
