"""KL divergence to the reference policy: estimators, penalties, controllers.

Per-token estimators of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman,
"Approximating KL Divergence", 2020), with ``d = logp - ref_logp``:

* ``"k1"`` -- ``d``: unbiased, high variance, can be negative.
* ``"k2"`` (alias ``"mse"``) -- ``d**2 / 2``: biased, low variance, >= 0.
* ``"k3"`` (alias ``"low_var_kl"``) -- ``exp(-d) - 1 + d``: unbiased, >= 0;
  the GRPO KL term (Shao et al. 2024, DAPO eq. 5).
* ``"abs"`` -- ``|d|``.
* ``"k1+"``, ``"k3+"``, ``"abs+"`` -- the value of k1, k3 or abs with the gradient of k2 (straight through):
  as a loss term, the expected gradient of k1 and k3 is not the gradient of ``KL(pi || pi_ref)``; k2's is.

The KL is used either as a loss term (:func:`kl_loss`, GRPO) or folded into
the per-token reward (:func:`kl_penalty_rewards`, PPO-RLHF as in Ouyang et al.
2022 and REINFORCE++), with a fixed or adaptive coefficient (Ziegler et al.
2019, "Fine-Tuning Language Models from Human Preferences").

Departures: ``d`` is clamped to ``[-20, 20]`` before ``exp`` and k3 is clamped
to ``[-10, 10]`` (as verl does) so one wild token cannot produce ``inf``;
inside the clamp range the values are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim, to_floats
from relayrl.algorithms._ops import LOG_CLAMP, masked_mean
from relayrl.algorithms.aggregation import aggregate

Tensor = torch.Tensor

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
KL_ALIASES: dict[str, str] = {"mse": "k2", "low_var_kl": "k3"}

_K3_CLAMP = 10.0


def canonical_kind(kind: str) -> str:
    """Map an alias (``"mse"``, ``"low_var_kl"``) to its canonical kind name; a ``"+"`` suffix stays
    (``"low_var_kl+"`` is ``"k3+"``: :func:`kl_estimate`'s straight-through form)."""
    base, plus = (kind[:-1], "+") if kind.endswith("+") else (kind, "")
    name = KL_ALIASES.get(base, base)
    if name not in KL_KINDS:
        valid = ", ".join(KL_KINDS + tuple(KL_ALIASES) + tuple(f"{k}+" for k in KL_KINDS))
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {valid}")
    return name + plus


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate ``[B, T]`` (differentiable in ``logprobs``).

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy.
        ref_logprobs: ``[B, T]`` log-probs of the same tokens under the reference.
        kind: ``"k1"``, ``"k2"``/``"mse"``, ``"k3"``/``"low_var_kl"`` or ``"abs"``; with a ``"+"`` (``"k3+"``)
            the estimate's value with k2's gradient, ``d * grad log pi``: k1's and k3's expected gradients are
            not the KL's gradient, k2's is (for samples of pi; verl's ``+`` forms, after Schulman's note).
    """
    name = canonical_kind(kind)
    check_batch(logprobs=logprobs, ref_logprobs=ref_logprobs)
    if name.endswith("+"):  # the estimate's value, k2's gradient (straight through)
        value = kl_estimate(logprobs.detach(), ref_logprobs, name[:-1])
        k2 = kl_estimate(logprobs, ref_logprobs, "k2")
        return value + (k2 - k2.detach())
    d = logprobs - ref_logprobs
    if name == "k1":
        return d
    if name == "abs":
        return d.abs()
    if name == "k2":
        return 0.5 * d.square()
    d = d.clamp(-LOG_CLAMP, LOG_CLAMP)
    return (torch.exp(-d) - 1.0 + d).clamp(-_K3_CLAMP, _K3_CLAMP)


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    kind: str = "k3",
    agg: str = "token-mean",
    global_tokens: int | None = None,
    global_seqs: int | None = None,
    constant: float | None = None,
    ratio: Tensor | None = None,
    group_tokens: Tensor | None = None,
    global_groups: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """KL to the reference as a loss term (GRPO), aggregated like the policy loss.

    ``ratio`` ``[B, T]`` (``pi / pi_old`` of the sampled tokens, with its gradient) weighs each token's
    estimate: the tokens were sampled from ``pi_old``, not ``pi``, and the weight makes the estimate of
    ``KL(pi || pi_ref)`` unbiased (DeepSeek-V3.2's unbiased KL estimate; TRL's ``use_bias_correction_kl``).

    Returns ``(loss scalar, {"actor/kl_loss", "actor/ref_kl_k1"})``; the caller
    multiplies the loss by its coefficient.
    """
    check_ndim("logprobs", logprobs, 2)
    check_batch(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask, ratio=ratio)
    kl = kl_estimate(logprobs, ref_logprobs, kind)
    if ratio is not None:
        kl = kl * ratio
    loss = aggregate(kl, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, constant=constant,
                     group_tokens=group_tokens, global_groups=global_groups)
    with torch.no_grad():
        metrics = {
            "actor/kl_loss": loss.detach(),
            "actor/ref_kl_k1": masked_mean((logprobs - ref_logprobs).detach(), mask),
        }
    return loss, to_floats(metrics)


def kl_penalty_rewards(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[Tensor, dict[str, float]]:
    """Fold a KL penalty into per-token rewards: ``r_t - coef * kl_t`` on valid tokens.

    Args:
        token_rewards: ``[B, T]`` rewards (e.g. outcome on the last token).
        logprobs, ref_logprobs: ``[B, T]`` policy and reference log-probs.
        mask: ``[B, T]``.
        coef: KL coefficient (``controller.value``).
        kind: KL estimator.

    Returns:
        ``(rewards [B, T] detached, 0 at masked positions, metrics)`` with
        ``"actor/reward_kl"`` the mean per-token KL (feed it to
        ``controller.update``) and ``"actor/kl_coef"``.
    """
    check_ndim("token_rewards", token_rewards, 2)
    check_batch(token_rewards=token_rewards, logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    with torch.no_grad():
        m = as_float_mask(mask, token_rewards)
        kl = kl_estimate(logprobs.detach(), ref_logprobs.detach(), kind) * m
        out = (token_rewards.detach() - coef * kl) * m
        seq_kl = kl.sum(dim=1)
        metrics = {
            "actor/reward_kl": masked_mean(kl, m),
            "actor/reward_kl_seq_mean": seq_kl.mean(),
            "actor/kl_coef": float(coef),
        }
    return out, to_floats(metrics)


@dataclass
class FixedKLController:
    """A constant KL coefficient; ``update`` only records the observed KL."""

    coef: float
    last_kl: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.coef < 0 or not math.isfinite(self.coef):
            raise ValueError(f"coef must be a finite number >= 0, got {self.coef}")

    @property
    def value(self) -> float:
        return self.coef

    def update(self, current_kl: float, n_steps: int) -> float:
        """Record ``current_kl``; the coefficient stays fixed. Returns it."""
        self.last_kl = float(current_kl)
        return self.coef

    def state_dict(self) -> dict[str, float | bool | None]:
        return {"coef": self.coef, "last_kl": self.last_kl, "fixed": True}

    def load_state_dict(self, state: dict) -> None:
        """Only the observed KL: a fixed coefficient is the config's, not the checkpoint's."""
        self.last_kl = state.get("last_kl")


@dataclass
class AdaptiveKLController:
    """Adaptive coefficient of Ziegler et al. (2019), section 2.2.

    ``e = clip(KL / target - 1, -0.2, 0.2)`` and
    ``coef <- coef * (1 + e * n_steps / horizon)``: the coefficient rises when
    the measured KL is above ``target`` and falls when below.
    """

    init_coef: float
    target: float
    horizon: int
    coef: float = field(init=False)
    last_kl: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.init_coef < 0 or not math.isfinite(self.init_coef):
            raise ValueError(f"init_coef must be a finite number >= 0, got {self.init_coef}")
        if self.target <= 0:
            raise ValueError(f"target must be > 0, got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {self.horizon}")
        self.coef = float(self.init_coef)

    @property
    def value(self) -> float:
        return self.coef

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt the coefficient after ``n_steps`` samples (or steps) at ``current_kl``."""
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        self.last_kl = float(current_kl)
        error = min(max(self.last_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef

    def state_dict(self) -> dict[str, float | None]:
        return {"coef": self.coef, "last_kl": self.last_kl}

    def load_state_dict(self, state: dict) -> None:
        """The coefficient where a checkpointed adaptive run left it (and the KL it last saw). A fixed controller's
        state (a run that turns adaptive on resume) leaves ``init_coef``: its 0 would hold the coefficient at 0."""
        coef = float(state["coef"])
        if coef < 0 or not math.isfinite(coef):
            raise ValueError(f"a checkpointed KL coefficient must be a finite number >= 0, got {coef}")
        if not state.get("fixed", False):
            self.coef = coef
        self.last_kl = state.get("last_kl")


def kl_controller(coef: float, target: float | None = None,
                  horizon: int = 10_000) -> FixedKLController | AdaptiveKLController:
    """The KL coefficient's controller: fixed at ``coef``, or, with a ``target`` KL, adaptive from ``coef``
    (Ziegler et al. 2019; ``horizon`` in samples, as ``update``'s ``n_steps`` counts them)."""
    if target is None:
        return FixedKLController(coef)
    return AdaptiveKLController(coef, target, horizon)
