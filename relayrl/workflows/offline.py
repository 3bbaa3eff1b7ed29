"""The loop of the workflows that train on given answers (SFT, DPO): no rollouts in the step.

Once the checkpoint (if any) is restored, ``before_steps`` (DPO and KTO with ``trainer.precompute_ref``: the
reference's one pass, then its group released). Each step::

    problems <- the next trainer.batch_size problems
    batch    <- step_batch(problems)            (the workflow's rows; DPO adds reference log-probs)
    actor.update(batch, loss)                   (split over the data-parallel actor ranks)
    every eval.every steps: relay weights actor -> rollout, greedy accuracy on the held-out set

Checkpoints, resume, early stop at ``eval.stop_at`` and telemetry are the
session's (the same as GRPO's).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Callable

import torch

from relayrl.cluster import WorkerGroup, make_group
from relayrl.engines.training.base import LossFn, SequenceBatch
from relayrl.workflows.episodes import episode_spec, evaluate_episodes
from relayrl.workflows.precision import role_precision
from relayrl.workflows.ref_sync import ReferenceSync
from relayrl.workflows.relay import relay_weights
from relayrl.workflows.roles import role_common
from relayrl.workflows.rollout_worker import RolloutWorker, generate
from relayrl.workflows.session import Session
from relayrl.workflows.trainer_workers import PolicyWorker, _TrainerWorker

__all__ = ["OfflineRun"]


class OfflineRun:
    """Actor and rollout groups on the session's pool; :meth:`run` trains ``trainer.steps`` steps.
    ``actor_cls``: the trained worker (a reward model's for workflow rm, which has no rollout)."""

    def __init__(self, s: Session, loss: LossFn, key_metrics: tuple[str, ...], *, actor_cls: type = PolicyWorker,
                 rollout: bool = True) -> None:
        cfg = self.cfg = s.cfg
        self.s, self.loss, self.key_metrics = s, loss, key_metrics
        m = cfg.model
        self.common = role_common(cfg)
        self.precision = role_precision(m, cfg.rollout)
        self.groups: list[WorkerGroup] = []
        lora = {"lora": m.lora} if m.lora.enabled else {}  # (config load refuses LoRA for a reward model)
        export = {"export_dtype": m.export_dtype}  # (a policy and a reward model alike)
        # (the actor's tokenizer is exported with the model: with model.chat_template, so is the template)
        self.actor = self.group(actor_cls, "actor", engine=cfg.train_engine(), total_steps=cfg.trainer.steps,
                                seed=cfg.run.seed, chat_template=m.template(), **lora, **export,
                                **self.precision["trained"])
        self.rollout = None  # a reward model (workflow rm) generates nothing: its subclass evaluates on pairs
        if rollout:
            self.rollout = self.group(RolloutWorker, "rollout", max_batch=cfg.rollout.max_batch, seed=cfg.run.seed,
                                      decode=cfg.rollout.decode, decode_compile=cfg.rollout.decode_compile,
                                      vllm=cfg.rollout.vllm_spec(), vllm_logprobs=cfg.rollout.vllm_logprobs(),
                                      chat_template=m.template(),
                                      devices_per_rank=cfg.rollout.devices_per_rank, **self.precision["rollout"])
        self.episodes = episode_spec(cfg, self.s.tokenizer)  # env.name: evaluate with multi-turn episodes
        self.ref_sync: ReferenceSync | None = None
        """DPO's reference updates (``trainer.ref_sync_every``), set by the workflow that has a reference."""

    def group(self, worker_cls: type, name: str, devices_per_rank: int = 1, **kwargs) -> WorkerGroup:
        """Another worker group on the session's pool, built from the session's model (each rank owning
        ``devices_per_rank`` of the pool's devices)."""
        g = make_group(self.cfg.cluster, worker_cls, self.s.pool, name, devices_per_rank=devices_per_rank,
                       init_kwargs=dict(model_path=str(self.s.model_path), **self.common, **kwargs))
        self.groups.append(g)
        return g

    def evaluate(self, step: int) -> dict[str, float]:
        with self.s.span("eval", "rollout", step):
            relay_weights(self.actor, self.rollout, version=step)
            if self.episodes is not None:
                return evaluate_episodes(self.rollout, self.s, self.episodes, step)
            return self.s.evaluate(lambda p, sp: generate(self.rollout, p, sp, interrupt=self.s.eval_interrupt),
                                   step).metrics

    def save(self, step: int) -> Path:
        reference = self.ref_sync.state() if self.ref_sync is not None else None
        return self.s.save(step, self.actor.all_rank0(_TrainerWorker.state),
                           extra=None if reference is None else {"reference": reference})

    def release(self, group: WorkerGroup) -> None:
        """Stop ``group`` now, before the run ends, and let its memory go (``trainer.precompute_ref``: the
        reference after its one pass)."""
        group.shutdown()
        self.groups.remove(group)
        gc.collect()  # (a worker in this process: its model's tensors, freed with their last reference)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the freed blocks back to the device, for the other roles' allocations

    def run(self, step_batch: Callable[[int], SequenceBatch], *,
            before_steps: Callable[[], None] | None = None) -> Path:
        """Train on ``step_batch(step)`` each step (Session.run's loop); returns the final model directory.
        ``before_steps`` runs once the checkpoint (if any) is restored, before the first evaluation and step."""
        s, cfg = self.s, self.cfg

        def restore() -> None:
            ck = s.load(self.actor.one(_TrainerWorker.param_shapes))
            if ck is not None:
                self.actor.all(_TrainerWorker.load_state, {"model": ck.model_state,
                                                           "optimizer": ck.optimizer_state,
                                                           "scheduler": ck.scheduler_state})
                if self.ref_sync is not None:
                    self.ref_sync.load(ck.extra.get("reference") if isinstance(ck.extra, dict) else None)
                s.restore_rng(ck)
            if before_steps is not None:
                before_steps()

        def step(st: int) -> dict[str, float]:
            t0 = time.perf_counter()
            batch = step_batch(st)
            with s.span("update", "actor", st):  # every rank reports the global metrics
                metrics = self.actor.split_rank0(_TrainerWorker.update, batch, self.loss, seed=cfg.run.seed + st)
            if self.ref_sync is not None:
                metrics.update(self.ref_sync.after_step(st))
            dt = time.perf_counter() - t0
            tokens = sum(int(p.numel() + r.numel()) for p, r in zip(batch.prompt_ids, batch.response_ids))
            metrics.update({"perf/step_time_s": dt, "perf/tokens": tokens,
                            "perf/tokens_per_s_per_device": tokens / (dt * s.pool.world_size)})
            return metrics

        def shutdown() -> None:
            for g in self.groups:
                g.shutdown()

        # save_pretrained by name: the actor is a PolicyWorker or a RewardModelTrainer, each with its own (the
        # methods above are their common base's, _TrainerWorker)
        return s.run(restore=restore, step=step, evaluate=self.evaluate, save=self.save,
                     export=lambda p: self.actor.all("save_pretrained", p), shutdown=shutdown,
                     key_metrics=self.key_metrics, footprint=lambda: self.actor.one(_TrainerWorker.footprint))
