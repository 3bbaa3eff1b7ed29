"""The ``trainer`` section of a run's config: steps, batches, the starting model and the reference model's part
(its updates, ``ref_sync_every``; its log-probs computed before training, ``precompute_ref``), and the run's
length in passes over its dataset (``trainer.total_epochs``, resolved into ``trainer.steps`` once the training
rows are known).

Kept apart from :mod:`relayrl.config.schema`, which imports it; torch-free like the schema.
"""

from __future__ import annotations

from fractions import Fraction
from math import ceil
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.config.paths import LocalPath

__all__ = ["TrainerConfig", "epoch_steps", "rows_per_step", "resolve_total_epochs"]

Config = Any
"""A :class:`relayrl.config.schema.Config` (not imported: the schema imports this module)."""


class TrainerConfig(BaseModel):
    """How long and in what steps a run trains: its length is trainer.steps, or trainer.total_epochs passes over
    the training dataset."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    steps: int = Field(100, ge=0, description="training steps (RL iterations for GRPO; one optimizer step on "
                       "trainer.batch_size examples for sft, dpo, kto and rm); null: unset, to give "
                       "trainer.total_epochs on top of a recipe that sets steps (refused without "
                       "trainer.total_epochs)")
    total_epochs: float | None = Field(None, gt=0, allow_inf_nan=False, description="the run's length in passes "
                                       "over the training dataset (TRL's num_train_epochs, verl's "
                                       "trainer.total_epochs; 1.5 is allowed): trainer.steps becomes ceil("
                                       "total_epochs x rows / rows a step takes) once the rows are loaded, after "
                                       "data.long_prompts=drop and the held-out rows carved from the same file, "
                                       "a step taking data.prompts_per_step prompts (grpo) or trainer.batch_size "
                                       "examples (sft, dpo, kto, rm). Needs data.path or data.hf_name; not with "
                                       "trainer.steps. null: trainer.steps")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per RL step (PPO mini-batches)")
    epochs: int = Field(1, ge=1, description="passes over each RL batch (PPO epochs, verl's "
                        "ppo_epochs; passes over the dataset are trainer.total_epochs)")
    batch_size: int = Field(64, ge=1, description="SFT and KTO: examples per optimizer step; DPO and RM: "
                            "preference pairs (refused in workflow grpo, whose steps take data.prompts_per_step)")
    init_from: LocalPath | None = Field(None, description="start from this model directory (e.g. an SFT run's model/)")
    offload: bool = Field(False, description="colocated memory: each role's idle state leaves the device between "
                          "its phases (the actor's optimizer state and weights during generation, the "
                          "reference's weights outside its pass, the rollout's weights and KV cache outside "
                          "generation); costs host<->device copies (timing/offload_s)")
    mode: Literal["sync", "periodic"] = Field("sync", description="GRPO step: 'sync' trains once the whole batch "
                                              "is generated; 'periodic' (Periodic Asynchrony, needs the rollout on its own "
                                              "pool) runs forward and backward on each prompt group as it "
                                              "arrives and steps the optimizer once per batch: the same update, "
                                              "strictly on-policy, overlapped with generation")
    tri_model: bool = Field(False, description="the actor holds the reference weights in its own layout and "
                            "computes policy, old-policy and reference log-probs in one micro-step (Periodic Asynchrony); "
                            "no separate reference group (needs algorithm.kl_coef > 0)")
    stream_groups: int = Field(1, ge=1, description="streaming stages take up to this many finished prompt "
                               "groups per call (more: fewer, larger passes; fewer: earlier start)")
    off_policy_steps: int = Field(0, ge=0, description="GRPO: k-step off-policy. Rollouts run ahead on their own "
                                  "resource pool (placement.rollout, or a pool 'rollout' of 1 device when none is "
                                  "named), every token sampled by weights at most k updates older than the update "
                                  "that uses it (staleness bound); 0: on-policy (trainer.mode)")
    ref_sync_every: int = Field(0, ge=0, description="move the reference model toward the policy every N steps: "
                                "reference <- ref_sync_alpha x policy + (1 - ref_sync_alpha) x reference (TR-DPO, "
                                "Gorbatovski et al. 2024; TRL's sync_ref_model; ref_sync_alpha=1 is ProRL's reference "
                                "reset); grpo with a reference (algorithm.kl_coef > 0), dpo and kto; the reference's "
                                "weights are then part of every checkpoint. 0: the reference stays the starting "
                                "model")
    ref_sync_alpha: float = Field(0.6, gt=0.0, le=1.0, description="trainer.ref_sync_every: the policy's weight in "
                                  "the mix (TRL's ref_model_mixup_alpha)")
    precompute_ref: bool = Field(False, description="workflow dpo and kto: run the reference model once, before the "
                                 "first step, over every row the run will train on (dpo: each pair's chosen and "
                                 "rejected answer; kto: each example and the mismatched row of its step's KL "
                                 "estimate), keep each row's summed log-prob and release the reference: the steps "
                                 "run no reference pass and hold no reference model (TRL's precompute_ref_log_probs). "
                                 "A resumed run computes them again for its steps left. Not with "
                                 "trainer.ref_sync_every or a reference-free dpo.kind")

    @model_validator(mode="before")
    @classmethod
    def _null_steps(cls, data: Any) -> Any:
        """``trainer.steps=null`` leaves the key unset (its default, and not given), so that a recipe's steps
        can give way to ``trainer.total_epochs``; without ``total_epochs`` it would run the default length, which
        nobody asked for, so it is refused."""
        if isinstance(data, dict) and "steps" in data and data["steps"] is None:
            if data.get("total_epochs") is None:
                default = cls.model_fields["steps"].default
                raise ValueError(f"trainer.steps=null unsets the run's length so that trainer.total_epochs gives it, "
                                 f"and trainer.total_epochs is not set (the run would take the default {default} "
                                 f"steps): give trainer.steps=N or trainer.total_epochs=E")
            data = {k: v for k, v in data.items() if k != "steps"}
        return data

    @model_validator(mode="after")
    def _one_length(self) -> "TrainerConfig":
        if self.total_epochs is not None and "steps" in self.model_fields_set:
            raise ValueError(f"trainer.steps={self.steps} and trainer.total_epochs={self.total_epochs:g} both set "
                             f"the run's length: give one of them (trainer.steps=null drops a recipe's steps)")
        return self


def epoch_steps(total_epochs: float, rows: int, per_step: int) -> int:
    """Steps of ``per_step`` rows each that pass over ``rows`` rows ``total_epochs`` times: ceil(total_epochs x
    rows / per_step), the last step finishing the last pass (TRL's num_train_epochs and verl's total_epochs
    count the same way, from the dataloader's batches). ``total_epochs`` is read as the decimal it prints as,
    so that 0.1 x 30 / 3 is 1 step, not 2."""
    if rows < 1 or per_step < 1 or not total_epochs > 0:
        raise ValueError(f"epoch_steps needs total_epochs > 0, rows >= 1 and per_step >= 1 (got {total_epochs}, "
                         f"{rows}, {per_step})")
    return ceil(Fraction(repr(float(total_epochs))) * rows / per_step)


def rows_per_step(cfg: Config) -> tuple[int, str]:
    """The rows a step of ``cfg.workflow`` takes from the prompt source, and the key that sets it: grpo draws
    ``data.prompts_per_step`` prompts (dynamic sampling's resample rounds draw more, as many as it needs), the
    offline workflows take ``trainer.batch_size`` rows (sft examples, dpo and rm pairs, kto completions)."""
    if cfg.workflow == "grpo":
        return cfg.data.prompts_per_step, "data.prompts_per_step"
    return cfg.trainer.batch_size, "trainer.batch_size"


def resolve_total_epochs(cfg: Config, rows: int) -> tuple[Config, str | None]:
    """``cfg`` with ``trainer.total_epochs`` turned into ``trainer.steps`` over ``rows`` training rows, and the
    line that says so (``cfg`` itself and None when ``total_epochs`` is not set). The copy records the steps
    it ran (``total_epochs`` null), so that its saved ``config.json`` loads again as it is."""
    epochs = cfg.trainer.total_epochs
    if epochs is None:
        return cfg, None
    per_step, key = rows_per_step(cfg)
    steps = epoch_steps(epochs, rows, per_step)
    trainer = cfg.trainer.model_copy(update={"steps": steps, "total_epochs": None})
    line = (f"trainer.total_epochs={epochs:g} over {rows:,} rows at {per_step:,} a step ({key}): {steps:,} "
            f"step{'s' if steps != 1 else ''}")
    return cfg.model_copy(update={"trainer": trainer}), line
