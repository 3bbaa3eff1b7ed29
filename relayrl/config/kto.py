"""The ``kto`` section of a run's config (workflow kto, :mod:`relayrl.workflows.kto`), kept apart from
:mod:`relayrl.config.schema`, which imports it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KTOConfig"]


class KTOConfig(BaseModel):
    """KTO (workflow kto): unpaired completions, each labelled desirable or undesirable (TRL's KTOConfig,
    loss_type kto or apo_zero_unpaired)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    loss: Literal["kto", "apo_zero_unpaired"] = Field(
        "kto", description="with r = log pi - log pi_ref of a completion, kto: KTO's loss against z0, the KL "
        "estimate on the batch's mismatched (prompt, completion) rows (the paper's eq. 7); apo_zero_unpaired: "
        "unpaired APO-zero, desirable 1 - sigmoid(beta r) and undesirable sigmoid(beta r), against no KL estimate "
        "(no mismatched rows, no KL pass; trainer.batch_size may be 1). TRL's loss_type, default kto as there")
    beta: float = Field(0.1, gt=0.0, description="inverse temperature of the implicit reward beta (log pi - log "
                        "pi_ref) and of the loss 1 - sigmoid(beta (r - z0)) (TRL's beta, default 0.1)")
    desirable_weight: float = Field(1.0, ge=0.0, description="lambda_D: weight of the desirable examples' losses "
                                    "(TRL's desirable_weight; raise it when they are the fewer)")
    undesirable_weight: float = Field(1.0, ge=0.0, description="lambda_U: weight of the undesirable examples' "
                                      "losses (TRL's undesirable_weight)")
