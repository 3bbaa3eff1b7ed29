"""KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"): preference
optimisation from unpaired examples, each a (prompt, completion) labelled desirable or undesirable.

With ``r = log pi(y|x) - log pi_ref(y|x)`` (summed over the completion's tokens) and ``z0`` a batch-level
estimate of ``KL(pi || pi_ref)``::

    desirable:   loss = desirable_weight   * (1 - sigmoid(beta * (r - z0)))
    undesirable: loss = undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

averaged over the ``N`` examples (the paper's eq. 7; TRL's ``KTOTrainer`` with ``loss_type="kto"``, its
default). ``z0`` is the mean of ``r`` over ``M`` *mismatched* (prompt, completion) pairs of the same batch
(TRL pairs prompt ``i`` with the completion of example ``i - 1``, cyclically), detached and clamped at 0:
no gradient flows through it (TRL computes the policy's log-probs of those rows under ``no_grad``). The
implicit rewards ``beta * r`` are reported as metrics, as TRL logs ``rewards/chosen`` / ``rewards/rejected``.

:func:`kto_loss` takes the whole batch; :func:`kl_estimate` and :func:`kto_terms` are its two halves, for a
caller that computes ``z0`` once per batch and the loss per micro-batch (:class:`relayrl.workflows.losses.KTOLoss`).

:func:`apo_zero_unpaired_loss` is TRL's ``loss_type="apo_zero_unpaired"``: the unpaired form of APO-zero
(D'Oosterlinck et al. 2024, "Anchored Preference Optimization", eq. 7, whose paired form is ``dpo.kind=apo_zero``)::

    desirable:   loss = desirable_weight   * (1 - sigmoid(beta * r))
    undesirable: loss = undesirable_weight * sigmoid(beta * r)

each answer anchored to the reference alone (raise the desirable ones above it, push the undesirable ones below
it), with no KL estimate. Since ``1 - sigmoid(-x) = sigmoid(x)``, it is KTO with ``z0`` fixed at 0, and is
computed so (:func:`kto_terms` with ``z0 = 0``): the mismatched rows are not needed, and a caller need not run
them (TRL's trainer skips them for this loss, as workflow kto does).
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import check_batch, check_ndim, to_floats

Tensor = torch.Tensor

__all__ = ["kto_loss", "apo_zero_unpaired_loss", "kl_estimate", "kto_terms", "measured_kinds"]


def kl_estimate(kl_logps: Tensor, kl_ref_logps: Tensor) -> Tensor:
    """``z0``: the mean of ``log pi - log pi_ref`` over ``M`` mismatched rows (``[M]`` each, summed over each
    row's completion tokens), detached and clamped at 0 (a scalar)."""
    check_ndim("kl_logps", kl_logps, 1)
    check_batch(kl_logps=kl_logps, kl_ref_logps=kl_ref_logps)
    return (kl_logps.detach() - kl_ref_logps.detach()).mean().clamp(min=0)


def kto_terms(logps: Tensor, ref_logps: Tensor, z0: Tensor | float, desirable: Tensor, *, beta: float,
              desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(losses [N], rewards [N])``: each example's weighted KTO loss against the (detached) ``z0``, and its
    implicit reward ``beta * r`` (detached). ``desirable``: ``[N]`` bool."""
    check_ndim("logps", logps, 1)
    check_batch(logps=logps, ref_logps=ref_logps, desirable=desirable)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(f"the weights must be >= 0, got desirable_weight={desirable_weight}, "
                         f"undesirable_weight={undesirable_weight}")
    z0 = torch.as_tensor(z0, dtype=logps.dtype, device=logps.device).detach()
    r = logps - ref_logps.detach()
    d = desirable.bool()
    margin = torch.where(d, r - z0, z0 - r)
    weight = torch.where(d, torch.full_like(r, desirable_weight), torch.full_like(r, undesirable_weight))
    return weight * (1.0 - torch.sigmoid(beta * margin)), beta * r.detach()


def kto_loss(logps: Tensor, ref_logps: Tensor, kl_logps: Tensor, kl_ref_logps: Tensor, desirable: Tensor, *,
             beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[Tensor, dict[str, float]]:
    """KTO over ``N`` labelled examples.

    Args:
        logps: ``[N]`` summed log-probs of the completions under the policy (with grad).
        ref_logps: ``[N]`` the same under the reference (detached here).
        kl_logps: ``[M]`` summed log-probs of the mismatched (prompt, completion) rows under the policy
            (detached here: ``z0`` takes no gradient).
        kl_ref_logps: ``[M]`` the same under the reference.
        desirable: ``[N]`` bool, True for a desirable example.
        beta: inverse temperature (> 0; TRL's default 0.1).
        desirable_weight, undesirable_weight: ``lambda_D``, ``lambda_U`` (>= 0; TRL's defaults 1).

    Returns:
        ``(loss, metrics)``: the mean over the ``N`` examples, and ``kto/loss``, ``kto/kl`` (``z0``),
        ``kto/rewards_desirable``, ``kto/rewards_undesirable`` (mean ``beta * r`` over each kind; absent for
        a kind with no example: :func:`measured_kinds`), ``kto/reward_margin`` (their difference, with both
        kinds only), ``kto/logps_desirable``, ``kto/logps_undesirable`` (likewise), ``kto/desirable_fraction``.
    """
    z0 = kl_estimate(kl_logps, kl_ref_logps)
    losses, rewards = kto_terms(logps, ref_logps, z0, desirable, beta=beta, desirable_weight=desirable_weight,
                                undesirable_weight=undesirable_weight)
    loss = losses.mean()
    return loss, _unpaired_metrics(loss, rewards, logps, desirable, **{"kto/kl": z0})


def apo_zero_unpaired_loss(logps: Tensor, ref_logps: Tensor, desirable: Tensor, *, beta: float = 0.1,
                           desirable_weight: float = 1.0,
                           undesirable_weight: float = 1.0) -> tuple[Tensor, dict[str, float]]:
    """Unpaired APO-zero over ``N`` labelled examples: KTO against ``z0 = 0``, no mismatched rows.

    Args:
        logps: ``[N]`` summed log-probs of the completions under the policy (with grad).
        ref_logps: ``[N]`` the same under the reference (detached here).
        desirable: ``[N]`` bool, True for a desirable example.
        beta: inverse temperature (> 0; TRL's default 0.1).
        desirable_weight, undesirable_weight: the weights of each kind's losses (>= 0; TRL's defaults 1).

    Returns:
        ``(loss, metrics)``: the mean over the ``N`` examples, and the figures of :func:`kto_loss` but
        ``kto/kl`` (there is no estimate).
    """
    losses, rewards = kto_terms(logps, ref_logps, 0.0, desirable, beta=beta, desirable_weight=desirable_weight,
                                undesirable_weight=undesirable_weight)
    loss = losses.mean()
    return loss, _unpaired_metrics(loss, rewards, logps, desirable)


_KIND_FIGURES = (("kto/rewards_desirable", "kto/logps_desirable"), ("kto/rewards_undesirable", "kto/logps_undesirable"))


def measured_kinds(metrics: dict[str, float], desirable: float, undesirable: float) -> dict[str, float]:
    """``metrics`` without the figures of a kind that has no example (``desirable``, ``undesirable``: the
    examples of each kind, or any figure that is 0 exactly when they are): its mean reward and log-prob would
    read 0, as if measured. ``kto/reward_margin`` is kept only when both kinds have examples."""
    drop = {name for n, names in zip((desirable, undesirable), _KIND_FIGURES) if not n for name in names}
    drop |= {"kto/reward_margin"} if drop else set()
    return {k: v for k, v in metrics.items() if k not in drop}


def _unpaired_metrics(loss: Tensor, rewards: Tensor, logps: Tensor, desirable: Tensor,
                      **extra: Tensor) -> dict[str, float]:
    """The ``kto/*`` figures of a loss over ``N`` labelled examples (``rewards``, ``logps``, ``desirable``:
    ``[N]``): the loss, each kind's mean reward and log-prob (absent with none), the reward margin (with both
    kinds) and the desirable fraction; ``extra``: more scalar figures by name, converted with them (one device
    sync)."""
    d = desirable.bool()
    n_d, n_u = d.sum().clamp_min(1), (~d).sum().clamp_min(1)
    with torch.no_grad():
        lp = logps.detach()
        r_d, r_u = (rewards * d).sum() / n_d, (rewards * ~d).sum() / n_u
        out = to_floats({
            "kto/loss": loss.detach(),
            "kto/rewards_desirable": r_d, "kto/rewards_undesirable": r_u, "kto/reward_margin": r_d - r_u,
            "kto/logps_desirable": (lp * d).sum() / n_d, "kto/logps_undesirable": (lp * ~d).sum() / n_u,
            "kto/desirable_fraction": d.to(lp.dtype).mean(), "_n_desirable": d.sum(), "_n_undesirable": (~d).sum(),
            **extra,
        })
    return measured_kinds(out, out.pop("_n_desirable"), out.pop("_n_undesirable"))
