"""The ``kto`` section of a run's config (workflow kto, :mod:`relayrl.workflows.kto`), kept apart from
:mod:`relayrl.config.schema`, which imports it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KTOConfig"]


class KTOConfig(BaseModel):
    """KTO (workflow kto): unpaired completions, each labelled desirable or undesirable (TRL's KTOConfig,
    loss_type kto)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    beta: float = Field(0.1, gt=0.0, description="inverse temperature of the implicit reward beta (log pi - log "
                        "pi_ref) and of the loss 1 - sigmoid(beta (r - z0)) (TRL's beta, default 0.1)")
    desirable_weight: float = Field(1.0, ge=0.0, description="lambda_D: weight of the desirable examples' losses "
                                    "(TRL's desirable_weight; raise it when they are the fewer)")
    undesirable_weight: float = Field(1.0, ge=0.0, description="lambda_U: weight of the undesirable examples' "
                                      "losses (TRL's undesirable_weight)")
