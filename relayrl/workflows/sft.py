"""Supervised fine-tuning: the warm start before RL.

Each step takes ``trainer.batch_size`` problems (a built-in task's generator or
a dataset's rows), trains on ``prompt -> answer + EOS`` with the masked token
cross-entropy of ``relayrl.algorithms.sft``, and evaluates greedy accuracy on
the held-out set every ``eval.every`` steps with the same code as GRPO.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from relayrl.cluster import make_group
from relayrl.config.schema import Config
from relayrl.engines.training.base import SequenceBatch
from relayrl.workflows.losses import SFTLoss
from relayrl.workflows.relay import relay_weights
from relayrl.workflows.session import Session
from relayrl.workflows.workers import PolicyWorker, RolloutWorker, collective, generate

__all__ = ["train_sft"]

KEY_METRICS = ("sft/loss", "eval/accuracy", "actor/lr", "perf/step_time_s")


def train_sft(cfg: Config) -> Path:
    """Run SFT; returns the final model directory."""
    s = Session(cfg)
    m = cfg.model
    common = dict(dtype=m.dtype, device=m.device, attn_implementation=m.attn_implementation, threads=cfg.run.threads)
    actor = make_group(cfg.cluster, PolicyWorker, s.pool, "actor", init_kwargs=dict(
        model_path=str(s.model_path), engine=cfg.engine, total_steps=cfg.trainer.steps, seed=cfg.run.seed, **common))
    rollout = make_group(cfg.cluster, RolloutWorker, s.pool, "rollout", init_kwargs=dict(
        model_path=str(s.model_path), max_batch=cfg.rollout.max_batch, seed=cfg.run.seed, **common))
    loss = SFTLoss()
    eos = torch.tensor([s.tokenizer.eos_token_id])

    def evaluate(step: int) -> dict[str, float]:
        with s.span("eval", "rollout", step):
            relay_weights(actor, rollout, version=step)
            return s.evaluate(lambda p, sp: generate(rollout, p, sp), step).metrics

    def save(step: int) -> Path:
        return s.save(step, collective(actor, "state"))

    ck = s.load(actor.one("param_shapes"))
    if ck is not None:
        actor.all("load_state", {"model": ck.model_state, "optimizer": ck.optimizer_state, "scheduler": ck.scheduler_state})
        s.restore_rng(ck)
    s.open_telemetry(cfg.trainer.steps, KEY_METRICS)
    if s.start_step == 0:
        s.tracker.log(0, evaluate(0))
    for step in s.steps():
        t0 = time.perf_counter()
        problems = s.prompts.take(cfg.trainer.batch_size)
        batch = SequenceBatch(
            [torch.tensor(s.encode(p)) for p in problems],
            [torch.cat([torch.tensor(s.tokenizer(p.answer, add_special_tokens=False)["input_ids"]), eos]) for p in problems],
        )
        with s.span("update", "actor", step):
            metrics = actor.split("update", batch, loss, seed=cfg.run.seed + step)[0]  # global metrics on every rank
        dt = time.perf_counter() - t0
        tokens = sum(int(p.numel() + r.numel()) for p, r in zip(batch.prompt_ids, batch.response_ids))
        metrics.update({"perf/step_time_s": dt, "perf/tokens": tokens,
                        "perf/tokens_per_s_per_device": tokens / (dt * s.pool.world_size)})
        last = step == cfg.trainer.steps
        if (cfg.eval.every and step % cfg.eval.every == 0) or last:
            metrics.update(evaluate(step))
            last = s.target_reached(step, metrics) or last
        s.log_step(step, metrics, save=save)
        if (cfg.run.save_every and step % cfg.run.save_every == 0) or last:
            save(step)
        if last:
            break
    out = s.finish(lambda p: actor.all("save_pretrained", p))
    actor.shutdown()
    rollout.shutdown()
    return out
