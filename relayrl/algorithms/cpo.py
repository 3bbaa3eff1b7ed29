"""CPO (Xu et al. 2024, "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine
Translation"): DPO's sigmoid loss with the reference model dropped.

With ``s_w``, ``s_l`` the *summed* log-probs of the chosen and rejected answers (over each answer's tokens)::

    loss = -(1 - eps) log sigmoid(beta (s_w - s_l)) - eps log sigmoid(-beta (s_w - s_l))

averaged over the ``N`` pairs: the paper's preference term L_prefer (eq. 3, ``eps = 0``), which is DPO's loss with
the reference's log-probs set to 0 (the paper's uniform reference), and with ``eps`` the conservative form TRL's
``CPOTrainer(loss_type="sigmoid")`` applies with ``label_smoothing``. The implicit rewards are ``beta * s`` (as
TRL logs them). This function is :func:`~relayrl.algorithms.dpo.dpo_loss` narrowed to that zero reference.

The paper's full loss adds the chosen answers' negative log-likelihood with weight 1 (L_CPO = L_prefer + L_NLL; TRL's
``cpo_alpha``, default 1); it is not in this function: workflow dpo adds it with ``dpo.nll_weight``
(:class:`relayrl.workflows.losses.DPOLoss`), as for RPO and CPO-SimPO. TRL takes that NLL as the token mean over
all the chosen tokens of the batch; relayrl as the mean over pairs of each answer's token mean (the same when the
chosen answers have one length). TRL sums the log-probs for ``loss_type="sigmoid"`` (it averages them for
``ipo`` and ``simpo`` only), as here.
"""

from __future__ import annotations

import torch

from relayrl.algorithms.dpo import dpo_loss

Tensor = torch.Tensor

__all__ = ["cpo_loss"]


def cpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, *, beta: float,
             label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """CPO's preference term over ``N`` (chosen, rejected) pairs, no reference model.

    Args:
        chosen_logps: ``[N]`` summed log-probs of the chosen answers (policy).
        rejected_logps: ``[N]`` the same for the rejected answers.
        beta: inverse temperature (> 0; TRL's default 0.1, as the paper's).
        label_smoothing: ``eps`` in ``[0, 0.5)`` (TRL's ``label_smoothing``).

    Returns:
        ``(loss, metrics)``: the mean over pairs, and the ``dpo/*`` figures of
        :func:`~relayrl.algorithms.dpo.preference_metrics` with rewards ``beta * summed log-prob``.
    """
    zero = torch.zeros_like(chosen_logps).detach()
    return dpo_loss(chosen_logps, rejected_logps, zero, zero, beta=beta, kind="sigmoid",
                    label_smoothing=label_smoothing)
