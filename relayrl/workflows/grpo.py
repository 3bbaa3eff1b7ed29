"""Synchronous, colocated GRPO / DAPO: seed 001's hybrid engine on one resource pool.

One step, as in the papers::

    prompts   <- sample P prompts
    responses <- rollout.generate(prompts, n)             (generation engine, weights v)
    rewards   <- verifier(responses)                       (+ DAPO overlong shaping)
    [DAPO]    drop groups whose rewards are all equal, resample prompts, repeat
    ref_lp    <- reference.logprobs(responses)             (only when kl_coef > 0)
    old_lp    <- actor.logprobs(responses)                 (only with > 1 update per batch)
    [PPO]     V <- critic.values(responses)                (advantage=gae)
    [ReMax]   b <- verifier(rollout.generate(prompts, greedy))   (the greedy response's reward per prompt)
    A         <- advantage estimator(rewards, groups)      (relayrl.algorithms; PPO: GAE(rewards, V) and returns)
    [PPO]     critic.update(responses, V, returns)         (clipped value loss)
    actor.update(responses, A, old_lp, ref_lp)             (clip-higher, token-level loss, ...)
    relay weights actor -> rollout                         (weights v+1)

Samples move between the stages through the dock (one partition per step);
workers are worker groups on one pool, so generation and training time-share
the device (colocated placement). GRPO and DAPO are the same loop: DAPO is the
configuration ``clip_high > clip_low``, ``loss_agg=token-mean``,
``dynamic_sampling``, ``overlong_shaping`` (see ``recipes/arith_dapo.yaml``);
PPO is ``advantage=gae``, which adds a critic group on the same pool
(``recipes/arith_ppo.yaml``).

Multi-turn episodes (``env.name``, :mod:`relayrl.workflows.episodes`): the generate and reward phases become
one, the rollout group running episodes whose environment gives the rewards; a sample's response is every
token after the prompt, and its ``loss_mask`` column keeps the environment's tokens out of the advantages,
the losses and their token counts (``recipes/toolsum_grpo.yaml``).

Departure from PPO-style trainers: with one update per batch (``epochs=1,
mini_batches=1``) the old-policy pass is skipped; the current log-probs,
detached, are the old ones (ratio 1, exactly on-policy), as in GRPO's original
single-update setting. The train/generation log-prob mismatch is still measured
in that pass.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from relayrl.algorithms.dapo import dynamic_sampling_filter, overlong_penalty
from relayrl.checkpoint import CheckpointError
from relayrl.cluster import ClusterConfig, ResourcePool, make_group
from relayrl.config.plan import step_plan
from relayrl.config.schema import Config
from relayrl.dock import Dock
from relayrl.engines.generation.base import Completion, SamplingParams
from relayrl.engines.training.base import SequenceBatch
from relayrl.workflows.losses import PolicyLoss, ValueLoss
from relayrl.weights import WeightRelay
from relayrl.workflows.relay import relay_weights
from relayrl.workflows.estimate import advantage_rows
from relayrl.workflows.episodes import episode_spec, evaluate_episodes, rollout_episodes
from relayrl.workflows.session import Session
from relayrl.workflows.workers import (CriticWorker, PolicyWorker, ReferenceWorker, RolloutWorker, collective,
                                       generate, restore_rollout_rng, role_precision, rollout_rng)

__all__ = ["GRPOWorkflow"]

KEY_METRICS = ("reward/mean", "eval/accuracy", "response/length_mean", "actor/entropy", "perf/step_time_s")


class GRPOWorkflow:
    """Builds the worker groups and the dock, then runs :meth:`step` ``trainer.steps`` times."""

    # the worker classes of each role (the streaming dataflow swaps in ones that read and write the dock)
    policy_cls, reference_cls, critic_cls, rollout_cls = PolicyWorker, ReferenceWorker, CriticWorker, RolloutWorker

    def __init__(self, cfg: Config, session: Session | None = None) -> None:
        self.cfg = cfg
        self.plan = plan = step_plan(cfg)
        self.s = s = session or Session(cfg)
        s.log(f"relayrl: {plan.describe()}" + "".join(f"\nrelayrl: {n}" for n in plan.notes))
        m, a = cfg.model, cfg.algorithm
        common = dict(device=m.device, attn_implementation=m.attn_implementation, threads=cfg.run.threads)
        prec = role_precision(m, cfg.rollout)
        path = str(s.model_path)
        updates = cfg.trainer.steps * cfg.trainer.mini_batches * cfg.trainer.epochs
        # tri-model (seed 003 section 4.1): the actor holds the reference in its own layout and computes the
        # reference log-probs inside its update's micro-steps; there is no reference group
        self.tri_model = plan.tri_model
        self.actor = make_group(cfg.cluster, self.policy_cls, s.pool, "actor", init_kwargs=dict(
            model_path=path, engine=cfg.engine, total_steps=updates, seed=cfg.run.seed, tri_model=self.tri_model,
            lora=m.lora, **prec["trained"], **common))
        self.critic = None
        if "critic" in plan.roles:  # PPO: a critic from the same network, with its own optimizer settings
            self.critic = make_group(cfg.cluster, self.critic_cls, self._critic_pool(s.pool), "critic", init_kwargs=dict(
                model_path=path, engine=cfg.engine.model_copy(update={"optim": cfg.critic.optim}), total_steps=updates,
                seed=cfg.run.seed, lora=m.lora, **prec["trained"], **common))
            self.value_loss = ValueLoss(clip=cfg.critic.value_clip)
        self.rollout = make_group(self._rollout_cluster(), self.rollout_cls, self._rollout_pool(s.pool), "rollout", init_kwargs=dict(
            model_path=path, max_batch=cfg.rollout.max_batch, seed=cfg.run.seed, decode=cfg.rollout.decode,
            remote=cfg.rollout.remote(), **prec["rollout"], **common))
        self.ref = None
        if "reference" in plan.roles:
            self.ref = make_group(cfg.cluster, self.reference_cls, self._reference_pool(s.pool), "reference",
                                  init_kwargs=dict(model_path=path, engine=cfg.engine, **prec["frozen"], **common))
        if cfg.cluster.backend == "ray":  # say where each role landed (a multi-node run places them by pool)
            groups = {"actor": self.actor, "critic": self.critic, "rollout": self.rollout, "reference": self.ref}
            s.log("relayrl: placed " + ", ".join(f"{k} on {'/'.join(sorted(set(g.nodes())))}"
                                                for k, g in groups.items() if g is not None))
        self.dock = Dock.from_config(cfg.dock)
        self.relay = WeightRelay()
        ro = cfg.rollout
        self.sampling = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                                       max_new_tokens=ro.max_new_tokens, stop_strings=tuple(ro.stop_strings))
        # The rollout records log-probs under softmax(logits / T) (greedy, T=0: under softmax(logits)); every
        # trainer pass whose log-probs meet the rollout's (PPO ratio against pi_old, truncated IS weights,
        # KL-in-reward, rollout/logprob_error) divides its logits by the same T, as verl and NeMo-RL do.
        self.temperature = ro.temperature if ro.temperature > 0 else 1.0
        self.greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=ro.max_new_tokens,
                                     stop_strings=tuple(ro.stop_strings))  # ReMax's baseline
        self.loss = PolicyLoss(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, agg=a.loss_agg,
                               level=a.ratio_level, kl_coef=0.0 if a.kl_in_reward else a.kl_coef, kl_kind=a.kl_kind,
                               entropy_coef=a.entropy_coef, agg_constant=float(ro.max_new_tokens), tis_cap=a.tis_cap,
                               old_key="gen_logprobs" if a.old_logprobs == "rollout" else "old_logprobs")
        # auto: pi_old is recomputed when the batch is used more than once. With one optimizer step per batch
        # pi_old is the trainer's weights before it, which the update's own forward pass computes (detached):
        # the same numbers without a second pass, also off-policy, where pi_old is the trainer's weights and
        # not the stale rollout's, and for truncated importance weights min(pi_old / mu, cap).
        self.recompute_old = plan.recompute_old
        self._kl_metrics: dict[str, float] = {}  # KL-in-reward metrics of the current step
        self._phase_metrics: dict[str, float] = {}  # memory/<phase>_peak_gb and timing/offload_s of the step
        self.offload = cfg.trainer.offload
        self.episodes = episode_spec(cfg)  # multi-turn episodes (env.name), contract checked before any work
        self.shared = self._share_rollout_weights(prec)

    def _share_rollout_weights(self, prec: dict) -> bool:
        """Zero-redundancy colocation: when the actor and the rollout live in the driver process with the
        same weight dtype, the rollout engine runs on the actor's parameters (no copy, no relay traffic). Not
        with LoRA: the rollout needs the merged weights, which the actor does not hold, so it keeps a copy."""
        a, r = self.actor, self.rollout
        if not (a.in_driver and r.in_driver) or prec["trained"]["dtype"] != prec["rollout"]["dtype"]:
            return False
        if self.cfg.model.lora.enabled:
            return False
        r.one("share_weights", a.one("named_weights"), 0)
        return True

    # ---------------------------------------------------------- memory phases
    @contextlib.contextmanager
    def phase(self, name: str, group, step: int):
        """A timed stage (timeline span) whose peak memory is logged as ``memory/<name>_peak_gb`` (the largest
        over the group's ranks and over repeats of the stage within the step)."""
        group.all("memory_reset")
        with self.s.span(name, group.name, step):
            yield
        key = f"memory/{name}_peak_gb"
        self._phase_metrics[key] = max(self._phase_metrics.get(key, 0.0), max(group.all("memory_peak_gb")))

    def _idle(self, *groups) -> None:
        """``trainer.offload``: move these roles' idle state to host (the actor keeps its weights on the device
        when the rollout runs on them)."""
        if not self.offload:
            return
        for g in groups:
            if g is None:
                continue
            kw = {"weights": not self.shared} if g is self.actor else {}
            self._offload_s(g.all("offload", **kw))

    def _wake(self, *groups, **kwargs) -> None:
        """Undo :meth:`_idle` for these roles (``kwargs`` go to their ``reload``)."""
        if not self.offload:
            return
        for g in groups:
            if g is not None:
                self._offload_s(g.all("reload", **kwargs))

    def _offload_s(self, seconds: list[float]) -> None:
        self._phase_metrics["timing/offload_s"] = self._phase_metrics.get("timing/offload_s", 0.0) + max(seconds)

    def _rollout_pool(self, main: ResourcePool) -> ResourcePool:
        """Where the rollout group runs: colocated with the actor (time-sharing the device)."""
        return main

    def _rollout_cluster(self) -> ClusterConfig:
        return self.cfg.cluster

    def _reference_pool(self, main: ResourcePool) -> ResourcePool:
        return main

    def _critic_pool(self, main: ResourcePool) -> ResourcePool:
        return main

    # ------------------------------------------------------------------ run
    def restore(self) -> None:
        """Load the checkpoint the resume plan chose (if any) and give the rollout the actor's weights."""
        s = self.s
        ck = s.load(self.actor.one("param_shapes"))
        if ck is not None:
            self.actor.all("load_state", {"model": ck.model_state, "optimizer": ck.optimizer_state,
                                          "scheduler": ck.scheduler_state})
            if self.critic is not None:
                if not isinstance(ck.extra, dict) or "critic" not in ck.extra:
                    raise CheckpointError(f"{ck.path} holds no critic state (it was saved by a run without "
                                          f"advantage=gae); resume it with its own advantage estimator")
                self.critic.all("load_state", ck.extra["critic"])
            restore_rollout_rng(self.rollout, ck.trainer_state["rollout_rng"], s.log)
            s.restore_rng(ck)
        relay_weights(self.actor, self.rollout, version=s.start_step)
        self._idle(self.actor, self.critic, self.ref)  # generation comes first

    def begin(self) -> range:
        """The first half of :meth:`run`, for tests and benchmarks that drive the steps themselves: restore,
        open telemetry, evaluate the starting model (fresh runs); returns the steps to train."""
        s = self.s
        self.restore()
        s.open_telemetry(self.cfg.trainer.steps, KEY_METRICS)
        if s.start_step == 0:
            s.tracker.log(0, self.evaluate(0))
        return s.steps()

    def run(self) -> Path:
        """Session.run's loop (restore, eval at step 0, steps, log, checkpoint, export) with this workflow's
        step."""
        return self.s.run(restore=self.restore, step=self.step, evaluate=self.evaluate, save=self.save,
                          export=lambda p: self.actor.all("save_pretrained", p), shutdown=self.shutdown,
                          key_metrics=KEY_METRICS)

    def step(self, step: int) -> dict[str, float]:
        """One GRPO/DAPO iteration; returns its metrics."""
        t0 = time.perf_counter()
        self._phase_metrics = {}
        rolled = self.rollout_and_score(step)
        self._idle(self.rollout)  # KV cache and (unless shared with the actor) weights leave the device
        metrics = self.learn(step, *rolled)
        if "dapo/skipped_step" in metrics:
            self._wake(self.rollout)
            return self.perf({**metrics, **self._phase_metrics}, t0, self.sample_tokens(*rolled[:2]), None)
        self._wake(self.rollout, restore=False)  # its old weights are overwritten next
        with self.s.span("relay", "rollout", step):
            metrics.update(relay_weights(self.actor, self.rollout, version=step, relay=self.relay))
        self._idle(self.actor, self.critic)
        return self.perf({**metrics, **self._phase_metrics}, t0, self.sample_tokens(*rolled[:2]), step)

    def learn(self, step: int, problems: list, comps: list[Completion], rewards: torch.Tensor,
              metrics: dict[str, float], baselines: torch.Tensor | None = None) -> dict[str, float]:
        """Everything after generation: reference and old log-probs, advantages, the update (through the dock)."""
        s = self.s
        self._kl_metrics = {}
        if not comps:
            s.tracker.write_text(f"step {step}: dynamic sampling found no group with differing rewards in "
                                 f"{int(metrics['dapo/rounds'])} rounds; no update this step "
                                 f"(raise algorithm.max_resample_rounds or data.prompts_per_step)")
            return {**metrics, "dapo/skipped_step": 1.0}
        part = f"step-{step}"
        n = self.sampling.n
        self.dock.open_partition(part, rows=len(comps), group_size=n)
        masks = {} if _loss_masks(comps) is None else {"loss_mask": _loss_masks(comps)}
        idx = self.dock.put(part, {**masks,
            "prompt_ids": [torch.tensor(s.encode(problems[c.prompt_index])) for c in comps],
            "response_ids": [c.token_ids for c in comps],
            "gen_logprobs": [c.logprobs for c in comps],
            "rewards": rewards.tolist(),
            "group": [c.prompt_index for c in comps],
            **({} if baselines is None else {"baseline": baselines.tolist()}),
        })
        got = self.dock.get(part, idx, ["prompt_ids", "response_ids", "group"])
        # with prompt groups, the forward passes below compute each prompt once (shared-prompt packing)
        batch = SequenceBatch(got["prompt_ids"], got["response_ids"], groups=[int(g) for g in got["group"]])
        if self.ref is not None:
            with self.phase("ref_logprob", self.ref, step):
                self._wake(self.ref)
                self.dock.put(part, {"ref_logprobs": self.ref.split("logprobs", batch, temperature=self.temperature)},
                              indexes=idx)
                self._idle(self.ref)
        self._wake(self.actor, self.critic)
        if self.recompute_old:
            with self.phase("old_logprob", self.actor, step):
                self.dock.put(part, {"old_logprobs": self.actor.split("logprobs", batch,
                                                                           temperature=self.temperature)}, indexes=idx)
        if self.critic is not None:
            with self.phase("values", self.critic, step):
                self.dock.put(part, {"values": self.critic.split("values", batch)}, indexes=idx)
        with s.span("advantage", "driver", step):
            self.dock.put(part, self.advantages(part, idx, rewards, comps), indexes=idx)
        with self.phase("update", self.actor, step):
            metrics.update(self.update(part, step, comps))
        self.dock.close_partition(part)
        return metrics

    def sample_tokens(self, problems: list, comps: list[Completion]) -> int:
        """Prompt + generated tokens of a step's samples (what ``perf/tokens`` counts)."""
        return sum(len(self.s.encode(problems[c.prompt_index])) + len(c.token_ids) for c in comps)

    def perf(self, metrics: dict[str, float], t0: float, tokens: int, version: int | None) -> dict[str, float]:
        """Step time and throughput (``tokens``: generated + prompt tokens, per device per second)."""
        dt = time.perf_counter() - t0
        devices = sum(p.world_size for p in {id(g.pool): g.pool for g in (self.actor, self.rollout)}.values())
        metrics.update({
            "perf/step_time_s": dt,
            "perf/tokens": tokens,
            "perf/tokens_per_s_per_device": tokens / (dt * devices),
        })
        if version is not None:
            metrics["weights/version"] = version
        return metrics

    # --------------------------------------------------------------- phases
    def rollout_and_score(self, step: int) -> "Rollout":
        """Generate n responses per prompt and score them; DAPO's dynamic sampling refills dropped groups;
        ReMax also scores one greedy response per prompt (the baseline)."""
        s, a, P = self.s, self.cfg.algorithm, self.cfg.data.prompts_per_step
        problems: list = []
        comps: list[Completion] = []
        scores: list[float] = []
        baselines: list[float] = []  # ReMax: the (shaped) reward of the greedy response to each sample's prompt
        dropped, rounds, seen_groups = 0, 0, 0
        metrics: dict[str, float] = {}
        while len(problems) < P:
            batch_problems = s.prompts.take(P - len(problems))
            if self.episodes is not None:  # the environment's steps give the rewards
                with self.phase("generate", self.rollout, step):
                    new, new_scores, rmetrics = rollout_episodes(self.rollout, s, batch_problems, self.sampling,
                                                                 self.episodes, step)
            else:
                with self.phase("generate", self.rollout, step):
                    new = generate(self.rollout, [s.encode(p) for p in batch_problems], self.sampling)
                with s.span("reward", "reward", step):
                    new_scores, rmetrics = s.reward.score(
                        [batch_problems[c.prompt_index].prompt for c in new], [c.text for c in new],
                        [batch_problems[c.prompt_index].answer for c in new])
            if rounds == 0:
                metrics.update(rmetrics)
            keep = list(range(len(batch_problems)))
            if self.plan.group_filter:
                groups = torch.tensor([c.prompt_index for c in new])
                mask, _ = dynamic_sampling_filter(torch.tensor(new_scores, dtype=torch.float32), groups)
                keep = sorted({c.prompt_index for c, k in zip(new, mask.tolist()) if k})
                dropped += len(batch_problems) - len(keep)
            seen_groups += len(batch_problems)
            if self.plan.baseline and keep:  # ReMax: only for the prompts kept
                base = self._greedy_baseline(step, [batch_problems[i] for i in keep])
                base = {old: base[j] for j, old in enumerate(keep)}
            remap = {old: len(problems) + j for j, old in enumerate(keep)}
            for c, sc in zip(new, new_scores):
                if c.prompt_index in remap:
                    comps.append(_reindex(c, remap[c.prompt_index]))
                    scores.append(sc)
                    if self.plan.baseline:
                        baselines.append(base[c.prompt_index])
            problems += [batch_problems[i] for i in keep]
            rounds += 1
            if not self.plan.group_filter or rounds > a.max_resample_rounds:
                break
        # After max_resample_rounds the batch may hold fewer prompt groups than data.prompts_per_step: say so.
        metrics.update({"dapo/dropped_groups": float(dropped), "dapo/sampled_groups": float(seen_groups),
                        "dapo/rounds": float(rounds), "dapo/missing_prompts": float(P - len(problems))})
        if not comps:  # every group was uniform in every round: no learning signal in this step
            return Rollout(problems, comps, torch.empty(0), metrics)
        lengths = torch.tensor([len(c.token_ids) for c in comps], dtype=torch.float32)
        truncated = torch.tensor([c.finish_reason == "length" for c in comps])
        scores_t = torch.tensor(scores, dtype=torch.float32)
        rewards = self._shaped(scores_t, lengths)
        if baselines:
            metrics["remax/baseline_mean"] = sum(baselines) / len(baselines)
        metrics.update(sample_metrics(scores_t, rewards, lengths, truncated))
        return Rollout(problems, comps, rewards, metrics, torch.tensor(baselines) if baselines else None)

    def _shaped(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards from verifier scores: DAPO's overlong shaping when enabled."""
        a = self.cfg.algorithm
        if not a.overlong_shaping:
            return scores.clone()
        return scores + overlong_penalty(lengths, self.sampling.max_new_tokens, a.overlong_cache)

    def _greedy_baseline(self, step: int, problems: list) -> list[float]:
        """ReMax: the (shaped) reward of each prompt's greedy response, in prompt order."""
        s = self.s
        with s.span("greedy_baseline", "rollout", step):
            comps = generate(self.rollout, [s.encode(p) for p in problems], self.greedy)  # one per prompt, in order
            scores, _ = s.reward.score([p.prompt for p in problems], [c.text for c in comps],
                                       [p.answer for p in problems])
        lengths = torch.tensor([len(c.token_ids) for c in comps], dtype=torch.float32)
        return self._shaped(torch.tensor(scores, dtype=torch.float32), lengths).tolist()

    def advantages(self, part: str, idx: list[int], rewards: torch.Tensor,
                   comps: list[Completion]) -> dict[str, list[torch.Tensor]]:
        """Per-token ``advantages`` (unpadded rows) from the configured estimator; with GAE also the critic's
        targets, ``returns``."""
        a, needs = self.cfg.algorithm, self.plan.estimator
        cols = (["gen_logprobs", "ref_logprobs"] if a.kl_in_reward and self.ref is not None else []) \
            + (["values"] if needs.values else []) + (["baseline"] if needs.baseline else [])
        got = self.dock.get(part, idx, cols) if cols else {}
        out, self._kl_metrics = advantage_rows(
            a, rewards, [len(c.token_ids) for c in comps], torch.tensor([c.prompt_index for c in comps]),
            gen_logprobs=got["gen_logprobs"] if "gen_logprobs" in cols else None,
            ref_logprobs=got["ref_logprobs"] if "ref_logprobs" in cols else None,
            values=got["values"] if needs.values else None,
            baseline=torch.tensor([float(b) for b in got["baseline"]]) if needs.baseline else None,
            loss_masks=_loss_masks(comps))
        return out

    def update(self, part: str, step: int, comps: list[Completion]) -> dict[str, float]:
        """Stream the finished rows from the dock into the critic's (PPO) and the actor's update."""
        a, t = self.cfg.algorithm, self.cfg.trainer
        fields = self.update_fields()
        critic_fields = ["values", "returns"] + (["loss_mask"] if self.episodes is not None else []) \
            if self.critic is not None else []
        metrics: dict[str, float] = {}
        columns = list(dict.fromkeys(["prompt_ids", "response_ids", *fields, *critic_fields]))
        for b in self.dock.stream(part, stage="update", columns=columns,
                                  batch_size=len(comps)):
            rows = list(range(len(b.indexes)))
            if a.overlong_filter:  # DAPO: truncated responses count in the group statistics but not in the loss
                rows = [r for r, i in enumerate(b.indexes) if comps[i].finish_reason != "length"]
                metrics["actor/overlong_filtered"] = float(len(b.indexes) - len(rows))
            groups = [comps[i].prompt_index for i in b.indexes]
            batch = SequenceBatch(b["prompt_ids"], b["response_ids"], {f: b[f] for f in fields}, groups).select(rows)
            why = self._cannot_update(batch, len(b.indexes))
            if why is not None:  # no optimizer step this RL step (the weights stay; relaying them is a no-op)
                self.s.tracker.write_text(f"step {step}: {why}; no update this step")
                metrics["actor/skipped_update"] = 1.0
                b.ack()
                continue
            kw = dict(mini_batches=t.mini_batches, epochs=t.epochs, seed=self.cfg.run.seed + step,
                      temperature=self.temperature)
            if self.critic is not None:
                values = SequenceBatch(batch.prompt_ids, batch.response_ids,
                                       {f: [b[f][r] for r in rows] for f in critic_fields}, batch.groups)
                metrics.update(self.critic.split("update", values, self.value_loss, **kw)[0])
            if step > self.cfg.critic.warmup_steps or self.critic is None:  # every rank reports the global metrics
                metrics.update(self.actor.split("update", batch, self.loss, **kw,
                                                with_entropy="grad" if a.entropy_coef > 0 else True)[0])
            b.ack()
        return self.kl_metrics(metrics, self._kl_metrics)

    def update_fields(self) -> list[str]:
        """The per-token columns the actor's loss reads (besides the prompt and response ids)."""
        return ["advantages", "gen_logprobs"] + (["ref_logprobs"] if self.ref is not None else []) \
            + (["old_logprobs"] if self.recompute_old else []) + (["loss_mask"] if self.episodes is not None else [])

    def kl_metrics(self, metrics: dict[str, float], in_reward: dict[str, float]) -> dict[str, float]:
        """``metrics`` with the step's KL-in-reward metrics, ``actor/kl`` and the tri-model's saved passes."""
        metrics.update(in_reward)
        if self.tri_model:  # each in-place reference pass replaces one a reference group would run separately
            metrics["trimodel/separate_passes_saved"] = metrics.get("actor/ref_forward_passes", 0.0)
        if "actor/ref_kl_k1" in metrics:
            metrics["actor/kl"] = metrics["actor/ref_kl_k1"]
        return metrics

    def _cannot_update(self, batch: SequenceBatch, generated: int) -> str | None:
        """Why the actor cannot take its ``trainer.mini_batches`` optimizer steps on ``batch`` (None: it can).
        Every data-parallel rank takes exactly that many steps, one per mini-batch, so each rank needs a row
        per mini-batch. The config check covers a full batch split evenly; a batch falls short of it when
        ``algorithm.overlong_filter`` drops rows, dynamic sampling ends short of ``data.prompts_per_step``,
        or the split at prompt-group boundaries is uneven."""
        mb, ranks = self.cfg.trainer.mini_batches, self.actor.world_size
        if len(batch) == 0:
            return (f"algorithm.overlong_filter dropped all {generated} responses (every one was cut at "
                    f"rollout.max_new_tokens={self.sampling.max_new_tokens}; raise it)")
        fewest = min(len(p) for p in batch.split(ranks)) if len(batch) >= ranks else 0
        if fewest < mb:
            return (f"{len(batch)} of {generated} rows are left to train on (after DAPO's dynamic sampling and "
                    f"algorithm.overlong_filter), {fewest} on the data-parallel rank with the fewest, fewer than "
                    f"trainer.mini_batches={mb} (each mini-batch is one optimizer step and needs a row on every "
                    f"rank: lower trainer.mini_batches)")
        return None

    # ------------------------------------------------------- eval and state
    def evaluate(self, step: int) -> dict[str, float]:
        if self.episodes is not None:
            with self.s.span("eval", "rollout", step):
                return evaluate_episodes(self.rollout, self.s, self.episodes, step)
        with self.s.span("eval", "rollout", step):
            result = self.s.evaluate(lambda p, sp: generate(self.rollout, p, sp), step)
        return result.metrics

    def save(self, step: int) -> Path:
        with self.s.span("checkpoint", "driver", step):
            rng = rollout_rng(self.rollout)
            return self.s.save(step, collective(self.actor, "state"), extra_state={"rollout_rng": rng},
                               extra=self.extra_state())

    def extra_state(self) -> dict | None:
        """What a checkpoint holds besides the actor: the critic's full state (PPO)."""
        return None if self.critic is None else {"critic": collective(self.critic, "state")}

    def shutdown(self) -> None:
        for g in (self.actor, self.rollout, self.ref, self.critic):
            if g is not None:
                g.shutdown()
        self.dock.shutdown()


class Rollout(NamedTuple):
    """One step's generated and scored samples (what ``learn`` takes)."""

    problems: list
    comps: list[Completion]
    rewards: torch.Tensor
    metrics: dict[str, float]
    baselines: torch.Tensor | None = None
    """ReMax: the reward of the greedy response to each sample's prompt."""


def sample_metrics(scores: torch.Tensor, rewards: torch.Tensor, lengths: torch.Tensor,
                   truncated: torch.Tensor) -> dict[str, float]:
    """A step's reward, accuracy and response-length metrics from its samples' verifier ``scores``, shaped
    ``rewards``, response ``lengths`` and ``truncated`` flags (cut at max_new_tokens)."""
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "train/accuracy": float((scores >= 1.0).float().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_ratio": float(truncated.float().mean()),
    }


def _loss_masks(comps: list[Completion]) -> list[torch.Tensor] | None:
    """The samples' loss masks (multi-turn episodes: 0 on the environment's tokens); None when every token
    of every sample is the model's."""
    masks = [getattr(c, "loss_mask", None) for c in comps]
    if all(m is None for m in masks):
        return None
    if any(m is None for m in masks):
        raise ValueError("a step mixes samples with and without a loss mask (episodes and single responses)")
    return masks


def _reindex(c: Completion, prompt_index: int) -> Completion:
    return replace(c, prompt_index=prompt_index)
