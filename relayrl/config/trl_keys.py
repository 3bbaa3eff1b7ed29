"""TRL's config names and relayrl's keys for them: the table :mod:`relayrl.config.foreign_keys` hints from.

TRL's options are flat fields of its dataclasses (``GRPOConfig``, ``DPOConfig``, ``CPOConfig``, ``ORPOConfig``,
``KTOConfig``, ``OnlineDPOConfig``, ``SFTConfig``, ``RewardConfig``, and the ``TrainingArguments`` and
``ModelConfig`` they share). A TRL user
writes one as a top-level key (``num_generations=8``) or under the relayrl section it seems to belong to
(``dpo.loss_type=ipo``, ``trainer.sync_ref_model=true``); both are refused naming relayrl's key from this table,
the one-to-one rows of docs/migrating.md's TRL tables (checked there against TRL's ``grpo_config.py``,
``dpo_config.py``, ``kto_config.py`` and ``experimental/`` of 2026; "none" where relayrl has no equivalent; a test
checks every key named here exists). One name may mean different things in different TRL trainers (``beta``,
``loss_type``): the entry names each.
"""

from __future__ import annotations

__all__ = ["TRL_KEYS", "TRL_SAME_VALUES"]

TRL_KEYS: dict[str, str] = {
    # model and data
    "model_name_or_path": "model.path",
    "train_dataset": "data.hf_name or data.path",
    "eval_dataset": "data.eval_path or data.hf_eval_split",
    "chat_template_path": "model.chat_template",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "shuffle_dataset": "data.shuffle",
    "max_prompt_length": "data.max_prompt_tokens (prompts are never cut: data.long_prompts=drop leaves such a row out)",
    "max_length": "data.max_prompt_tokens (OnlineDPOConfig's; prompts are never cut: data.long_prompts)",
    # batch, steps, epochs
    "num_generations": "rollout.n",
    "per_device_train_batch_size": "data.prompts_per_step (GRPO: per-device batch x GPUs x accumulation steps / "
                                   "num_generations, TRL counts completions; KTOConfig's: trainer.batch_size)",
    "gradient_accumulation_steps": "data.prompts_per_step (per-device batch x GPUs x accumulation steps / "
                                   "num_generations)",
    "generation_batch_size": "data.prompts_per_step (generation_batch_size / num_generations prompts)",
    "steps_per_generation": "trainer.mini_batches (steps_per_generation / gradient_accumulation_steps optimizer "
                            "steps a batch)",
    "num_iterations": "trainer.epochs (passes over each generated batch)",
    "max_steps": "trainer.steps (TRL counts optimizer steps, relayrl RL steps)",
    "num_train_epochs": "trainer.total_epochs (passes over the dataset)",
    "max_completion_length": "rollout.max_new_tokens",
    "max_new_tokens": "rollout.max_new_tokens (OnlineDPOConfig's)",
    # optimizer
    "learning_rate": "engine.optim.lr (relayrl's default 1e-5, TRL's 1e-6)",
    "lr_scheduler_type": "engine.optim.schedule (constant, linear or cosine; engine.optim.min_lr_ratio its floor)",
    "warmup_steps": "engine.optim.warmup_steps",
    "warmup_ratio": "engine.optim.warmup_steps (optimizer steps: the ratio times the run's optimizer steps)",
    "weight_decay": "engine.optim.weight_decay",
    "max_grad_norm": "engine.optim.max_grad_norm",
    # the loss
    "beta": "algorithm.kl_coef (GRPOConfig's; DPOConfig's, CPOConfig's and ORPOConfig's beta is dpo.beta, "
            "KTOConfig's kto.beta, OnlineDPOConfig's algorithm.online_dpo.beta)",
    "loss_type": "algorithm.loss_agg or algorithm.policy_loss (GRPOConfig's: grpo is algorithm.loss_agg="
                 "seq-mean-token-mean, dapo and bnpo token-mean, dr_grpo seq-mean-token-sum-norm; cispo, sapo and "
                 "vespo are algorithm.policy_loss; DPOConfig's and CPOConfig's loss_type is dpo.kind, KTOConfig's "
                 "kto.loss, OnlineDPOConfig's algorithm.online_dpo.kind)",
    "epsilon": "algorithm.clip_low (TRL copies it into an unset epsilon_high; algorithm.clip_high is independent)",
    "epsilon_high": "algorithm.clip_high",
    "delta": "algorithm.dual_clip",
    "sapo_temperature_pos": "algorithm.sapo.tau_pos (with algorithm.policy_loss=sapo)",
    "sapo_temperature_neg": "algorithm.sapo.tau_neg (with algorithm.policy_loss=sapo)",
    "vespo_k_pos": "algorithm.vespo.k_pos (with algorithm.policy_loss=vespo)",
    "vespo_lambda_pos": "algorithm.vespo.lambda_pos (with algorithm.policy_loss=vespo)",
    "vespo_k_neg": "algorithm.vespo.k_neg (with algorithm.policy_loss=vespo)",
    "vespo_lambda_neg": "algorithm.vespo.lambda_neg (with algorithm.policy_loss=vespo)",
    "use_bias_correction_kl": "algorithm.kl_bias_correction",
    "scale_rewards": "algorithm.normalize_std (group: true; none: false; batch: algorithm.advantage=grpo-batch-std)",
    "importance_sampling_level": "algorithm.ratio_level",
    "mask_truncated_completions": "algorithm.overlong_filter",
    "off_policy_mask_threshold": "algorithm.correction.kl_threshold (with algorithm.correction.negative_only=true)",
    "entropy_coef": "algorithm.entropy_coef",
    "use_adaptive_entropy": "algorithm.entropy_target (set: adaptive)",
    "entropy_target": "algorithm.entropy_target",
    "entropy_coef_delta": "algorithm.entropy_coef_delta",
    "entropy_coef_min": "algorithm.entropy_coef_min",
    "entropy_coef_max": "algorithm.entropy_coef_max",
    "label_smoothing": "dpo.label_smoothing (OnlineDPOConfig's: algorithm.online_dpo.label_smoothing)",
    "rpo_alpha": "dpo.nll_weight (RPO; newer TRL: loss_type=[sigmoid, sft] with loss_weights)",
    "loss_weights": "dpo.nll_weight (loss_type=[sigmoid, sft] with loss_weights=[1, a]: a)",
    "simpo_gamma": "dpo.gamma (with dpo.kind=simpo)",
    "cpo_alpha": "dpo.nll_weight (TRL's default 1, relayrl's 0)",
    "desirable_weight": "kto.desirable_weight",
    "undesirable_weight": "kto.undesirable_weight",
    # the reference model
    "sync_ref_model": "trainer.ref_sync_every (set: the reference moves every N steps, TRL's ref_model_sync_steps)",
    "ref_model_sync_steps": "trainer.ref_sync_every (RL steps in workflow grpo; TRL counts optimizer steps)",
    "ref_model_mixup_alpha": "trainer.ref_sync_alpha",
    "precompute_ref_log_probs": "trainer.precompute_ref",
    "precompute_ref_batch_size": "none (a call takes a step's rows)",
    # generation
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "min_p": "rollout.min_p",
    "repetition_penalty": "rollout.repetition_penalty",
    "generation_kwargs": "none (stop strings: rollout.stop_strings)",
    "use_vllm": "rollout.engine=vllm",
    "vllm_mode": "rollout.engine=vllm (colocate; server: rollout.engine=openai with rollout.base_url and "
                 "rollout.weight_sync=vllm)",
    "vllm_server_base_url": "rollout.base_url (with rollout.engine=openai)",
    "vllm_gpu_memory_utilization": "rollout.vllm.memory_utilization",
    "vllm_max_model_length": "rollout.vllm.max_model_len",
    "vllm_tensor_parallel_size": "rollout.vllm.tensor_parallel_size",
    "vllm_enable_sleep_mode": "trainer.offload=true",
    "vllm_importance_sampling_correction": "algorithm.correction.level",
    "vllm_importance_sampling_mode": "algorithm.correction.level and algorithm.correction.mode (token_* or "
                                     "sequence_* the level, *_truncate or *_mask the mode)",
    "vllm_importance_sampling_clip_max": "algorithm.correction.high",
    "vllm_importance_sampling_clip_min": "algorithm.correction.low",
    "ds3_gather_for_generation": "none (FSDP2's weights reach the rollout through the weight relay)",
    # rewards
    "reward_funcs": "reward.verifier=user reward.user_fn",
    "reward_weights": "reward.user_weights",
    "reward_model_path": "reward.model",
    "multi_objective_aggregation": "reward.user_aggregation (sum_then_normalize: sum; normalize_then_sum with "
                                   "algorithm.advantage=grpo-batch-std)",
    "missing_eos_penalty": "none (a user reward function can subtract it)",
    "tools": "env.tools (with env.name=tools)",
    # engine, precision, LoRA
    "disable_dropout": "engine.dropout (auto: none in RL, DPO and reward-model runs)",
    "gradient_checkpointing": "engine.gradient_checkpointing",
    "bf16": "model.dtype=bfloat16",
    "cast_lm_head_to_fp32": "model.head_fp32",
    "use_peft": "model.lora.enabled",
    "peft_config": "model.lora.enabled",
    "lora_r": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
    # SFTConfig and RewardConfig (docs/migrating.md's SFTTrainer and RewardTrainer tables)
    "dataset_text_field": "none (a row needs a prompt and a completion: data.prompt_key, data.answer_key)",
    "completion_only_loss": "always on in workflow sft (the completion and its EOS are trained)",
    "assistant_only_loss": "data.messages_key (every assistant turn trained, the other turns never)",
    "packing": "engine.packing (always packed; each row attends only to itself)",
    "packing_strategy": "engine.packing",
    "padding_free": "engine.packing (the packed layout has no padding between rows)",
    "eos_token": "none (the tokenizer's EOS ends every completion)",
    "neftune_noise_alpha": "none",
    "activation_offloading": "none (engine.gradient_checkpointing)",
    "model_init_kwargs": "model.dtype, model.attn_implementation",
    "router_aux_loss_coef": "engine.router_aux_loss_coef",
    "center_rewards_coefficient": "none (a GRPO run can whiten the scores: reward.normalize=running)",
    # logging, checkpoints, evaluation
    "report_to": "telemetry.sinks (wandb: telemetry.sinks=[console,jsonl,wandb], telemetry.wandb_mode=online)",
    "logging_steps": "telemetry.console_table_every (every step is logged; this sets only the console table)",
    "log_completions": "telemetry.samples_per_step",
    "num_completions_to_print": "telemetry.samples_per_step",
    "output_dir": "run.dir",
    "resume_from_checkpoint": "run.resume",
    "save_steps": "run.save_every",
    "save_total_limit": "run.keep_checkpoints",
    "eval_strategy": "eval.every",
    "eval_steps": "eval.every",
    "num_generations_eval": "eval.k",
    "seed": "run.seed",
}
"""TRL's option name -> relayrl's key (or keys, with a note after `` (``)."""

TRL_SAME_VALUES = frozenset({
    "num_generations", "num_iterations", "num_train_epochs", "max_completion_length", "max_new_tokens",
    "learning_rate", "warmup_steps", "weight_decay", "max_grad_norm", "epsilon_high", "delta",
    "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg", "importance_sampling_level", "mask_truncated_completions", "entropy_coef", "entropy_target",
    "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max", "simpo_gamma", "cpo_alpha", "desirable_weight",
    "undesirable_weight", "ref_model_mixup_alpha", "precompute_ref_log_probs", "temperature", "top_p", "top_k",
    "min_p", "repetition_penalty", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
    "vllm_importance_sampling_clip_max", "reward_weights", "reward_model_path", "gradient_checkpointing",
    "cast_lm_head_to_fp32", "use_peft", "lora_r", "lora_alpha", "lora_dropout", "output_dir", "save_steps",
    "save_total_limit", "eval_steps", "num_generations_eval", "seed", "use_bias_correction_kl",
    "router_aux_loss_coef",
})
"""TRL's options whose value is the value of relayrl's key unchanged (``num_generations=8``: ``rollout.n=8``)."""
