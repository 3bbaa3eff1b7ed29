"""NeMo-RL's config keys, and relayrl's for them: the table :mod:`relayrl.config.foreign_keys` hints from.

A NeMo-RL user brings its YAML sections (``grpo:``, ``loss_fn:``, ``policy:``, ``checkpointing:``, ``logger:``,
``cluster:``, ``dpo:``) in a recipe or as dotted overrides (``grpo.num_generations_per_prompt=8``); each key is
refused naming relayrl's from this table (the one-to-one rows of docs/migrating.md's NeMo-RL table, checked
against ``examples/configs/grpo_math_1B.yaml`` and ``dpo.yaml`` of 2026; a test checks every key named here
exists). ``cluster``, ``data``, ``env`` and ``dpo`` are sections of relayrl's too: only their NeMo-RL keys are
refused. ``policy.train_global_batch_size`` counts responses in GRPO and pairs in DPO.
"""

from __future__ import annotations

__all__ = ["NEMO_RL_KEYS", "NEMO_RL_SECTIONS"]

NEMO_RL_SECTIONS = frozenset({"grpo", "loss_fn", "policy", "checkpointing", "logger", "sft"})
"""NeMo-RL's top-level sections that relayrl has no section of that name for."""

_GEN = "policy.generation"
NEMO_RL_KEYS: dict[str, str] = {
    "defaults": "base (a recipe's parent recipe)",
    "grpo.num_prompts_per_step": "data.prompts_per_step",
    "grpo.num_generations_per_prompt": "rollout.n",
    "grpo.max_num_steps": "trainer.steps",
    "grpo.max_num_epochs": "trainer.total_epochs",
    "grpo.max_rollout_turns": "env.max_turns",
    "grpo.normalize_rewards": "algorithm.normalize_std (with use_leave_one_out_baseline: "
                              "algorithm.advantage=grpo-loo)",
    "grpo.use_leave_one_out_baseline": "algorithm.advantage=grpo-loo (with normalize_rewards=false: rloo)",
    "grpo.val_period": "eval.every",
    "grpo.val_at_start": "eval.before_training",
    "grpo.max_val_samples": "eval.size",
    "grpo.seed": "run.seed",
    "grpo.overlong_filtering": "algorithm.overlong_filter",
    "grpo.use_dynamic_sampling": "algorithm.dynamic_sampling",
    "grpo.dynamic_sampling_max_gen_batches": "algorithm.max_resample_rounds",
    "grpo.reward_shaping.enabled": "algorithm.overlong_shaping",
    "grpo.reward_shaping.overlong_buffer_length": "algorithm.overlong_cache",
    "grpo.reward_shaping.overlong_buffer_penalty": "algorithm.overlong_penalty",
    "grpo.async_grpo.enabled": "trainer.off_policy_steps (k >= 1 turns it on)",
    "grpo.async_grpo.max_trajectory_age_steps": "trainer.off_policy_steps",
    "loss_fn.reference_policy_kl_penalty": "algorithm.kl_coef",
    "loss_fn.reference_policy_kl_type": "algorithm.kl_kind",
    "loss_fn.ratio_clip_min": "algorithm.clip_low",
    "loss_fn.ratio_clip_max": "algorithm.clip_high",
    "loss_fn.ratio_clip_c": "algorithm.dual_clip",
    "loss_fn.token_level_loss": "algorithm.loss_agg (true: token-mean; false: seq-mean-token-mean)",
    "loss_fn.use_on_policy_kl_approximation": "algorithm.kl_bias_correction",
    "loss_fn.use_importance_sampling_correction": "algorithm.correction.level=token",
    "loss_fn.truncated_importance_sampling_ratio": "algorithm.correction.high",
    "loss_fn.sequence_level_importance_ratios": "algorithm.ratio_level=sequence",
    "policy.model_name": "model.path",
    "policy.tokenizer.name": "model.path (the model directory's tokenizer)",
    "policy.tokenizer.chat_template": "model.chat_template",
    "policy.train_global_batch_size": "trainer.mini_batches (GRPO, a count: num_prompts_per_step x "
                                      "num_generations_per_prompt / train_global_batch_size; DPO: trainer.batch_size)",
    "policy.train_micro_batch_size": "engine.token_budget (micro-batches are packed by tokens)",
    "policy.logprob_batch_size": "engine.token_budget",
    "policy.dynamic_batching.enabled": "engine.token_budget (always packed by tokens)",
    "policy.dynamic_batching.train_mb_tokens": "engine.token_budget",
    "policy.dynamic_batching.logprob_mb_tokens": "engine.token_budget",
    "policy.max_total_sequence_length": "data.max_prompt_tokens and rollout.max_new_tokens (prompt and response "
                                        "apart)",
    "policy.precision": "model.dtype",
    "policy.max_grad_norm": "engine.optim.max_grad_norm",
    "policy.fsdp_offload_enabled": "trainer.offload",
    "policy.dtensor_cfg.cpu_offload": "trainer.offload",
    "policy.activation_checkpointing_enabled": "engine.gradient_checkpointing",
    "policy.dtensor_cfg.activation_checkpointing": "engine.gradient_checkpointing",
    "policy.optimizer.kwargs.lr": "engine.optim.lr",
    "policy.optimizer.kwargs.weight_decay": "engine.optim.weight_decay",
    "policy.optimizer.kwargs.betas": "engine.optim.betas",
    "policy.optimizer.kwargs.eps": "engine.optim.eps",
    "policy.scheduler": "engine.optim.schedule and engine.optim.warmup_steps (LinearLR's total_iters)",
    f"{_GEN}.backend": "rollout.engine (vllm or native)",
    f"{_GEN}.max_new_tokens": "rollout.max_new_tokens",
    f"{_GEN}.temperature": "rollout.temperature",
    f"{_GEN}.top_p": "rollout.top_p",
    f"{_GEN}.top_k": "rollout.top_k (off: 0)",
    f"{_GEN}.stop_strings": "rollout.stop_strings",
    f"{_GEN}.vllm_cfg.tensor_parallel_size": "rollout.vllm.tensor_parallel_size",
    f"{_GEN}.vllm_cfg.gpu_memory_utilization": "rollout.vllm.memory_utilization",
    f"{_GEN}.vllm_cfg.max_model_len": "rollout.vllm.max_model_len",
    f"{_GEN}.vllm_cfg.precision": "model.dtype",
    f"{_GEN}.vllm_cfg.enforce_eager": "rollout.vllm.enforce_eager",
    f"{_GEN}.colocated.enabled": "placement.rollout (false: placement.pools.NAME=N placement.rollout=NAME)",
    f"{_GEN}.colocated.resources.gpus_per_node": "placement.pools.NAME (the rollout pool's devices)",
    "checkpointing.enabled": "run.save_every (0: no checkpoints)",
    "checkpointing.checkpoint_dir": "run.dir (checkpoints in RUN_DIR/checkpoints)",
    "checkpointing.save_period": "run.save_every",
    "checkpointing.keep_top_k": "run.keep_checkpoints (the newest are kept, not the best by a metric)",
    "logger.log_dir": "run.dir",
    "logger.wandb_enabled": "telemetry.sinks=[console,jsonl,wandb] (and telemetry.wandb_mode=online)",
    "logger.wandb.project": "telemetry.wandb_project",
    "logger.wandb.name": "run.dir (the W&B run is named after its last part)",
    "logger.num_val_samples_to_print": "telemetry.samples_per_step",
    "cluster.gpus_per_node": "cluster.devices",
    "cluster.num_nodes": "cluster.nodes",
    "data.max_input_seq_length": "data.max_prompt_tokens",
    "data.dataset_name": "data.hf_name or data.path",
    "data.system_prompt_file": "data.system_prompt (the text itself)",
    "env.math.num_workers": "reward.workers (reward.verifier=math)",
    "dpo.max_num_steps": "trainer.steps",
    "dpo.max_num_epochs": "trainer.total_epochs",
    "dpo.val_period": "eval.every",
    "dpo.val_at_start": "eval.before_training",
    "dpo.seed": "run.seed",
    "dpo.reference_policy_kl_penalty": "dpo.beta",
    "dpo.sft_loss_weight": "dpo.nll_weight",
    "dpo.preference_average_log_probs": "dpo.kind (relayrl's dpo kinds sum the log-probs; simpo averages them)",
    "sft.max_num_steps": "trainer.steps",
    "sft.max_num_epochs": "trainer.total_epochs",
    "sft.val_period": "eval.every",
    "sft.seed": "run.seed",
}
"""NeMo-RL's key -> relayrl's key (or keys, with a note)."""
