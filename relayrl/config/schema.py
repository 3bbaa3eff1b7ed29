"""The typed config of a relayrl run. One section per component; every default is here.

Sections reuse the config models that live next to their components
(``TinyModelConfig``, ``OptimConfig``, ``RewardConfig``, ``TelemetryConfig``,
``ClusterConfig``, ``DockConfig``), so each value has exactly one definition.
Those modules import no torch or transformers, and neither does validation
(but for :func:`available_devices`, which a placement with extra pools asks for the GPU count where
``model.device`` is ``cuda``, or ``auto`` on a machine with a GPU driver): a recipe is refused or accepted
in about a second, before the engines load (``tests/config/test_torchfree.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relayrl.algorithms.estimators import estimator
from relayrl.config.paths import DirPath, LocalPath
from relayrl.config.algorithm import AlgorithmConfig
from relayrl.config.algorithm_sections import CorrectionConfig, DistillConfig
from relayrl.config.dpo import DPOConfig
from relayrl.config.interrupt import check_interrupt
from relayrl.config.kto import KTOConfig
from relayrl.config.rollout import RolloutConfig
from relayrl.config.trainer import TrainerConfig
from relayrl.config.unread import check_unread
from relayrl.config.plan import rollout_pool
from relayrl.config.rollout_devices import check_rollout_devices
from relayrl.config.lora_sync import check_lora_sync
from relayrl.config.rules import (check_critic, check_decoupled_rewards, check_dpo, check_env,
                                  check_kto, check_placed_roles, check_precompute_ref, check_ref_sync,
                                  check_retire_solved, check_total_epochs, check_workflow_sections, check_reward_read,
                                  scores_responses, check_loss_agg, check_vllm_eval_sampling, check_routing_replay,
                                  check_vllm_model_len)
from relayrl.cluster.config import ClusterConfig
from relayrl.config.parallel import check_expert_parallel, check_sequence_parallel
from relayrl.data.config import DataConfig
from relayrl.dock.config import DockConfig
from relayrl.engines.reward.config import RewardConfig
from relayrl.engines.generation.config import PLAIN_SAMPLING, check_scale, check_top_k
from relayrl.engines.training.config import OptimConfig, TrainEngineConfig
from relayrl.environments.config import EnvConfig
from relayrl.models.config import ModelConfig
from relayrl.telemetry.config import TelemetryConfig

__all__ = [
    "RunConfig", "ModelConfig", "DataConfig", "RolloutConfig", "AlgorithmConfig", "CorrectionConfig", "DistillConfig", "TrainerConfig",
    "CriticConfig", "DPOConfig", "KTOConfig", "RMConfig", "EvalConfig", "PlacementConfig", "Config",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    """Where a run writes (``run.dir``), its seed, resume and checkpoints, and what it does on a lost worker or a
    non-finite update."""

    dir: DirPath = Field(Path("runs/latest"),
                         description="run directory (config, metrics.jsonl, checkpoints, final model)")
    seed: int = Field(0, description="seed of the prompt order, the sampling, dropout and any freshly initialised "
                      "weights (a critic's head, the tiny default's weights come from model.tiny.seed); a "
                      "checkpoint carries the random states, so a resumed run draws what the uninterrupted one would")
    resume: LocalPath = Field("never", description='"never", "auto" (newest complete checkpoint in run.dir) or a '
                              'checkpoint path')
    overwrite: bool = Field(False, description="a fresh start (resume=never, or auto with no complete checkpoint) "
                            "in a run.dir that holds another run (checkpoints, or a metrics.jsonl, model/ or run "
                            "config.json): move that run aside to RUN_DIR.replaced-<time> (false: refuse)")
    resume_check: bool = Field(True, description="refuse to resume a checkpoint whose saved config differs on the "
                               "keys that define a run (workflow, seed, model, data, advantage estimator)")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    max_restarts: int = Field(0, ge=0, description="when a worker process (or Ray actor) dies, tear the worker "
                              "groups down, recreate them and go on from the last checkpoint, at most this many "
                              "times per run (each restart is logged with its cause; run/restarts counts them); "
                              "0: the run ends with an error naming the group and rank")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept in RUN_DIR/checkpoints; older "
                                  "ones are deleted after each save")
    on_nonfinite: Literal["stop", "skip"] = Field("stop", description="NaN/Inf loss or gradient: save and stop, or skip the step")
    nonfinite_skip_limit: int = Field(10, ge=1, description="run.on_nonfinite=skip: this many updates skipped in a "
                                      "row stop the run as run.on_nonfinite=stop does (the last good weights saved): "
                                      "every batch failing means the weights or the optimizer state are broken, "
                                      "not one batch")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: all cores, divided among the ranks); 1 is "
                         "faster on a machine whose cores other work also uses (docs/scale.md)")

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_word(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML reads yes/no/true/false as booleans
            raise ValueError(f"{str(v).lower()} (YAML reads yes, no, true and false as booleans) is not a resume "
                             f"mode: write never, auto or a checkpoint path")
        return v


class PlacementConfig(_Section):
    """Which resource pool each role runs on (HybridFlow's ResourcePool).

    The actor's pool is ``main``: ``cluster.devices`` devices per node. Other pools are named in ``pools``
    with their device count. Roles on one pool time-share its devices (colocated); roles on different pools
    run at the same time (split). On a CPU a device is a share of the cores: each pool's ranks get
    ``cores / (devices of all pools)`` torch threads each; on a GPU a device is one GPU.
    """

    pools: dict[str, int] = Field(default_factory=dict, description="extra pools besides main: name -> devices "
                                  "(e.g. {gen: 1} and rollout=gen for a rollout on its own device)")
    rollout: str = Field("main", description="pool of the rollout (generation) group")
    reference: str = Field("main", description="pool of the reference group (KL)")
    critic: str = Field("main", description="pool of the critic group (PPO)")
    teacher: str = Field("main", description="pool of the teacher group (on-policy distillation, "
                         "algorithm.distill.teacher)")
    nodes: dict[str, str] = Field(default_factory=dict, description="Ray backend: pool name -> the IP address of "
                                  "the node whose devices it takes (e.g. {main: 10.0.0.1, gen: 10.0.0.2}: the "
                                  "actor and reference on one node, the rollout on the other); unnamed pools go "
                                  "where Ray's PACK strategy puts them")
    reward: str = Field("driver", description="where the reward scorer runs: 'driver' (threads of the driver "
                        "process, beside every pool: rule verifiers and user functions, the default), or a pool "
                        "whose turns it takes (a reward model sharing that pool's devices)")

    @model_validator(mode="after")
    def _check(self) -> "PlacementConfig":
        for name, n in self.pools.items():
            if name == "main":
                raise ValueError("placement.pools: 'main' is the actor's pool, sized by cluster.devices; "
                                 "name the extra pools otherwise")
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"placement.pools.{name}={n!r} must be a device count >= 1")
        for pool, ip in self.nodes.items():
            if pool != "main" and pool not in self.pools:
                raise ValueError(f"placement.nodes.{pool}: no pool {pool!r} (pools: main, "
                                 f"{', '.join(self.pools) or 'none other'})")
            if not isinstance(ip, str) or not ip.strip():
                raise ValueError(f"placement.nodes.{pool}={ip!r} must be a node's IP address")
        for role in ("rollout", "reference", "critic", "teacher", "reward"):
            pool = getattr(self, role)
            if pool != "main" and pool not in self.pools and not (role == "reward" and pool == "driver"):
                raise ValueError(f"placement.{role}={pool!r} names no pool: declare it in placement.pools "
                                 f"(pools: main, {', '.join(self.pools) or 'none other'})")
        used = {getattr(self, role) for role in ("rollout", "reference", "critic", "teacher", "reward")}
        for name, n in self.pools.items():  # (its devices would be counted, started on Ray, and left idle)
            if name not in used:
                raise ValueError(f"placement.pools.{name}={n} holds no role (placement.rollout, .reference, "
                                 f".critic, .teacher and .reward name the pools they run on): place one there "
                                 f"(e.g. placement.rollout={name}) or drop placement.pools.{name}")
        return self

    def pool_of(self, role: str) -> str:
        return "main" if role in ("actor", "trainer") else getattr(self, role)

    @property
    def split(self) -> bool:
        """The rollout has devices of its own (generation overlaps the trainer's work)."""
        return self.rollout != "main"

    @property
    def custom(self) -> bool:
        """Some role is placed away from the default (everything on main, rewards in the driver): the run
        takes the streaming dataflow, which places each role on its pool."""
        return (self.split or self.reference != "main" or self.critic != "main" or self.teacher != "main"
                or self.reward != "driver")


class CriticOptimConfig(OptimConfig):
    """The critic's optimizer: AdamW with warm-up and a schedule, and gradient-norm clipping, as ``engine.optim``,
    with a learning rate of its own."""

    # (a field default, not OptimConfig(lr=1e-4): a critic.optim given in part, critic.optim.warmup_steps=3, kept
    # the class's 1e-5 for the rest)
    lr: float = Field(1e-4, gt=0, description="AdamW's learning rate (the peak, after warm-up); the critic's "
                      "default is 10x the policy's (engine.optim.lr)")


class CriticConfig(_Section):
    """PPO's critic (``algorithm.advantage=gae``): the policy's network with a value head, trained on GAE returns."""

    optim: CriticOptimConfig = CriticOptimConfig()
    value_clip: float | None = Field(0.5, gt=0.0, description="clip the new values to old +- value_clip in the "
                                     "loss (PPO's value clipping); null: plain squared error")
    warmup_steps: int = Field(0, ge=0, description="first RL steps that train only the critic (the actor waits)")


class RMConfig(_Section):
    """Reward-model training (workflow rm): a scalar head trained with the Bradley-Terry loss on pairs."""

    margin: float = Field(0.0, description="margin m of the loss -log sigmoid(r_chosen - r_rejected - m) (0: plain "
                          "Bradley-Terry)")


class EvalConfig(_Section):
    """Held-out evaluation: how often, on how many rows, greedy accuracy and pass@k / avg@k, and early stop."""

    every: int = Field(0, ge=0, description="evaluate every N steps (0: only before and after training)")
    before_training: bool = Field(True, description="evaluate the starting model (step 0) before the first step "
                                  "(verl's val_before_train); false: the first evaluation is at step eval.every, "
                                  "or at the end")
    size: int = Field(200, ge=1, description="held-out prompts: of each set with a data.eval_path list "
                      "(its first eval.size rows)")
    stop_at: float | None = Field(None, ge=0.0, le=1.0, description="stop early once held-out accuracy reaches this "
                                  "(checked at eval steps; the model is saved as at the last step)")
    max_new_tokens: int | None = Field(None, ge=1, description="greedy answer length on the held-out set "
                                       "(null: rollout.max_new_tokens)")
    k: int = Field(1, ge=1, description="also sample k answers per held-out prompt at eval.temperature and report "
                   "eval/pass@k and eval/avg@k beside the greedy eval/accuracy (verl's val_kwargs.n, TRL's "
                   "num_generations_eval); each evaluation then generates k + 1 answers per prompt. 1: greedy only")
    temperature: float | None = Field(None, gt=0.0, description="eval.k > 1: the sampling temperature (null: "
                                       "rollout.temperature, or 1.0 when that is 0)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="eval.k > 1: nucleus sampling of the k answers, as "
                         "rollout.top_p (verl's val_kwargs.top_p; 1: off). The greedy answer is never filtered, "
                         "and the rollout's filters do not apply to the k answers")
    top_k: int = Field(0, ge=0, description="eval.k > 1: sample the k answers among the top_k most likely tokens, "
                       "as rollout.top_k (verl's val_kwargs.top_k, whose -1 is 0 here; 0: off)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="eval.k > 1: sample the k answers among the tokens at "
                         "least min_p times as likely as the most likely one, as rollout.min_p (0: off)")

    _scale = field_validator("temperature")(lambda v, info: check_scale(info.field_name, v))
    _top_k_off = field_validator("top_k", mode="before")(lambda v: check_top_k("eval.top_k", v))

    @model_validator(mode="after")
    def _sampled(self) -> "EvalConfig":
        for key in ("temperature", "top_p", "top_k", "min_p"):
            value, off = getattr(self, key), PLAIN_SAMPLING.get(key)  # (temperature: None, the rollout's)
            if self.k == 1 and value is not None and value != off:
                fix = "drop eval.temperature" if off is None else f"set eval.{key}={off} (off)"
                raise ValueError(f"eval.{key}={value} samples the eval.k answers, and eval.k=1 (greedy only): set "
                                 f"eval.k > 1 (e.g. 8) or {fix}")
        return self


class Config(_Section):
    """A whole run. ``workflow`` picks the driver program."""

    workflow: Literal["sft", "grpo", "dpo", "kto", "rm"] = Field(
        "grpo", description="the driver program: grpo (every RL estimator: GRPO, DAPO, PPO with a critic, RLOO, "
        "REINFORCE++, ReMax), sft, dpo, kto (unpaired labelled completions), or rm (training a reward model on "
        "preference pairs)")
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    engine: TrainEngineConfig = TrainEngineConfig()
    critic: CriticConfig = CriticConfig()
    dpo: DPOConfig = DPOConfig()
    kto: KTOConfig = KTOConfig()
    rm: RMConfig = RMConfig()
    eval: EvalConfig = EvalConfig()
    reward: RewardConfig = RewardConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    cluster: ClusterConfig = ClusterConfig()
    dock: DockConfig = DockConfig()
    placement: PlacementConfig = PlacementConfig()
    env: EnvConfig = EnvConfig()

    def train_engine(self, **update) -> TrainEngineConfig:
        """``engine`` as the trained roles get it: ``engine.dropout=auto`` resolved by the workflow (none for grpo,
        dpo and rm, the model's for sft), and ``update`` applied (a critic's own optimizer)."""
        dropout = self.engine.dropout
        if dropout == "auto":
            dropout = "model" if self.workflow == "sft" else "none"
        return self.engine.model_copy(update={"dropout": dropout, **update})

    @model_validator(mode="after")
    def _cross(self) -> "Config":
        check_workflow_sections(self)
        check_critic(self)
        check_reward_read(self)
        if self.algorithm.distill.enabled and self.workflow != "grpo":
            raise ValueError(f"algorithm.distill.teacher scores the responses the policy samples, which workflow "
                             f"{self.workflow} does not generate: use workflow grpo or drop algorithm.distill.teacher")
        pure_distill = self.algorithm.distill.enabled and self.algorithm.distill.reward_weight == 0
        if self.workflow == "grpo" and estimator(self.algorithm.advantage).min_group > self.rollout.n \
                and not pure_distill:
            raise ValueError(f"rollout.n={self.rollout.n}: group advantages ({self.algorithm.advantage}) need "
                             f"rollout.n >= 2 responses per prompt")
        if self.workflow == "grpo" and self.algorithm.dynamic_sampling and self.rollout.n < 2:
            raise ValueError("algorithm.dynamic_sampling drops a prompt group whose responses all score alike, and "
                             "with rollout.n=1 each group is one response: every group is dropped and no step trains; "
                             "set rollout.n >= 2 or drop algorithm.dynamic_sampling")
        if self.workflow == "grpo" and self.rollout.temperature == 0 and self.rollout.n > 1:
            raise ValueError(f"rollout.temperature=0 samples greedily, so the rollout.n={self.rollout.n} responses to "
                             f"a prompt are identical and their group advantages all 0; set rollout.temperature > 0 "
                             f"(e.g. 1.0)")
        if self.algorithm.overlong_shaping and self.algorithm.overlong_cache >= self.rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong_cache={self.algorithm.overlong_cache} must be < "
                             f"rollout.max_new_tokens={self.rollout.max_new_tokens}")
        if self.trainer.off_policy_steps and self.workflow != "grpo":
            raise ValueError(f"trainer.off_policy_steps={self.trainer.off_policy_steps} applies to workflow grpo, "
                             f"not {self.workflow}")
        if self.workflow != "grpo" and (self.trainer.mini_batches != 1 or self.trainer.epochs != 1):
            raise ValueError(f"trainer.mini_batches={self.trainer.mini_batches} and trainer.epochs="
                             f"{self.trainer.epochs} split and repeat an RL batch (workflow grpo); workflow "
                             f"{self.workflow} takes one optimizer step per trainer.batch_size examples: set "
                             f"trainer.mini_batches=1 and trainer.epochs=1 (lower trainer.batch_size for smaller steps)")
        if self.workflow in ("dpo", "rm"):
            if self.engine.packing != "shared_prompt":
                raise ValueError(f"workflow={self.workflow} packs each prompt with its chosen and rejected answer, so that a pair "
                                 f"stays in one micro-batch: set engine.packing=shared_prompt (got {self.engine.packing!r})")
            if self.workflow == "dpo":
                check_dpo(self)
            if self.data.task not in (None, "arith"):
                raise ValueError(f"workflow={self.workflow} needs preference pairs: the built-in arith task has them (the true "
                                 f"sum over the careless one); data.task={self.data.task!r} has none, give data.path "
                                 f"with data.answer_key (chosen) and data.rejected_key columns")
        if self.rollout.n > self.rollout.max_batch:
            raise ValueError(f"rollout.n={self.rollout.n} responses of one prompt must fit in the generation batch: "
                             f"set rollout.max_batch >= {self.rollout.n} (got {self.rollout.max_batch})")
        if self.trainer.offload and (self.workflow != "grpo" or self.trainer.off_policy_steps):
            raise ValueError("trainer.offload moves idle roles off a device they share (colocated GRPO); "
                             + (f"workflow={self.workflow} has no rollout phase to make room for"
                                if self.workflow != "grpo" else "with trainer.off_policy_steps the rollout has "
                                "its own pool and runs while the trainer trains")
                             + ": drop trainer.offload")
        if self.trainer.offload and self.rollout.engine == "openai":
            raise ValueError("trainer.offload makes room for the rollout's weights on a shared device; with "
                             "rollout.engine=openai the server holds them: drop trainer.offload")
        if self.model.dtype == "float16":
            raise ValueError("model.dtype=float16 trains with fp16 compute, whose gradients underflow without loss "
                             "scaling (relayrl does not scale losses); use model.dtype=bfloat16 (rollout.dtype="
                             "float16 is fine)")
        if self.model.head_fp32 and self.model.dtype == "float32" and (self.rollout.dtype or "float32") == "float32":
            raise ValueError("model.head_fp32=true computes the head in float32, but model.dtype=float32 (and "
                             "rollout.dtype) already do: drop model.head_fp32, or set model.dtype=bfloat16")
        if self.model.pure_low_precision and self.model.dtype == "float32":
            raise ValueError("model.pure_low_precision=true trains low-precision weights, but model.dtype=float32; "
                             "set model.dtype=bfloat16 or drop model.pure_low_precision")
        ranks = self.cluster.devices * self.cluster.nodes
        rows = (self.trainer.batch_size * (2 if self.workflow in ("dpo", "rm") else 1) if self.workflow != "grpo"
                else self.data.prompts_per_step * self.rollout.n)
        # GRPO: the engine cuts the mini-batches from every rank's rows together (a rank may hold none of a
        # mini-batch's rows, or none at all: fewer prompt groups than ranks), so each needs a row of the step's
        # batch; the other workflows split their batch over the ranks, each rank a row (mini_batches is 1)
        if self.workflow == "grpo" and rows < self.trainer.mini_batches:
            raise ValueError(f"data.prompts_per_step x rollout.n = {rows} rows, fewer than trainer.mini_batches="
                             f"{self.trainer.mini_batches}: each mini-batch is one optimizer step and needs a row "
                             f"of the step's batch (lower trainer.mini_batches)")
        if self.workflow != "grpo" and rows < ranks:
            raise ValueError(f"trainer.batch_size = {rows} rows over {ranks} data-parallel rank(s): the batch is "
                             f"split over the ranks, each a row (raise trainer.batch_size or lower cluster.devices)")
        if self.model.lora.enabled and self.workflow == "rm":
            raise ValueError("model.lora.enabled: workflow rm trains the whole reward model (its scalar head and "
                             "the network under it); set model.lora.enabled=false")
        check_ref_sync(self)
        check_precompute_ref(self)
        check_kto(self)
        check_total_epochs(self)
        check_retire_solved(self)
        check_loss_agg(self)
        if self.eval.k > 1 and self.workflow == "rm":
            raise ValueError(f"eval.k={self.eval.k} samples answers to score; workflow rm evaluates a reward model "
                             f"on held-out pairs and generates nothing: set eval.k=1")
        _check_placement(self)
        check_sequence_parallel(self)
        check_expert_parallel(self)
        check_rollout_devices(self)
        check_lora_sync(self)
        check_env(self)
        check_decoupled_rewards(self)
        check_interrupt(self)
        check_vllm_eval_sampling(self)
        check_vllm_model_len(self)
        check_routing_replay(self)
        if self.data.messages_key is not None and (self.workflow != "sft" or self.data.path is None):
            raise ValueError("data.messages_key trains on whole conversations: it applies to workflow sft with "
                             "data.path; unset data.messages_key")
        if (self.reward.verifier == "task" and self.data.task is None and not self.env.own_rewards
                and scores_responses(self.workflow)):
            raise ValueError("reward.verifier=task needs a built-in data.task; for data.path use "
                             "reward.verifier=math, exact or user")
        check_unread(self)
        return self


GPU_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Device files of a GPU driver (NVIDIA's, ROCm's, WSL2's): on Linux without any, torch sees no GPU either."""


def available_devices(cfg: "Config") -> tuple[str, int]:
    """(kind, count) of the devices this machine offers the run: GPUs on CUDA, cores on a CPU. Imports torch
    for ``model.device`` cuda or auto unless the machine is Linux with no GPU driver's device files
    (:data:`GPU_NODES`): there, no GPU."""
    import os
    import sys

    no_driver = sys.platform == "linux" and not any(os.path.exists(p) for p in GPU_NODES)
    if cfg.model.device == "cuda" and no_driver:
        return "GPU", 0  # (no torch import to learn it)
    if cfg.model.device == "cuda" or (cfg.model.device == "auto" and not no_driver):
        import torch

        if cfg.model.device == "cuda" or torch.cuda.is_available():
            return "GPU", torch.cuda.device_count()
    return "CPU core", _cpu_cores()


def _cpu_cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def offpolicy_placement(cfg: "Config") -> "Config":
    """``cfg`` with the rollout on the pool its step plan gives it (off-policy rollouts run ahead on a pool of
    their own: :func:`relayrl.config.plan.rollout_pool`); ``cfg`` itself when that is its placement."""
    rollout, pools = rollout_pool(cfg)
    if rollout == cfg.placement.rollout:
        return cfg
    return cfg.model_copy(update={"placement": cfg.placement.model_copy(update={"pools": pools, "rollout": rollout})})


def _check_placement(self: Config) -> None:
    """Refuse placements, step modes and role options that cannot run, naming the key."""
    pl, t = self.placement, self.trainer
    if self.workflow != "grpo" and (pl.pools or pl.custom or t.mode != "sync" or t.tri_model):
        raise ValueError(f"placement, trainer.mode and trainer.tri_model apply to workflow grpo, not {self.workflow}")
    check_placed_roles(self)
    # (the conflict first: the pool the next rule asks for would not resolve it)
    if t.mode == "periodic" and t.off_policy_steps:
        raise ValueError("trainer.mode=periodic is on-policy; trainer.off_policy_steps lets the rollout run up to "
                         "k versions ahead (its trainer also consumes groups as they arrive): choose one")
    if t.mode == "periodic" and not pl.split:
        raise ValueError("trainer.mode=periodic overlaps training with generation, so the rollout needs devices "
                         "of its own: add placement.pools.gen=1 placement.rollout=gen (or use trainer.mode=sync)")
    if t.tri_model:
        if estimator(self.algorithm.advantage).reference:
            raise ValueError(f"trainer.tri_model computes the reference's log-probs inside the update, after the "
                             f"advantages; algorithm.advantage={self.algorithm.advantage} reads them before (in its "
                             f"advantages): drop trainer.tri_model")
        if self.algorithm.kl_coef <= 0:
            raise ValueError("trainer.tri_model computes the reference's log-probs inside the actor, and "
                             "algorithm.kl_coef=0 needs none: set algorithm.kl_coef > 0 or drop trainer.tri_model")
        if self.algorithm.kl_in_reward:
            raise ValueError("trainer.tri_model computes the reference log-probs inside the update, after the "
                             "advantages; algorithm.kl_in_reward needs them before (in the rewards): drop one")
        if pl.reference != "main":
            raise ValueError(f"trainer.tri_model keeps the reference in the actor's layout on pool main; "
                             f"placement.reference={pl.reference!r} puts it elsewhere")
    if self.reward.stream == "sample" and self.workflow != "grpo":
        raise ValueError(f"reward.stream=sample scores each response as the rollout writes it; workflow "
                         f"{self.workflow} has no rollout: drop reward.stream")
    if self.rollout.partial and not t.off_policy_steps:
        raise ValueError("rollout.partial swaps new weights into responses being generated, which only an "
                         "off-policy run does (on-policy steps relay weights between batches): set "
                         "trainer.off_policy_steps >= 1 or drop rollout.partial")
    if self.trainer.offload and pl.custom:
        raise ValueError("trainer.offload moves idle roles off the one pool they share (the colocated loop); "
                         "with roles placed on pools of their own, drop trainer.offload")
    if pl.nodes and self.cluster.backend != "ray":
        raise ValueError(f"placement.nodes pins pools to cluster nodes ({', '.join(pl.nodes)}), which only the Ray "
                         f"backend has: set cluster.backend=ray (with cluster.ray_address) or drop placement.nodes")
    if self.cluster.backend != "local":
        return  # Ray places pools over its cluster and refuses what does not fit
    main = self.cluster.devices
    pools = offpolicy_placement(self).placement.pools if pl.pools or t.off_policy_steps else {}
    need = main + sum(pools.values())
    if not pools and (need <= _cpu_cores() or self.cluster.oversubscribe):
        return  # fits the CPU cores, and GPUs without pools are checked at start (below): torch need not be asked
    kind, have = available_devices(self)
    if need <= have or (kind == "CPU core" and self.cluster.oversubscribe):
        return
    if kind != "CPU core" and have == 0:
        return  # no GPU here: a GPU recipe read on a laptop (relayrl plan, a check); refused at start, as below
    anyway = (f", or set cluster.oversubscribe=true to start {need} ranks on {have} cores anyway (slow: they share "
              f"the cores)") if kind == "CPU core" else ""
    if not pools:
        if kind != "CPU core":
            return  # GPUs: model.device=cuda with none is refused at start (a recipe may be read on a laptop)
        raise ValueError(f"cluster.devices={main} starts {main} ranks, one per CPU core, but this machine has "
                         f"{have}: set cluster.devices <= {have}{anyway}")
    sizes = ", ".join([f"main={main} (cluster.devices)"] + [f"{k}={v}" for k, v in pools.items()])
    raise ValueError(f"placement needs {need} {kind}s ({sizes}) but this machine has {have}: shrink "
                     f"placement.pools or cluster.devices{anyway}")

