"""The ``dpo`` section of a run's config (workflow dpo, :mod:`relayrl.workflows.dpo`), kept apart from
:mod:`relayrl.config.schema`, which imports it. :func:`relayrl.config.rules.check_dpo` holds the rules across its
keys (which kinds read which options)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DPOConfig"]


class DPOConfig(BaseModel):
    """Direct preference optimisation (workflow dpo): pairs of a chosen and a rejected answer per prompt."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    beta: float = Field(0.1, gt=0.0, description="inverse temperature of the implicit reward")
    kind: Literal["sigmoid", "ipo", "hinge", "apo_zero", "apo_down", "simpo", "orpo", "cpo"] = Field(
        "sigmoid", description="DPO, IPO, SLiC-HF hinge, APO (apo_zero, apo_down), or the reference-free SimPO, "
        "ORPO and CPO (no reference model is loaded; simpo and orpo take length-normalised log-probs; for orpo "
        "dpo.beta is the odds-ratio term's weight lambda; cpo is DPO's sigmoid on the summed log-probs without the "
        "reference, TRL's CPOConfig(loss_type=sigmoid), whose NLL term is dpo.nll_weight)")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="conservative DPO (sigmoid and cpo only)")
    nll_weight: float = Field(0.0, ge=0.0, description="weight of the chosen answers' NLL added to the loss (RPO, "
                              "Pang et al. 2024; TRL's rpo_alpha; with simpo CPO-SimPO and with cpo the CPO paper's "
                              "L_NLL, TRL's cpo_alpha, whose default 1 is nll_weight=1): keeps the chosen answers "
                              "likely; not with orpo, whose loss holds it")
    gamma: float = Field(0.5, ge=0.0, description="dpo.kind=simpo: the target reward margin gamma of -log sigmoid("
                         "beta a_w - beta a_l - gamma), a the average log-probs (TRL's simpo_gamma, default 0.5)")
