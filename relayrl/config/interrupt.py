"""``rollout.interrupt``: forced length interruption (ScaleRL's thinking budget,
:mod:`relayrl.engines.generation.interrupt`), kept apart from :mod:`relayrl.config.schema`, which imports it.
Torch-free: the phrase's exact token count is checked when the tokenizer loads (before any generation)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["InterruptConfig", "SCALERL_PHRASE", "check_interrupt"]

SCALERL_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
"""ScaleRL's end-of-thinking phrase (Khatri et al. 2025)."""


class InterruptConfig(BaseModel):
    """``rollout.interrupt``: a response that reaches ``after_tokens`` without ending and without the
    ``marker`` gets ``text`` appended and writes its answer in ``answer_tokens`` more."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    after_tokens: int | None = Field(
        None, ge=1, description="the thinking budget: a response that reaches this many tokens without an "
        "end-of-sequence or stop and without rollout.interrupt.marker gets rollout.interrupt.text's tokens "
        "appended (loss_mask 0: never trained on) and goes on for up to rollout.interrupt.answer_tokens (ScaleRL's "
        "forced interruption, Qwen3's thinking budget). A response that closed its thinking goes on to "
        "rollout.max_new_tokens, which caps every response, phrase included, so after_tokens + the phrase + "
        "answer_tokens must fit in it. null: off")
    text: str = Field(SCALERL_PHRASE, min_length=1, description="the phrase written after the thinking budget, "
                      "tokenized once with the model's tokenizer (no special tokens added); ScaleRL's by default. "
                      "It should close the thinking as the model's template does (Qwen3: </think>)")
    answer_tokens: int | None = Field(
        None, ge=1, description="the answer budget: tokens the model may write after the phrase (null: what "
        "rollout.max_new_tokens leaves after after_tokens and the phrase)")
    marker: str = Field("</think>", min_length=1, description="the text that says a response closed its "
                        "thinking (found in its decoded tokens, special tokens kept): a response that holds it at "
                        "after_tokens is not interrupted")
    eval: bool = Field(True, description="held-out evaluation applies the same budget (as ScaleRL evaluates), with "
                       "eval.max_new_tokens (if set) as the cap; false: evaluation answers without interruption")

    @model_validator(mode="after")
    def _off(self) -> "InterruptConfig":
        if self.after_tokens is None:
            unread = sorted(self.model_fields_set - {"after_tokens"})
            if unread:
                raise ValueError(f"rollout.interrupt.{unread[0]} is read only with rollout.interrupt.after_tokens "
                                 f"set (the thinking budget); set it or drop rollout.interrupt.{unread[0]}")
        return self

    @property
    def enabled(self) -> bool:
        return self.after_tokens is not None


def check_interrupt(cfg) -> None:
    """Refuse ``rollout.interrupt`` where it cannot run, naming the keys (a ``Config``)."""
    it, ro = cfg.rollout.interrupt, cfg.rollout
    if not it.enabled:
        return
    if ro.engine == "openai":
        raise ValueError("rollout.interrupt re-enters a response into the running batch with the phrase's tokens, "
                         "which a server (rollout.engine=openai) cannot do: use rollout.engine=native or vllm, or "
                         "drop rollout.interrupt.after_tokens")
    if cfg.env.name is not None:
        raise ValueError(f"rollout.interrupt cuts a single response; env.name={cfg.env.name} runs multi-turn "
                         f"episodes, whose turns have their own budget (env.max_tokens and rollout.max_new_tokens "
                         f"per turn): drop rollout.interrupt.after_tokens or env.name")
    budgets = [("rollout.max_new_tokens", ro.max_new_tokens)]
    if it.eval and cfg.eval.max_new_tokens is not None:
        budgets.append(("eval.max_new_tokens", cfg.eval.max_new_tokens))
    for key, budget in budgets:
        need = it.after_tokens + 1 + (it.answer_tokens or 1)  # (the phrase has one token at least)
        if need > budget:
            raise ValueError(f"rollout.interrupt.after_tokens={it.after_tokens} + the phrase + "
                             f"{'rollout.interrupt.answer_tokens=' + str(it.answer_tokens) if it.answer_tokens else 'an answer'} "
                             f"must fit in {key}={budget}, which caps the whole response: raise {key} (to "
                             f"after_tokens + the phrase's tokens + answer_tokens) or lower "
                             f"rollout.interrupt.after_tokens")
