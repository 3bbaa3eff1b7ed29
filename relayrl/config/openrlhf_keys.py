"""OpenRLHF's command-line flags and estimator names, and relayrl's for them: the table
:mod:`relayrl.config.foreign_keys` hints from.

An OpenRLHF user types flags (``--n_samples_per_prompt 8``) or, having read that relayrl takes ``key=value``,
the flag's name as a key (``n_samples_per_prompt=8``); both are refused naming relayrl's key from this table
(the one-to-one rows of docs/migrating.md's OpenRLHF table, checked against ``openrlhf/cli/train_ppo_ray.py``
of 2026; a test checks every key named here exists).
"""

from __future__ import annotations

__all__ = ["OPENRLHF_KEYS", "OPENRLHF_ADVANTAGES", "OPENRLHF_SAME_VALUES"]

OPENRLHF_KEYS: dict[str, str] = {
    "pretrain": "model.path",
    "reward_pretrain": "reward.model",
    "critic_pretrain": "none (the critic is the policy's network with a zero-initialised value head)",
    "remote_rm_url": "reward.verifier=user reward.user_fn=PATH:NAME (a function that calls your server; a "
                     "reward_func(queries, prompts, labels) file needs a wrapper: docs/migrating.md)",
    "prompt_data": "data.path or data.hf_name",
    "eval_dataset": "data.eval_path",
    "input_key": "data.prompt_key",
    "label_key": "data.answer_key",
    "apply_chat_template": "data.system_prompt or chat-message prompts (rendered with the model's template)",
    "max_samples": "data.max_rows",
    "prompt_max_len": "data.max_prompt_tokens (prompts are never cut: data.long_prompts=fail or drop)",
    "generate_max_len": "rollout.max_new_tokens",
    "n_samples_per_prompt": "rollout.n",
    "rollout_batch_size": "data.prompts_per_step (prompts per step, as OpenRLHF's)",
    "train_batch_size": "trainer.mini_batches (a count: rollout_batch_size x n_samples_per_prompt / "
                        "train_batch_size)",
    "micro_train_batch_size": "engine.token_budget (micro-batches are packed by tokens)",
    "micro_rollout_batch_size": "engine.token_budget",
    "train_max_tokens_per_gpu": "engine.token_budget",
    "use_dynamic_batch": "engine.token_budget (always packed by tokens)",
    "packing_samples": "engine.packing (always packed: shared_prompt by default, sequences as OpenRLHF packs)",
    "max_epochs": "trainer.epochs",
    "num_episodes": "trainer.total_epochs",
    "advantage_estimator": "algorithm.advantage",
    "actor_learning_rate": "engine.optim.lr",
    "critic_learning_rate": "critic.optim.lr",
    "lr_warmup_ratio": "engine.optim.warmup_steps (optimizer steps, not a ratio)",
    "lr_scheduler": "engine.optim.schedule (cosine_with_min_lr: cosine with engine.optim.min_lr_ratio=0.1)",
    "l2": "engine.optim.weight_decay",
    "max_norm": "engine.optim.max_grad_norm",
    "adam_betas": "engine.optim.betas",
    "init_kl_coef": "algorithm.kl_coef (OpenRLHF puts it in the reward unless --use_kl_loss: "
                    "algorithm.kl_in_reward=true)",
    "kl_estimator": "algorithm.kl_kind (OpenRLHF's default k1, relayrl's k3)",
    "use_kl_loss": "algorithm.kl_in_reward=false (the default: a coefficient above 0 adds the KL loss)",
    "kl_target": "algorithm.kl_target",
    "kl_horizon": "algorithm.kl_horizon",
    "eps_clip": "algorithm.clip_low and algorithm.clip_high",
    "eps_clip_low_high": "algorithm.clip_low and algorithm.clip_high",
    "dual_clip": "algorithm.dual_clip",
    "policy_loss_type": "algorithm.ratio_level (gspo: algorithm.ratio_level=sequence)",
    "entropy_loss_coef": "algorithm.entropy_coef",
    "value_clip": "critic.value_clip",
    "lambd": "algorithm.lam",
    "gamma": "algorithm.gamma",
    "freezing_actor_steps": "critic.warmup_steps",
    "normalize_reward": "reward.normalize=running",
    "reward_clip_range": "reward.clip",
    "overlong_buffer_len": "algorithm.overlong_cache (with algorithm.overlong_shaping=true)",
    "overlong_penalty_factor": "algorithm.overlong_penalty",
    "dynamic_filtering": "algorithm.dynamic_sampling",
    "dynamic_filtering_reward_range": "algorithm.dynamic_sampling (groups of equal scores are dropped)",
    "enable_vllm_is_correction": "algorithm.correction.level=token",
    "vllm_is_truncated_threshold": "algorithm.correction.high",
    "async_train": "trainer.off_policy_steps=1",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "eval_temperature": "eval.temperature",
    "eval_n_samples_per_prompt": "eval.k",
    "vllm_num_engines": "placement.pools.NAME and placement.rollout=NAME (the rollout pool's devices / "
                        "rollout.vllm.tensor_parallel_size engines)",
    "vllm_tensor_parallel_size": "rollout.vllm.tensor_parallel_size",
    "vllm_gpu_memory_utilization": "rollout.vllm.memory_utilization",
    "vllm_enable_sleep": "trainer.offload=true",
    "deepspeed_enable_sleep": "trainer.offload=true",
    "colocate_all_models": "placement.rollout=main (the default: every role shares the trainer's devices)",
    "enforce_eager": "rollout.vllm.enforce_eager",
    "enable_prefix_caching": "rollout.vllm.prefix_caching",
    "ring_attn_size": "engine.sequence_parallel (Ulysses, not ring attention)",
    "gradient_checkpointing": "engine.gradient_checkpointing",
    "bf16": "model.dtype=bfloat16",
    "attn_implementation": "model.attn_implementation",
    "adam_offload": "trainer.offload=true",
    "lora_rank": "model.lora.r (with model.lora.enabled=true)",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "target_modules": "model.lora.target_modules",
    "seed": "run.seed",
    "save_path": "run.dir (the model is saved to RUN_DIR/model)",
    "ckpt_path": "run.dir (checkpoints in RUN_DIR/checkpoints)",
    "save_steps": "run.save_every",
    "max_ckpt_num": "run.keep_checkpoints",
    "load_checkpoint": "run.resume=auto",
    "eval_steps": "eval.every",
    "logging_steps": "telemetry.console_table_every",
    "use_wandb": "telemetry.sinks=[console,jsonl,wandb] (and telemetry.wandb_mode=online)",
    "wandb_project": "telemetry.wandb_project",
    "wandb_run_name": "run.dir (the W&B run is named after its last part)",
    "agent_func_path": "env.name (multi-turn episodes: docs/episodes.md)",
}
"""OpenRLHF's flag (without ``--``) -> relayrl's key (or keys, with a note)."""

