"""verl's config keys and names, and relayrl's for them: the table :mod:`relayrl.config.foreign_keys` hints from.

A verl user's first command carries verl's keys (``data.train_batch_size``, ``actor_rollout_ref.rollout.n``);
each is refused like any unknown key, and the message names relayrl's key for it from this table (the
one-to-one rows of docs/migrating.md's verl table; a test checks every key named here exists).
"""

from __future__ import annotations

__all__ = ["VERL_KEYS", "VERL_ADVANTAGES", "VERL_SECTIONS"]

_ARR = "actor_rollout_ref"
VERL_SECTIONS = frozenset({_ARR, "custom_reward_function", "reward_model"})
"""verl's top-level sections that relayrl has no section of that name for."""

VERL_KEYS: dict[str, str] = {
    "data.train_files": "data.path",
    "data.val_files": "data.eval_path",
    "data.train_batch_size": "data.prompts_per_step (prompts per step, as verl's)",
    "data.max_prompt_length": "data.max_prompt_tokens",
    "data.filter_overlong_prompts": "data.long_prompts=drop",
    "data.truncation": "data.long_prompts (prompts are never cut: fail or drop)",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.apply_chat_template_kwargs": "data.chat_template_kwargs",
    "data.train_max_samples": "data.max_rows",
    "data.seed": "run.seed",
    "algorithm.adv_estimator": "algorithm.advantage",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.normalize_std",
    "algorithm.use_kl_in_reward": "algorithm.kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl_kind",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_ctrl.type": "algorithm.kl_target (set: adaptive)",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_horizon",
    "algorithm.filter_groups.enable": "algorithm.dynamic_sampling",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.max_resample_rounds",
    "algorithm.filter_groups.metric": "algorithm.dynamic_sampling_metric",
    f"{_ARR}.model.path": "model.path",
    f"{_ARR}.model.custom_chat_template": "model.chat_template",
    f"{_ARR}.model.enable_gradient_checkpointing": "engine.gradient_checkpointing",
    f"{_ARR}.model.lora_rank": "model.lora.r (with model.lora.enabled=true)",
    f"{_ARR}.model.lora_alpha": "model.lora.alpha",
    f"{_ARR}.model.target_modules": "model.lora.target_modules",
    f"{_ARR}.actor.optim.lr": "engine.optim.lr",
    f"{_ARR}.actor.optim.lr_warmup_steps": "engine.optim.warmup_steps",
    f"{_ARR}.actor.optim.lr_warmup_steps_ratio": "engine.optim.warmup_steps (optimizer steps, not a ratio)",
    f"{_ARR}.actor.optim.lr_scheduler_type": "engine.optim.schedule",
    f"{_ARR}.actor.optim.warmup_style": "engine.optim.schedule",
    f"{_ARR}.actor.optim.min_lr_ratio": "engine.optim.min_lr_ratio",
    f"{_ARR}.actor.optim.weight_decay": "engine.optim.weight_decay (relayrl's default 0, verl's 0.01)",
    f"{_ARR}.actor.grad_clip": "engine.optim.max_grad_norm",
    f"{_ARR}.actor.use_kl_loss": "algorithm.kl_coef (no switch: a coefficient above 0 adds the KL loss)",
    f"{_ARR}.actor.kl_loss_coef": "algorithm.kl_coef",
    f"{_ARR}.actor.kl_loss_type": "algorithm.kl_kind",
    f"{_ARR}.actor.clip_ratio": "algorithm.clip_low and algorithm.clip_high",
    f"{_ARR}.actor.clip_ratio_low": "algorithm.clip_low",
    f"{_ARR}.actor.clip_ratio_high": "algorithm.clip_high",
    f"{_ARR}.actor.clip_ratio_c": "algorithm.dual_clip (off by default here, 3.0 in verl)",
    f"{_ARR}.actor.loss_agg_mode": "algorithm.loss_agg",
    f"{_ARR}.actor.entropy_coeff": "algorithm.entropy_coef",
    f"{_ARR}.actor.ppo_epochs": "trainer.epochs",
    f"{_ARR}.actor.ppo_mini_batch_size": "trainer.mini_batches (a count: train_batch_size / ppo_mini_batch_size)",
    f"{_ARR}.actor.ppo_micro_batch_size_per_gpu": "engine.token_budget (micro-batches are packed by tokens)",
    f"{_ARR}.actor.ppo_max_token_len_per_gpu": "engine.token_budget",
    f"{_ARR}.actor.use_dynamic_bsz": "engine.token_budget (always packed by tokens)",
    f"{_ARR}.actor.policy_loss.loss_mode": "algorithm.policy_loss (gspo: algorithm.ratio_level=sequence)",
    f"{_ARR}.actor.ulysses_sequence_parallel_size": "engine.sequence_parallel",
    f"{_ARR}.actor.fsdp_config.param_offload": "trainer.offload",
    f"{_ARR}.actor.fsdp_config.optimizer_offload": "trainer.offload",
    f"{_ARR}.actor.fsdp_config.dtype": "model.dtype",
    f"{_ARR}.rollout.n": "rollout.n",
    f"{_ARR}.rollout.temperature": "rollout.temperature",
    f"{_ARR}.rollout.top_p": "rollout.top_p",
    f"{_ARR}.rollout.top_k": "rollout.top_k (verl's -1 is 0)",
    f"{_ARR}.rollout.name": "rollout.engine",
    f"{_ARR}.rollout.gpu_memory_utilization": "rollout.vllm.memory_utilization",
    f"{_ARR}.rollout.max_model_len": "rollout.vllm.max_model_len",
    f"{_ARR}.rollout.enforce_eager": "rollout.vllm.enforce_eager",
    f"{_ARR}.rollout.enable_prefix_caching": "rollout.vllm.prefix_caching",
    f"{_ARR}.rollout.tensor_model_parallel_size": "rollout.vllm.tensor_parallel_size",
    f"{_ARR}.rollout.log_prob_micro_batch_size_per_gpu": "engine.token_budget",
    f"{_ARR}.rollout.log_prob_max_token_len_per_gpu": "engine.token_budget",
    f"{_ARR}.rollout.val_kwargs.n": "eval.k",
    f"{_ARR}.rollout.val_kwargs.temperature": "eval.temperature",
    f"{_ARR}.rollout.val_kwargs.top_p": "eval.top_p",
    f"{_ARR}.rollout.val_kwargs.top_k": "eval.top_k (verl's -1 is 0)",
    f"{_ARR}.rollout.val_kwargs.do_sample": "eval.k (the greedy answer is always evaluated; eval.k > 1 also "
                                            "samples k)",
    f"{_ARR}.ref.log_prob_micro_batch_size_per_gpu": "engine.token_budget",
    f"{_ARR}.ref.log_prob_max_token_len_per_gpu": "engine.token_budget",
    "trainer.total_training_steps": "trainer.steps",
    "trainer.logger": "telemetry.sinks",
    "trainer.project_name": "telemetry.wandb_project",
    "trainer.experiment_name": "run.dir (the W&B run is named after its last part)",
    "trainer.default_local_dir": "run.dir",
    "trainer.resume_mode": "run.resume",
    "trainer.resume_from_path": "run.resume",
    "trainer.save_freq": "run.save_every",
    "trainer.max_actor_ckpt_to_keep": "run.keep_checkpoints",
    "trainer.test_freq": "eval.every",
    "trainer.val_before_train": "eval.before_training",
    "trainer.val_only": "relayrl eval --model DIR --recipe RECIPE",
    "trainer.n_gpus_per_node": "cluster.devices",
    "trainer.nnodes": "cluster.nodes",
    "trainer.critic_warmup": "critic.warmup_steps",
    "trainer.rollout_data_dir": "telemetry.samples_per_step",
    "critic.cliprange_value": "critic.value_clip",
    "custom_reward_function.path": "reward.verifier=user reward.user_fn=PATH:NAME",
    "custom_reward_function.name": "reward.verifier=user reward.user_fn=PATH:NAME",
    "reward_model.enable": "reward.model (a directory: on when set)",
    "reward_model.model.path": "reward.model",
}
"""verl's key -> relayrl's key (or keys, with a note)."""

VERL_ADVANTAGES: dict[str, str] = {
    "reinforce_plus_plus": "reinforce++",
    "reinforce_plus_plus_baseline": "reinforce++-baseline",
    "grpo_passk": "grpo-passk",
    "optimal_token_baseline": "otb",
    "tir_optimal_token_baseline": "otb-tir",
}
"""verl's ``algorithm.adv_estimator`` names that relayrl spells otherwise (the rest keep their names)."""

