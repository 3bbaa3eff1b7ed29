"""The ``trainer`` section of a run's config: steps, batches, the starting model and the reference model's part
(its updates, ``ref_sync_every``; its log-probs computed before training, ``precompute_ref``). Kept apart from
:mod:`relayrl.config.schema`, which imports it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from relayrl.config.paths import LocalPath

__all__ = ["TrainerConfig"]


class TrainerConfig(BaseModel):
    """How the policy is trained: steps, batches, the starting model, and the reference model's part."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    steps: int = Field(100, ge=0, description="training steps (optimizer steps for SFT; RL iterations for GRPO)")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per RL step (PPO mini-batches)")
    epochs: int = Field(1, ge=1, description="passes over each RL batch")
    batch_size: int = Field(64, ge=1, description="SFT: examples per optimizer step; DPO: preference pairs")
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
                                "reset); grpo with a reference (algorithm.kl_coef > 0) and dpo; the reference's "
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