OPENRLHF_ADVANTAGES: dict[str, str] = {
    "reinforce": "reinforce++",
    "reinforce_baseline": "reinforce++-baseline",
    "group_norm": "grpo",
    "dr_grpo": "drgrpo",
}
"""OpenRLHF's ``--advantage_estimator`` names that relayrl spells otherwise (``gae``, ``rloo`` keep theirs)."""

OPENRLHF_SAME_VALUES: frozenset[str] = frozenset({
    "generate_max_len", "n_samples_per_prompt", "rollout_batch_size", "max_epochs", "actor_learning_rate",
    "critic_learning_rate", "l2", "max_norm", "init_kl_coef", "kl_target", "kl_horizon", "dual_clip",
    "entropy_loss_coef", "value_clip", "lambd", "gamma", "overlong_penalty_factor", "vllm_is_truncated_threshold",
    "temperature", "top_p", "eval_temperature", "eval_n_samples_per_prompt", "vllm_tensor_parallel_size",
    "vllm_gpu_memory_utilization", "lora_rank", "lora_alpha", "lora_dropout", "seed", "save_steps", "max_ckpt_num",
    "eval_steps", "input_key", "label_key", "eval_dataset", "max_samples", "pretrain", "attn_implementation",
    "advantage_estimator",
})
"""The flags whose value is relayrl's key's value unchanged (``--n_samples_per_prompt 8``: ``rollout.n=8``), so a
hint can name the whole override (``--advantage_estimator``'s through :data:`OPENRLHF_ADVANTAGES`). Not the
others: a count of rows where relayrl counts tokens (``micro_train_batch_size``), a ratio where it counts steps
(``lr_warmup_ratio``), one flag for two keys."""
