"""The sub-sections of the config's ``algorithm`` section: the rollout correction (``algorithm.correction``),
on-policy distillation (``algorithm.distill``) and the options of particular losses and estimators
(``algorithm.sapo``, ``algorithm.vespo``, ``algorithm.cov``, ``algorithm.online_dpo``). The section itself, which
holds them and checks them against the estimator and loss it names, is :mod:`relayrl.config.algorithm`'s.

Each key's description is the config reference; a refusal names the key and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.algorithms.names import REFERENCE_KINDS

if TYPE_CHECKING:  # torch: imported when a loss asks for its correction, not while a recipe is validated
    from relayrl.algorithms.correction import Correction
    from relayrl.algorithms.estimators.online_dpo import DPOSpec

__all__ = ["CorrectionConfig", "CovConfig", "DistillConfig", "OnlineDPOConfig", "SapoConfig", "Section",
           "VespoConfig"]


class Section(BaseModel):
    """A part of the ``algorithm`` section: unknown keys refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CorrectionConfig(Section):
    """Rollout correction (:mod:`relayrl.algorithms.correction`): importance weights ``pi_old / mu`` between
    the trainer's policy before the update and the rollout engine's behaviour policy ``mu`` (its per-token
    log-probs), truncated or masked, and masking of sequences that diverged. Off unless ``level`` or
    ``kl_threshold`` is set."""

    level: Literal["token", "sequence", "geometric"] | None = Field(
        None, description="importance weight of each token: token (pi_old / mu of the token: TIS, IcePop), "
        "sequence (the product of the sequence's token ratios) or geometric (their geometric mean, the same "
        "on every token of the sequence); null: no importance weight")
    mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: the weight is capped at high (truncated importance sampling, Yao et "
        "al. 2025); mask: a token (level=token) or a whole sequence whose weight falls outside [low, high] is "
        "dropped from the policy loss (IcePop)")
    high: float = Field(2.0, gt=0.0, description="upper bound of the weight (truncate: the cap), >= 1: a weight of "
                        "1 (the two policies agree) passes untouched")
    low: float | None = Field(None, ge=0.0, description="mode=mask: lower bound of the weight, <= 1 (null: "
                              "1/high; 0: mask only above high)")
    kl_threshold: float | None = Field(
        None, ge=0.0, description="drop a sequence from the policy loss when its per-token estimate of "
        "KL(mu || pi_old), reduced over its tokens by kl_reduce, exceeds this (DeepSeek-V3.2's off-policy "
        "sequence masking); kl_reduce=token drops each token over it instead; null: off")
    kl_kind: Literal["k1", "k2", "k3"] = Field(
        "k1", description="the per-token KL estimate kl_threshold compares: k1 = log mu - log pi_old "
        "(DeepSeek-V3.2), k2 = (log r)^2 / 2, k3 = r - 1 - log r with r = pi_old / mu (k2, k3 never negative)")
    kl_reduce: Literal["mean", "sum", "max", "token"] = Field(
        "mean", description="how kl_threshold reduces the per-token estimates: mean, sum or max over a "
        "sequence's response tokens (the whole sequence is dropped over the threshold), or token (each token "
        "over it is dropped alone); verl's rollout_rs=seq_mean_k*, seq_sum_k*, seq_max_k*, token_k*")
    kl_low: float | None = Field(
        None, description="kl_kind=k1: also drop a sequence (kl_reduce=token: a token) whose reduced estimate is "
        "below this (k1 can be negative: log mu < log pi_old); with kl_threshold it keeps [kl_low, kl_threshold], "
        "verl's two-sided k1 bounds (rollout_rs_threshold lower_upper: kl_low = log(lower), kl_threshold = "
        "log(upper)); null: no lower bound")
    negative_only: bool = Field(False, description="kl_threshold drops only the tokens with a negative advantage "
                                "(DeepSeek-V3.2: a sample the policy drifted from is not pushed down)")

    @model_validator(mode="after")
    def _consistent(self) -> "CorrectionConfig":
        if self.level is None:
            idle = [k for k in ("mode", "high", "low") if k in self.model_fields_set]
            if idle:
                raise ValueError(f"algorithm.correction.{idle[0]} shapes the importance weight, and "
                                 f"algorithm.correction.level is null (no weight): set algorithm.correction.level="
                                 f"token (or sequence, geometric) or drop algorithm.correction.{idle[0]}")
        if self.high < 1:  # (a weight of 1, where mu and pi_old agree, must pass untouched: TIS, IcePop)
            cut = ("caps every weight below 1, the tokens where the two policies agree (weight 1) too, so it scales "
                   "the whole policy loss down (a smaller step) instead of bounding the rare large weights"
                   if self.mode == "truncate" else
                   "keeps only weights in [low, high], and without 1 in it every token where the two policies agree "
                   "(weight 1) is dropped from the policy loss")
            raise ValueError(f"algorithm.correction.high={self.high:g}: the importance weight pi_old / mu is 1 on "
                             f"average under the rollout policy, and mode={self.mode} {cut} (TIS, Yao et al. 2025, "
                             f"caps at 2; IcePop keeps [0.5, 5]): set algorithm.correction.high >= 1")
        if self.low is not None and self.low > 1 and self.mode == "mask":
            raise ValueError(f"algorithm.correction.low={self.low:g} is above 1: mode=mask keeps only weights in [low, "
                             f"high], and every token where the two policies agree (weight pi_old / mu = 1) would be "
                             f"dropped from the policy loss (IcePop keeps [0.5, 5]): set algorithm.correction.low <= 1")
        if self.low is not None and self.mode == "truncate":
            raise ValueError(f"algorithm.correction.low={self.low} bounds the weight from below in mode=mask; "
                             f"truncation only caps it at high: set algorithm.correction.mode=mask or drop low")
        if self.low is not None and self.low > self.high:
            raise ValueError(f"algorithm.correction.low={self.low} is above high={self.high}: every token would "
                             f"be masked; set low <= high")
        if self.negative_only and self.kl_threshold is None:
            raise ValueError("algorithm.correction.negative_only limits the divergence mask, which is off: set "
                             "algorithm.correction.kl_threshold (e.g. 0.1) or drop negative_only")
        if self.kl_kind != "k1" and self.kl_threshold is None and "kl_kind" in self.model_fields_set:
            raise ValueError("algorithm.correction.kl_kind is the estimate kl_threshold compares, which is off: set "
                             "algorithm.correction.kl_threshold or drop kl_kind")
        if self.kl_low is not None:
            if self.kl_threshold is None:
                raise ValueError(f"algorithm.correction.kl_low={self.kl_low} is the lower end of the divergence mask, "
                                 f"which is off: set algorithm.correction.kl_threshold (the upper end) too")
            if self.kl_kind != "k1":
                raise ValueError(f"algorithm.correction.kl_low bounds the k1 estimate, which can be negative; "
                                 f"kl_kind={self.kl_kind} never is: set algorithm.correction.kl_kind=k1 or drop kl_low")
            if self.kl_low >= self.kl_threshold:
                raise ValueError(f"algorithm.correction.kl_low={self.kl_low} is not below kl_threshold="
                                 f"{self.kl_threshold}: every sequence would be dropped; set kl_low < kl_threshold")
        if self.kl_reduce != "mean" and self.kl_threshold is None and "kl_reduce" in self.model_fields_set:
            raise ValueError(f"algorithm.correction.kl_reduce={self.kl_reduce} reduces the estimate kl_threshold "
                             f"compares, which is off: set algorithm.correction.kl_threshold (e.g. 0.1) or drop "
                             f"kl_reduce")
        return self

    @property
    def enabled(self) -> bool:
        return self.level is not None or self.kl_threshold is not None

    def spec(self) -> Correction:
        """The settings as the loss's :class:`~relayrl.algorithms.correction.Correction`."""
        from relayrl.algorithms.correction import Correction

        return Correction(level=self.level, mode=self.mode, high=self.high, low=self.low,
                          kl_threshold=self.kl_threshold, kl_kind=self.kl_kind, negative_only=self.negative_only,
                          kl_reduce=self.kl_reduce, kl_low=self.kl_low)


