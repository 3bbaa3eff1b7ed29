"""``model.lora``'s settings (:class:`LoraConfig`); :mod:`relayrl.models.lora` applies them. No torch here: a
recipe is validated before torch is imported."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["ALL_LINEAR", "DEFAULT_TARGETS", "LoraConfig"]

ALL_LINEAR = "all-linear"
"""peft's (and TRL's) ``target_modules`` for every linear layer but the output head: what null resolves to."""

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama, Qwen2, Mistral and their kin (every linear of a decoder layer): what
``target_modules=null`` resolves to on those models, and what the planner counts without a model at hand."""


class LoraConfig(BaseModel):
    """``model.lora``: low-rank adapters on the trained roles instead of training every weight."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(False, description="train LoRA adapters (through peft) on the actor and the critic; "
                          "the base weights stay frozen")
    r: int = Field(16, ge=1, description="rank of each adapter (A: [r, in], B: [out, r])")
    alpha: float = Field(32.0, gt=0, description="the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (0: none)")
    target_modules: list[str] | None = Field(None, description="names of the linear layers that get an adapter "
                                             "(module-name suffixes, as peft matches them); null: every linear layer "
                                             "inside the model's decoder layers, by the names it has (q_proj k_proj "
                                             "v_proj o_proj gate_proj up_proj down_proj on Llama/Qwen2/Gemma, qkv_proj "
                                             "o_proj gate_up_proj down_proj on Phi-3, query_key_value dense ... on "
                                             "GPT-NeoX; MoE experts stored as fused tensors are not linear layers and "
                                             "get none), as peft's all-linear, without the output head. "
                                             "all-linear (peft's and TRL's spelling) is the same as null and is "
                                             "read as null")

    target_parameters: list[str] | None = Field(
        None, description="parameters (not layers) that get an adapter, as peft's target_parameters names them: a "
        "mixture of experts' fused expert tensors, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] on "
        "Qwen3-MoE and Mixtral (one adapter per expert, [experts, out, in] merged as W + scale B A per expert); "
        "with target_modules or its default beside them. Needs model.lora.dropout=0 (peft's)")

    @model_validator(mode="after")
    def _read_when_enabled(self) -> "LoraConfig":
        """A LoRA key without ``model.lora.enabled=true`` would train every weight: refused (verl's
        ``lora_rank > 0`` turns LoRA on, as TRL's ``lora_r`` does not)."""
        unread = sorted(self.model_fields_set - {"enabled"}) if not self.enabled else []
        if unread:
            raise ValueError(f"model.lora.{unread[0]} is read only with model.lora.enabled=true (LoRA is off, "
                             f"and a rank alone does not turn it on: every weight would train); set "
                             f"model.lora.enabled=true, or drop model.lora.{unread[0]} (model.lora={{}} drops a "
                             f"recipe's LoRA keys: a full fine-tune)")
        return self

    @model_validator(mode="after")
    def _parameters_take_no_dropout(self) -> "LoraConfig":
        if self.target_parameters and self.dropout:
            raise ValueError(f"model.lora.target_parameters adapts expert tensors, whose adapters take no dropout "
                             f"(peft cannot factor the input out of them): set model.lora.dropout=0 (got "
                             f"{self.dropout})")
        return self

    @field_validator("target_modules", mode="before")
    @classmethod
    def _all_linear(cls, v: Any) -> Any:
        """peft's ``target_modules="all-linear"`` is null's meaning; peft's other string form (a regular expression
        over module names) is not taken."""
        if v == ALL_LINEAR:
            return None
        if isinstance(v, str):
            raise ValueError(f"model.lora.target_modules={v!r}: relayrl takes a list of layer names "
                             f"(model.lora.target_modules=[q_proj,v_proj]; peft's regular-expression string is not "
                             f"supported) or {ALL_LINEAR} (the same as null, the default: every linear layer of the "
                             f"decoder layers, without the output head)")
        if isinstance(v, (list, tuple)) and ALL_LINEAR in v:
            raise ValueError(f"model.lora.target_modules={list(v)} lists {ALL_LINEAR}, which is not a layer name: "
                             f"write model.lora.target_modules={ALL_LINEAR} (or null) for every linear layer, or "
                             f"list only layer names")
        return v

    @field_validator("target_modules")
    @classmethod
    def _some(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("model.lora.target_modules is empty: name at least one linear layer (e.g. q_proj)")
        return v
