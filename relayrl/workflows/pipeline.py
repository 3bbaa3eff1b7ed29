"""The GRPO-family step: one implementation for every mode (GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++, ReMax,
PPO with a critic, online DPO, multi-turn episodes, reward models and judges as scorers).

The stages run as threads over one dock partition per step (the streaming dataflow of AsyncFlow's
TransferQueue and the periodic asynchrony paper's Algorithm 1)::

        rollout ──► [prompt_ids response_ids gen_logprobs ...] ──► score ──► [rewards] ──┐
           │                                                                              ▼
           └─ReMax─► [baseline_ids] ──► baseline ──► [baseline] ──────────────────► advantages ──► [advantages]
                                                                                          ▲             │
        reference ──► [ref_logprobs] ──(kl in reward, online DPO)─────────────────────────┘             │
        old (actor) ──► [old_logprobs] ──────────────────────────────────────────────────────┐          │
        values (critic) ──► [values] ──► advantages                                          ▼          ▼
                                                                                          update ◄─────┘
                                                                        weights ──► relay ──► rollout

    stage       consumes                      waits for                        unblocks
    sample      prompts                       weights of the step (or k ahead) score, every pass
    score       response_ids                  a landed batch of rows           advantages; DAPO's next round
    baseline    baseline_ids (ReMax)          the kept groups' greedy rows     advantages
    reference   prompt_ids, response_ids      a group (its pool's turn)        advantages (KL in reward, online
                                                                                   DPO), update
    teacher     prompt_ids, response_ids      a group (its pool's turn)        advantages (distillation)
    old/values  prompt_ids, response_ids      a group (its pool's turn)        update / advantages (GAE, OTB,
                                                                                   online DPO)
    advantages  rewards [, values, baseline]  a group (or the whole batch)     update
    update      advantages and the passes     a group (accumulate) or all      the relay
    relay       the actor's weights           the update                       the next step's sample

What the config sets is worked out once by the step plan (:mod:`relayrl.config.plan`):

* ``ahead`` (``trainer.off_policy_steps``): how many weight versions the rollout may run ahead. 0: the
  partition's producing and consuming stages run in one step and the weights reach the rollout at its end
  (on-policy). k: the producing stages run on a rollout thread up to k partitions ahead
  (:mod:`relayrl.workflows.ahead`), so every token is at most k versions stale.
* ``update``: ``batch`` waits for every row; ``accumulate`` trains each group as it gets its advantages and
  steps the optimizer once (periodic asynchrony; the same update).
* placement: a stage whose group shares the rollout's pool waits for generation to end (colocated: the
  phases take turns, as in HybridFlow's hybrid engine); on another pool it starts on the first group.

Departure from PPO-style trainers: with one optimizer step per batch, pi_old is the update's own forward
pass, detached (ratio 1 on the trainer's weights; the rollout/trainer mismatch is still measured); the
separate old-policy pass runs when the batch is used more than once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from relayrl.algorithms.kl import kl_controller
from relayrl.algorithms.retire import solved_groups
from relayrl.checkpoint import CheckpointError, check_fits
from relayrl.cluster import make_group
from relayrl.config.plan import step_plan
from relayrl.config.schema import Config, offpolicy_placement
from relayrl.dock import Dock, traffic
from relayrl.engines.training.steps import rescaled_scheduler_state
from relayrl.weights import WeightRelay
from relayrl.workflows.ahead import RolloutAhead
from relayrl.workflows.consume import Consume
from relayrl.workflows.episodes import evaluate_episodes
from relayrl.workflows.flow import Flow
from relayrl.workflows.parts import Phases, build_parts
from relayrl.workflows.produce import Produce
from relayrl.workflows.ref_sync import ReferenceSync
from relayrl.workflows.relay import relay_weights
from relayrl.workflows.roles import Pools, build_roles, check_teacher, placed_config
from relayrl.workflows.scoring import RewardShaping, ScoreWorker
from relayrl.workflows.session import Session
from relayrl.workflows.state import StepState
from relayrl.workflows.step_metrics import mismatch_warning, staleness_metrics, step_metrics, step_tokens
from relayrl.cluster.worker import method_name
from relayrl.workflows.rollout_worker import RolloutWorker, generate, restore_rollout_rng, rollout_rng
from relayrl.workflows.trainer_workers import CriticWorker, PolicyWorker

__all__ = ["GRPOPipeline", "KEY_METRICS"]

KEY_METRICS = ("reward/mean", "eval/accuracy", "response/length_mean", "actor/entropy", "perf/step_time_s")

# worker-group methods whose arguments or results are weights or checkpoints, not samples
_NOT_SAMPLES = frozenset({"named_weights", "relayed_weights", "pack_weights_into", "update_weights", "receive_weights", "share_weights", "state",
                          "load_state", "param_shapes", "weight_stream", "save_pretrained", "rng_state", "set_rng_state",
                          "fold_moments", "reward_moments", "load_reward_moments"})


class GRPOPipeline:
    """Builds the roles, the dock and the stages from the step plan, then runs :meth:`step` per RL step."""

    def __init__(self, cfg: Config, session: Session | None = None) -> None:
        cfg = placed_config(offpolicy_placement(cfg))
        plan = step_plan(cfg)
        self.s = s = session or Session(cfg)
        # the session's trainer section: trainer.total_epochs resolved into trainer.steps over its rows
        self.cfg = cfg = cfg.model_copy(update={"trainer": s.cfg.trainer})
        self.plan = plan
        s.log(f"relayrl: {plan.describe()}" + "".join(f"\nrelayrl: {n}" for n in plan.notes))
        pools = Pools(cfg, s.pool)
        if "teacher" in plan.roles:  # before any model loads
            check_teacher(cfg.algorithm.distill.teacher, s.tokenizer)
        groups = build_roles(cfg, plan, pools, str(s.model_path))
        self.actor, self.rollout = groups["actor"], groups["rollout"]
        self.ref, self.critic, self.teacher = groups.get("reference"), groups.get("critic"), groups.get("teacher")
        if cfg.cluster.backend == "ray":  # say where each role landed (a multi-node run places them by pool)
            s.log("relayrl: placed " + ", ".join(f"{k} on {'/'.join(sorted(set(g.nodes())))}" for k, g in groups.items()))
        self.dock = Dock.from_config(cfg.dock)
        self.relay = WeightRelay()
        self.shared = self._share_rollout_weights()
        scorer = dict(reward=s.reward, tokenizer=s.tokenizer, algorithm=cfg.algorithm, shape=RewardShaping.of(cfg))
        if cfg.placement.reward == "driver":  # threads of the driver: calls run concurrently, beside every pool
            worker = ScoreWorker(**scorer)

            def score(method, *args):  # ``method``: ScoreWorker.score_rows (or its name), as for a group's calls
                return getattr(worker, method_name(ScoreWorker, "scorer", method))(*args)

            self.scorer = None
        else:  # a pool's devices (a reward model): its calls take that pool's turns
            self.scorer = make_group(cfg.cluster.model_copy(update={"in_process": True}), ScoreWorker,
                                     pools(cfg.placement.reward), "scorer", init_kwargs=scorer)
            score = self.scorer.one
        self.ahead: RolloutAhead | None = None
        self._mismatch_said = False  # (rollout/logprob_error's warning: once per run)
        self.parts = build_parts(cfg, plan, s, self.dock, groups, score, Phases(s, cfg.trainer.offload, self.actor, self.shared),
                                 between_polls=lambda: self.ahead.between_polls() if self.ahead is not None else None)
        self.produce, self.consume = Produce(self.parts, partial=plan.partial), Consume(self.parts)
        a = cfg.algorithm
        self.kl_ctrl = kl_controller(a.kl_coef, a.kl_target, a.kl_horizon)
        """The KL coefficient of each step: fixed, or adaptive toward ``algorithm.kl_target`` (checkpointed)."""
        self.entropy_ctrl = a.entropy_controller()
        """The entropy bonus's coefficient of each step: fixed, or adaptive (``algorithm.entropy_target``)."""
        self.ref_sync = ReferenceSync(cfg.trainer.ref_sync_every, cfg.trainer.ref_sync_alpha, self.actor, self.ref,
                                      self.parts.phases)
        """``trainer.ref_sync_every``: the reference moved toward the policy (checkpointed)."""

    def _share_rollout_weights(self) -> bool:
        """Zero-redundancy colocation: an actor and a rollout both in the driver process with the same weight
        dtype share the parameters (no copy, no relay traffic). Not with LoRA: the rollout needs the merged
        weights, which the actor does not hold."""
        prec = {"trained": self.cfg.model.dtype if self.cfg.model.pure_low_precision else "float32",
                "rollout": self.cfg.rollout.dtype or self.cfg.model.dtype}
        if not (self.actor.in_driver and self.rollout.in_driver) or prec["trained"] != prec["rollout"] \
                or self.cfg.model.lora.enabled:
            return False
        return bool(self.rollout.one(RolloutWorker.share_weights, self.actor.one(PolicyWorker.named_weights), 0))

    # ---------------------------------------------------------------- the step
    def step(self, step: int) -> dict[str, float]:
        """One RL step: fill partition ``step`` (here, or ahead on the rollout thread), consume it, and give the
        rollout the new weights (now, or packed for the rollout thread)."""
        t0 = time.perf_counter()
        self._reset_counters()
        if self.ahead is None and self.plan.ahead:  # from here on, batches are generated ahead (staleness <= k)
            self.ahead = self._start_ahead(step)
        if self.ahead is not None:
            with self.s.span("wait_rollout", "actor", step):  # (timing/wait_rollout_s: the trainer's wait)
                f = self.ahead.take(step)
            stages = self.consume.stages()
        else:
            f = self.open_step(step)
            stages = {**self.produce.stages(), **self.consume.stages()}
        f.state.kl_coef = self.kl_ctrl.value  # (set before the consuming stages start; off-policy too)
        f.state.entropy_coef = self.entropy_ctrl.value
        self._run(f, stages)
        retired = self._retire(f.state)  # (before the rollout thread may draw the next batch: the hand-over)
        m = {**step_metrics(f.state, step=step, prompts_per_step=self.cfg.data.prompts_per_step,
                            tri_model=self.plan.tri_model, session=self.s)}
        trained = "dapo/skipped_step" not in m
        m.update(self._adapt_kl(m, f, trained))
        m.update(self._adapt_entropy(m, f, trained))
        m.update(self.ref_sync.after_step(step))  # (before the next step's reference pass)
        self.s.tracker.log_samples(step, sorted(f.state.samples, key=lambda s: s["group"]))  # (by prompt group, not
        # in the order the scoring calls ended)
        m.update(self._hand_over_weights(step, f, trained))
        m.update(self.parts.phases.metrics)
        m.update(self._driver_bytes())  # (after the hand-over: weights relayed through the driver count)
        m.update(retired)
        if not self._mismatch_said and (line := mismatch_warning(m, step)) is not None:
            self.s.log(line)
            self._mismatch_said = True
        return self.perf(m, t0, step_tokens(f.state), step if trained or self.ahead is not None else None)

    def _retire(self, st: StepState) -> dict[str, float]:
        """``data.retire_solved``: the rows whose group this step solved at that pass rate are never drawn
        again (their groups were judged, kept or dropped); ``data/retired`` and ``data/active_rows`` after it.
        Off-policy, batches drawn ahead before a row retired still train on it."""
        threshold, prompts = self.cfg.data.retire_solved, self.s.prompts
        if threshold is None:
            return {}
        with st.cond:
            rows = [st.positions[g] for g in solved_groups(st.pass_rates, threshold)]
        prompts.retire(rows)
        return {"data/retired": float(len(prompts.retired)), "data/active_rows": float(prompts.active_rows)}

    def _adapt_kl(self, m: dict[str, float], f: Flow, trained: bool) -> dict[str, float]:
        """``actor/kl_coef``, the coefficient this step used; then an adaptive controller moves it by the step's
        KL (the penalty's own estimate: ``actor/reward_kl`` in the rewards, ``actor/kl_loss`` in the loss) over
        the step's samples (Ziegler et al. 2019; TRL and verl count samples the same way)."""
        a = self.cfg.algorithm
        if a.kl_coef == 0:
            return {}
        kl = m.get("actor/reward_kl" if a.kl_in_reward else "actor/kl_loss")
        if trained and kl is not None and "actor/skipped_update" not in m:
            self.kl_ctrl.update(kl, n_steps=sum(len(r.lengths) for r in f.state.kept_records()))
        return {"actor/kl_coef": f.state.kl_coef}

    def _adapt_entropy(self, m: dict[str, float], f: Flow, trained: bool) -> dict[str, float]:
        """``actor/entropy_coef``, the coefficient this step used (with a bonus or its adaptive control); then
        the adaptive controller sees the step's ``actor/entropy``."""
        a = self.cfg.algorithm
        if a.entropy_target is None and a.entropy_coef == 0:
            return {}
        if trained and "actor/entropy" in m and "actor/skipped_update" not in m:
            self.entropy_ctrl.update(m["actor/entropy"])
        return {"actor/entropy_coef": f.state.entropy_coef}

    def _run(self, f: Flow, stages: dict) -> None:
        """Run the partition's stages to their end (off-policy: also wait for the producing stages on the rollout
        thread to finish scoring), raise the first error, and close the partition."""
        try:
            f.run(stages, sequential=self.plan.sequential)
            while self.ahead is not None and not f.produced.wait(0.2):
                self.ahead.raise_error()
            if f.errors:  # a producing stage failed after the consuming ones had returned
                raise f.errors[0]
        finally:
            self.dock.close_partition(f.part)

    def _hand_over_weights(self, step: int, f: Flow, trained: bool) -> dict[str, float]:
        """On-policy: relay the new weights to the rollout now (nothing to relay when the step trained on
        nothing). Off-policy: stage them for the rollout thread, and check the batch's token staleness."""
        phases = self.parts.phases
        if self.ahead is not None:
            with self.s.span("pack_weights", "actor", step):
                self.ahead.pack_weights(step, self.actor)
            versions = [v for r in f.state.kept_records() for v in r.versions]
            return {**staleness_metrics(versions, step, self.plan.ahead), **self.ahead.step_metrics()}
        if not trained:
            phases.wake(self.rollout)
            return {}
        phases.wake(self.rollout, restore=False)  # its old weights are overwritten next
        with self.s.span("relay", "rollout", step):
            m = relay_weights(self.actor, self.rollout, version=step, relay=self.relay)
        phases.idle(self.actor, self.critic)
        return m

    def _reset_counters(self) -> None:
        self.parts.phases.metrics = {}
        for g in self._groups():  # (an evaluation's completions since the last step are not samples)
            g.reset_bytes()
        traffic.take()

    def open_step(self, step: int) -> Flow:
        """Draw the step's prompts and open its partition (``P`` groups of ``n`` rows; with dynamic sampling
        room for every resample round, the rows not needed retired)."""
        P, n = self.cfg.data.prompts_per_step, self.parts.sampling.n
        if self.cfg.reward.normalize == "running":  # the earlier steps' rewards in the moments, frozen for this one
            self.parts.score(ScoreWorker.fold_moments)
        problems = self.s.prompts.take(P)
        part = f"step-{step}"
        rounds = 1 + self.cfg.algorithm.max_resample_rounds if self.plan.group_filter else 1
        self.dock.open_partition(part, rows=P * rounds * n, group_size=n)
        return Flow(self.dock, part, step, StepState(list(problems), list(problems.positions)))

    def perf(self, metrics: dict[str, float], t0: float, tokens: int, version: int | None) -> dict[str, float]:
        """Step time and throughput (``tokens``: prompt + generated tokens, per device per second, over the
        devices of every pool a role holds: a reference, critic, teacher or reward model on a pool of its own
        spends devices on the step too)."""
        dt = time.perf_counter() - t0
        devices = sum(p.world_size for p in {id(g.pool): g.pool for g in self._groups()}.values())
        metrics.update({"perf/step_time_s": dt, "perf/tokens": tokens,
                        "perf/tokens_per_s_per_device": tokens / (dt * devices)})
        if version is not None:
            metrics["weights/version"] = version
        return metrics

    def _start_ahead(self, step: int) -> RolloutAhead:
        return RolloutAhead(self.plan.ahead, range(step, self.cfg.trainer.steps + 1), open_flow=self.open_step,
                            produce=lambda f: f.run(self.produce.stages()),
                            batch_start=lambda: (self.s.prompts.state(), rollout_rng(self.rollout),
                                                 self.parts.score(ScoreWorker.fold_moments)),
                            relay=self.relay, rollout=self.rollout, partial=self.plan.partial,
                            settle=self.cfg.reward.normalize == "running")

    def _driver_bytes(self) -> dict[str, float]:
        """What crossed the driver's process this step: ``dock/driver_bytes``, the sample tensors inside
        worker-group calls (the dock keeps them at 0: calls carry row indexes and receipts); and what the
        driver's process really moved: ``dock/driver_call_bytes``, the calls' pickled messages to and from ranks
        in other processes, and ``dock/driver_unit_bytes``, the sample data its own workers (an in-driver
        trainer, ``cluster.in_process``) read from and wrote to storage units in other processes."""
        moved = traffic.take()
        return {"dock/driver_bytes": float(sum(b for g in self._groups() for k, b in g.bytes_by_method.items()
                                              if k not in _NOT_SAMPLES)),
                "dock/driver_call_bytes": float(moved.get("calls", 0)),
                "dock/driver_unit_bytes": float(moved.get("units", 0))}

    def _groups(self):
        return [g for g in (self.actor, self.rollout, self.ref, self.critic, self.teacher, self.scorer)
                if g is not None]

    # --------------------------------------------------------------- run loop
    def restore(self) -> None:
        """Load the checkpoint the resume plan chose (if any) and give the rollout the actor's weights."""
        s = self.s
        ck = s.load(self.actor.one(PolicyWorker.param_shapes))
        if ck is not None:
            schedule = self._schedule_position(ck)
            self.actor.all(PolicyWorker.load_state, {"model": ck.model_state, "optimizer": ck.optimizer_state,
                                                     "scheduler": schedule(ck.scheduler_state)})
            if self.critic is not None:
                if not isinstance(ck.extra, dict) or "critic" not in ck.extra:
                    raise CheckpointError(f"{ck.path} holds no critic state (it was saved by a run whose "
                                          f"advantage estimator has no critic); resume it with its own estimator")
                critic = ck.extra["critic"]
                check_fits(ck.path / "extra.pt", critic.get("model") or {}, self.critic.one(CriticWorker.param_shapes))
                self.critic.all(CriticWorker.load_state, {**critic, "scheduler": schedule(critic.get("scheduler"))})
            restore_rollout_rng(self.rollout, ck.trainer_state["rollout_rng"], s.log)
            if "kl_ctrl" in ck.trainer_state:  # (checkpoints before the adaptive KL have none)
                self.kl_ctrl.load_state_dict(ck.trainer_state["kl_ctrl"])
            if "entropy_ctrl" in ck.trainer_state:
                self.entropy_ctrl.load_state_dict(ck.trainer_state["entropy_ctrl"])
            if ck.trainer_state.get("reward_moments") is not None:  # (reward.normalize=running)
                self.parts.score(ScoreWorker.load_reward_moments, ck.trainer_state["reward_moments"])
            self.ref_sync.load(ck.extra.get("reference") if isinstance(ck.extra, dict) else None)
            s.restore_rng(ck)
        relay_weights(self.actor, self.rollout, version=s.start_step)
        self.parts.phases.idle(self.actor, self.critic, self.ref, self.teacher)  # generation comes first

    def _schedule_position(self, ck) -> Callable[[dict | None], dict | None]:
        """How a checkpoint's scheduler state (actor's, critic's) is loaded: as saved, or, when the resumed run
        takes another number of optimizer steps per RL step (``trainer.mini_batches x trainer.epochs``), moved
        to where the new config's schedule is at the checkpoint's step (:func:`rescaled_scheduler_state`)."""
        if ck.config is None:  # (no saved config: nothing says how the checkpoint counted its steps)
            return lambda state: state
        t = ck.config.get("trainer") or {}
        old = int(t.get("mini_batches", 1)) * int(t.get("epochs", 1))
        new = self.cfg.trainer.mini_batches * self.cfg.trainer.epochs
        if old == new:
            return lambda state: state
        self.s.log(f"relayrl: the checkpoint took {old} optimizer steps per step (trainer.mini_batches x "
                   f"trainer.epochs = {t.get('mini_batches', 1)} x {t.get('epochs', 1)}), this run takes {new} "
                   f"({self.cfg.trainer.mini_batches} x {self.cfg.trainer.epochs}): the LR schedule goes on from "
                   f"optimizer step {ck.step * new} (step {ck.step} x {new}), where the new settings put it")
        return lambda state: rescaled_scheduler_state(state, old, new)

    def begin(self) -> range:
        """Restore, open telemetry, evaluate a fresh run's starting model; the steps to train (for tests and
        benchmarks that drive :meth:`step` themselves): :meth:`Session.begin`, as :meth:`run` opens."""
        return self.s.begin(restore=self.restore, evaluate=self.evaluate, key_metrics=KEY_METRICS)

    def run(self) -> Path:
        """The shared run loop (restore, eval at step 0, steps, log, checkpoint, export) with this step."""
        def export(path: str) -> None:
            self._stop_ahead()
            self.actor.all(PolicyWorker.save_pretrained, path)

        return self.s.run(restore=self.restore, step=self.step, evaluate=self.evaluate, save=self.save,
                          export=export, shutdown=self.shutdown, key_metrics=KEY_METRICS,
                          footprint=lambda: self.actor.one(PolicyWorker.footprint))

    def evaluate(self, step: int) -> dict[str, float]:
        def held_out() -> dict[str, float]:
            with self.s.span("eval", "rollout", step):
                if self.parts.episodes is not None:
                    return evaluate_episodes(self.rollout, self.s, self.parts.episodes, step)
                return self.s.evaluate(lambda p, sp: generate(self.rollout, p, sp, self.cfg.rollout.on_error,
                                                              self.s.eval_interrupt), step).metrics

        return held_out() if self.ahead is None else self.ahead.evaluate(step, held_out)

    def save(self, step: int) -> Path:
        extra_state = {"rollout_rng": rollout_rng(self.rollout)}
        moments = None
        if self.ahead is not None:  # the position of batch step+1, the first not trained yet
            data, rng, moments = (self.ahead.start_of(step + 1) if step + 1 in self.ahead.steps
                                  else (self.s.prompts.state(), extra_state["rollout_rng"], None))
            # the rows retired by the steps trained so far (the batch's start is older: rows retired since)
            data = {**data, "retired": self.s.prompts.state()["retired"]}
            extra_state = {"rollout_rng": rng, "data": data}
        extra_state["kl_ctrl"] = self.kl_ctrl.state_dict()
        extra_state["entropy_ctrl"] = self.entropy_ctrl.state_dict()
        # reward.normalize=running: the moments of the rewards of batches 1..step; off-policy, those at batch
        # step+1's start (the rewards of batches drawn ahead are added again when the resumed run redraws them)
        extra_state["reward_moments"] = (moments if moments is not None
                                         else self.parts.score(ScoreWorker.reward_moments))
        with self.s.span("checkpoint", "driver", step):
            extra = {"critic": self.critic.all_rank0(CriticWorker.state)} if self.critic is not None else {}
            reference = self.ref_sync.state()
            if reference is not None:
                extra["reference"] = reference
            extra = extra or None
            return self.s.save(step, self.actor.all_rank0(PolicyWorker.state), extra_state=extra_state, extra=extra)

    def _stop_ahead(self) -> None:
        if self.ahead is not None:
            self.ahead.stop()

    def shutdown(self) -> None:
        self._stop_ahead()
        for g in self._groups():
            g.shutdown()
        self.dock.shutdown()