class DistillConfig(Section):
    """On-policy distillation (:mod:`relayrl.algorithms.distill`; GKD, Agarwal et al. 2024; Thinking Machines
    2025): the student (the trained policy) samples, a frozen teacher scores every sampled token, and the
    advantage of each token is the negative per-token reverse KL ``-(log pi_student - log pi_teacher)``,
    optionally plus ``reward_weight`` x the verifier reward's advantages. Off unless ``teacher`` is set."""

    teacher: str | None = Field(
        None, description="local Hugging Face model directory of the teacher (same tokenizer as the student); "
        "placed like the reference (placement.teacher, colocated on main by default; off the device between "
        "its passes with trainer.offload); null: no distillation")
    coef: float = Field(1.0, gt=0.0, description="weight of the reverse-KL advantage")
    reward_weight: float = Field(0.0, ge=0.0, description="weight of the verifier reward's advantages (the "
                                 "algorithm.advantage estimator's) added to the distillation advantage; 0: pure "
                                 "distillation (rewards are still scored and logged)")

    @model_validator(mode="after")
    def _teacher(self) -> "DistillConfig":
        idle = sorted(self.model_fields_set - {"teacher"}) if self.teacher is None else []
        if idle:  # (nothing would read them: no teacher, no distillation)
            raise ValueError(f"algorithm.distill.{idle[0]} weighs on-policy distillation's advantages, which "
                             f"algorithm.distill.teacher turns on (it is null: no distillation): set "
                             f"algorithm.distill.teacher=MODEL_DIR or drop algorithm.distill.{idle[0]}")
        if self.teacher is not None and not (Path(self.teacher) / "config.json").is_file():
            raise ValueError(f"algorithm.distill.teacher={self.teacher!r} is not a model directory (no "
                             f"config.json there): give the path of a saved Hugging Face model, e.g. a run's "
                             f"model/ directory")
        return self

    @property
    def enabled(self) -> bool:
        return self.teacher is not None


