"""The ``model`` section of a run's config (:class:`ModelConfig`): which model, its precision, device, LoRA
adapters, attention and chat template. No torch here: a recipe is validated before torch is imported."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relayrl.config.paths import LocalPath
from relayrl.models.chat_template import read_chat_template
from relayrl.models.lora_config import LoraConfig
from relayrl.models.tiny import TinyModelConfig

__all__ = ["ModelConfig"]


class ModelConfig(BaseModel):
    """The policy model: a local Hugging Face directory (or the tiny default), its dtype and device, LoRA and the
    chat template."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    path: LocalPath | None = Field(None, description="local Hugging Face model directory; null builds the tiny default")
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="compute dtype of the training passes, and the reference's and (by default) the "
        "rollout's weight dtype. With bfloat16 the trained weights and the optimizer state stay float32 (mixed "
        "precision: float32 master weights, bf16 compute) unless model.pure_low_precision. float16 is refused "
        "(its gradients underflow without loss scaling, which relayrl does not do; rollout.dtype=float16 is fine)")
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the weights a run saves to RUN_DIR/model, a policy or (workflow rm) a reward "
        "model (its config.json's dtype too). auto: "
        "the dtype of the checkpoint the run started from (model.path or trainer.init_from, as its config.json "
        "says; float32 for the tiny default), so a bf16 checkpoint exports as bf16 and not as the float32 weights "
        "relayrl trains (twice the size, and loaded in float32 by transformers' dtype=auto); float32 keeps those as "
        "they are. Checkpoints (RUN_DIR/checkpoints) always keep the trained weights' own dtype")
    pure_low_precision: bool = Field(
        False, description="train weights stored in model.dtype itself, with no float32 master copy. Updates "
        "smaller than the dtype's resolution are lost (a bf16 weight of 0.02 ignores steps below ~1e-4), so "
        "this must be asked for explicitly")
    head_fp32: bool = Field(
        False, description="compute the output head (the logits) in float32 whatever model.dtype: hidden states and "
        "head weight cast to float32 for the product (the weight's storage is unchanged) in every policy pass of the "
        "trainer (update, old and reference log-probs; not a critic's value head) and in the rollout's sampling "
        "and log-probs (native engine, both decode paths; rollout.engine=vllm through vLLM's head_dtype; an "
        "openai server keeps its own precision). ScaleRL's FP32 logits, TRL's cast_lm_head_to_fp32: trainer and "
        "generator then round their logits alike, and their log-probs agree more closely. Needs a "
        "low-precision model.dtype or rollout.dtype")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the models run: auto takes CUDA "
                                                   "when torch sees a GPU, else the CPU")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters on the trained roles (peft); the rollout "
                             "gets merged weights, checkpoints hold the adapters")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="attention of the trained and frozen models. flex_attention (CUDA): the packed "
        "training passes attend only the tiles of the pack that the shared-prompt mask needs (a FlexAttention "
        "BlockMask) instead of a dense masked square; the rollout engine still decodes with sdpa")
    chat_template: str | None = Field(
        None, description="the chat template the run renders chat prompts with, in place of the tokenizer's "
        "(TRL's chat_template_path, verl's custom_chat_template): a Jinja file (.jinja, .j2, .txt), a tokenizer "
        "directory (its chat_template.jinja or tokenizer_config.json's template), or the template itself (a "
        "string holding {% or {{). Training and held-out prompts, multi-turn SFT masks and tool turns use it, "
        "and RUN_DIR/model's tokenizer is saved with it; a reward model or judge that scores the run keeps its "
        "own. Null: the tokenizer's own")

    @field_validator("chat_template", mode="after")
    @classmethod
    def _template_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            read_chat_template(value)  # a missing file, no template, or one that does not compile: refused now
        return value

    @model_validator(mode="after")
    def _flex_on_cuda(self) -> "ModelConfig":
        if self.attn_implementation == "flex_attention" and self.device == "cpu":
            raise ValueError("model.attn_implementation=flex_attention trains on CUDA only (torch has no "
                             "FlexAttention backward pass on CPU); set model.attn_implementation=sdpa on CPU")
        return self

    def template(self) -> str | None:
        """The text of ``model.chat_template`` (read again from its file or directory), or None for the
        tokenizer's own: what :func:`relayrl.models.load.load_tokenizer` puts on the run's tokenizer."""
        return None if self.chat_template is None else read_chat_template(self.chat_template)