class SapoConfig(Section):
    """SAPO's soft gate (:mod:`relayrl.algorithms.sapo`; ``algorithm.policy_loss=sapo``)."""

    tau_pos: float = Field(1.0, gt=0.0, description="temperature of the gate for tokens with a positive advantage "
                           "(larger: the gradient fades sooner as the ratio leaves 1)")
    tau_neg: float = Field(1.05, gt=0.0, description="the same for the other tokens (SAPO damps them sooner: "
                           "tau_neg > tau_pos)")


class VespoConfig(Section):
    """VESPO's kernel ``phi(W) = W^k exp(lambda (1 - W))`` of the sequence ratio W
    (:mod:`relayrl.algorithms.vespo`; ``algorithm.policy_loss=vespo``)."""

    k_pos: float = Field(2.0, ge=0.0, description="power of W for positive advantages (damps small W)")
    lambda_pos: float = Field(3.0, gt=0.0, description="decay in W for positive advantages (damps large W)")
    k_neg: float = Field(3.0, ge=0.0, description="power of W for the other tokens")
    lambda_neg: float = Field(2.0, gt=0.0, description="decay in W for the other tokens")


class CovConfig(Section):
    """Clip-Cov's and KL-Cov's token selection (:mod:`relayrl.algorithms.covariance`; ``algorithm.policy_loss``
    ``clip_cov`` or ``kl_cov``): tokens ranked by ``(A - mean A) * (log pi - mean log pi)``. Defaults are verl's."""

    ratio: float = Field(0.0002, gt=0.0, le=1.0, description="the fraction of each micro-batch's tokens treated "
                         "(clip_cov: whose gradient is removed; kl_cov: that take the KL penalty); at least one")
    low: float = Field(1.0, description="clip_cov: the covariance range the removed tokens are drawn from, lower "
                       "bound")
    high: float = Field(5.0, description="clip_cov: its upper bound")
    kl_coef: float = Field(0.1, ge=0.0, description="kl_cov: the penalty's weight on the absolute log-ratio, "
                           "abs(log(pi / pi_old))")

    @model_validator(mode="after")
    def _range(self) -> "CovConfig":
        if self.low >= self.high:
            raise ValueError(f"algorithm.cov.low={self.low} must be below algorithm.cov.high={self.high}")
        return self


class OnlineDPOConfig(Section):
    """Online DPO's loss (``algorithm.advantage=online-dpo``; :mod:`relayrl.algorithms.online_dpo`): DPO on each
    prompt group's highest- and lowest-reward responses, its gradient taken as their advantages. TRL's
    ``OnlineDPOConfig`` ``beta`` and ``loss_type``."""

    beta: float = Field(0.1, gt=0.0, description="inverse temperature of the implicit reward beta (log pi - log "
                        "pi_ref) (TRL's beta, default 0.1)")
    kind: Literal[REFERENCE_KINDS] = Field(  # type: ignore[valid-type]
        "sigmoid", description="the pair loss, as dpo.kind: sigmoid (DPO), ipo, hinge (SLiC-HF), apo_zero, "
        "apo_down (TRL's loss_type has sigmoid and ipo)")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="conservative DPO's eps (kind=sigmoid only)")
    nll_weight: float = Field(0.0, ge=0.0, description="weight of the chosen responses' NLL, the mean over pairs of "
                              "each one's per-token mean (RPO, Pang et al. 2024), added to the loss and its gradient")

    @model_validator(mode="after")
    def _smoothing(self) -> "OnlineDPOConfig":
        if self.label_smoothing and self.kind != "sigmoid":
            raise ValueError(f"algorithm.online_dpo.label_smoothing is defined for kind=sigmoid only (got "
                             f"kind={self.kind}): drop algorithm.online_dpo.label_smoothing")
        return self

    def spec(self) -> DPOSpec:
        """The options as the estimator takes them."""
        from relayrl.algorithms.estimators.online_dpo import DPOSpec

        return DPOSpec(beta=self.beta, kind=self.kind, label_smoothing=self.label_smoothing,
                       nll_weight=self.nll_weight)

