"""The stages that read a step's partition: the forward-only passes, the advantages and the update.

::

    reference:   groups with responses [and rewards]   -> ref_logprobs  (reference group; KL outside the actor)
    teacher:     groups with responses [and rewards]   -> teacher_logprobs  (on-policy distillation's teacher)
    old:         groups with responses [and rewards]   -> old_logprobs [, sum_pi_squared]  (actor; the batch is used
                                                          more than once, or OTB reads the pass's statistics)
    values:      groups with responses [and rewards]   -> values        (critic)
    advantages:  groups with rewards [, ref, values,   -> advantages [, returns]
                 teacher, old]  (ref: KL in the reward, or online DPO's margins with old)
                 (group-relative estimators per group; batch-whitened ones once the batch is complete)
    update:      batch:       once every row has advantages, mini-batches x epochs optimizer steps
                 accumulate:  forward + backward on each group as it gets advantages, one optimizer step
                              when the batch is consumed (the same update, overlapped with generation)

A stage whose group shares the rollout's pool waits until generation ends (its devices are time-shared);
on a pool of its own it starts on the first group. With dynamic sampling the forward passes also wait for
a group's rewards (a dropped group never gets them, and its rows are retired).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from relayrl.cluster import WorkerGroup
from relayrl.models.routing import ROUTES_COLUMN
from relayrl.workflows.flow import Flow
from relayrl.workflows.parts import StepParts
from relayrl.workflows.scoring import ScoreWorker
from relayrl.workflows.trainer_workers import CriticWorker, PolicyWorker, ReferenceWorker

__all__ = ["Consume", "deal_groups"]


class Consume:
    """The consuming stages of a step (module docstring)."""

    def __init__(self, parts: StepParts) -> None:
        self.p = parts

    def stages(self) -> dict:
        """The consuming stages of the plan's stage graph, in the order a sequential step runs them."""
        run = {"reference": self.reference, "teacher": self.teacher, "old": self.old_logprobs, "values": self.values,
               "advantages": self.advantages, "update": self.update}
        return {s.name: run[s.name] for s in self.p.plan.stages if not s.producing}

    # ---------------------------------------------------------- forward passes
    def _pass(self, f: Flow, stage: str, group: WorkerGroup, forward_into: Callable, span: str, column: str,
              **kwargs) -> None:
        """Each ready batch of groups -> ``forward_into`` (the group's worker class's) on every rank -> the
        receipts published."""
        p = self.p
        cols = ["prompt_ids", "response_ids", "group"] + (["rewards"] if p.plan.group_filter else []) \
            + (self._routes() if stage == "old" and self.p.cfg.algorithm.routes_from_rollout else [])
        gate = self._gate(stage, f)
        rows = self._rows(stage)
        for b in f.leases(stage, cols, batch_rows=rows, after=gate):
            with p.phases.phase(span, group, f.step):
                for r in group.split(forward_into, self._items(f, b.indexes, cols, group.world_size), column,
                                     **kwargs):
                    p.dock.publish(r)
            b.ack()

    def reference(self, f: Flow) -> None:
        self._frozen_pass(f, "reference", self.p.reference, "ref_logprob", "ref_logprobs")  # a ReferenceWorker

    def teacher(self, f: Flow) -> None:
        self._frozen_pass(f, "teacher", self.p.teacher, "teacher_logprob", "teacher_logprobs")  # a ReferenceWorker

    def _frozen_pass(self, f: Flow, stage: str, group: WorkerGroup, span: str, column: str) -> None:
        """A frozen model's log-probs (reference, teacher); with trainer.offload it is on the device for its
        turn only."""
        p = self.p
        gate = self._gate(stage, f)
        while gate is not None and not gate.wait(0.2):
            if f.stop.is_set():
                return
        p.phases.wake(group)
        self._pass(f, stage, group, ReferenceWorker.forward_into, span, column, temperature=p.temperature)
        p.phases.idle(group)

    def old_logprobs(self, f: Flow) -> None:
        stats = {"sum_sq_column": "sum_pi_squared"} if self.p.plan.estimator.token_stats else {}  # (OTB)
        if self.p.cfg.algorithm.routing_replay == "old":  # (R2: the update replays this pass's routing)
            stats["routes_column"] = ROUTES_COLUMN
        self._pass(f, "old", self.p.actor, PolicyWorker.forward_into, "old_logprob", "old_logprobs",
                   temperature=self.p.temperature, **stats)

    def values(self, f: Flow) -> None:
        self._pass(f, "values", self.p.critic, CriticWorker.forward_into, "values", "values")

    # -------------------------------------------------------------- advantages
    def advantages(self, f: Flow) -> None:
        p, est = self.p, self.p.plan.estimator
        a = p.cfg.algorithm
        cols = ["rewards", "response_ids", "group"] \
            + (["gen_logprobs", "ref_logprobs"] if a.kl_in_reward and p.reference is not None else []) \
            + (["values"] if est.values else []) + (["baseline"] if est.baseline else []) \
            + (["ref_logprobs"] if est.reference else []) \
            + (["old_logprobs"] if est.reads_old else []) + (["sum_pi_squared"] if est.token_stats else []) \
            + (["gen_logprobs"] if est.token_stats and a.correction.enabled else []) \
            + (["gen_logprobs", "teacher_logprobs"] if p.teacher is not None else []) \
            + (["loss_mask"] if p.masked else []) \
            + (["fn_scores"] if p.cfg.reward.decoupled else [])  # (GDPO: each reward function's scores)
        cols = list(dict.fromkeys(cols))  # (gen_logprobs for the KL in the reward, the teacher, OTB's weights)
        for b in f.leases("advantages", cols, batch_rows=self._rows("advantages")):
            with p.session.span("advantage", "driver", f.step):
                receipt, kl, sums = p.score(ScoreWorker.advantages_into, p.dock.reader(f.part, b.indexes, cols),
                                            p.dock.slots(f.part, b.indexes), f.state.kl_coef)
            p.dock.publish(receipt)
            with f.state.cond:
                for k, v in kl.items():
                    f.state.kl.setdefault(k, []).append((v, len(b.indexes)))
                f.state.advantages = f.state.advantages + sums
            b.ack()

    def _routes(self) -> list[str]:
        """The routing column the policy's passes replay (``algorithm.routing_replay``: the rollout's, or the old
        pass's), or none."""
        return [ROUTES_COLUMN] if self.p.cfg.algorithm.routing_replay != "none" else []

    # ------------------------------------------------------------------ update
    def update_fields(self) -> list[str]:
        """The per-token columns the actor's loss reads (besides the prompt and response ids)."""
        p = self.p
        return ["advantages", "gen_logprobs"] + (["ref_logprobs"] if p.reference is not None else []) \
            + (["old_logprobs"] if p.plan.recompute_old else []) + (["loss_mask"] if p.masked else [])

    def update(self, f: Flow) -> None:
        """The plan's update: on the whole batch, or accumulated per arriving group (one optimizer step)."""
        p, a = self.p, self.p.cfg.algorithm
        loss = p.loss if f.state.entropy_coef is None else replace(p.loss, entropy_coef=f.state.entropy_coef)
        loss = loss if a.kl_in_reward else replace(loss, kl_coef=f.state.kl_coef)  # (the KL controller's)
        fields = self.update_fields()
        critic_fields = (["values", "returns"] + (["loss_mask"] if p.masked else [])
                         if p.critic is not None else [])
        cols = list(dict.fromkeys(["prompt_ids", "response_ids", "group", "truncated", *fields, *critic_fields,
                                   *self._routes()]))
        loss_kw = dict(drop_truncated=a.overlong_filter, temperature=p.temperature,
                       with_entropy="grad" if loss.entropy_coef > 0 else True)
        if p.plan.update == "batch":
            self._update_batch(f, cols, loss, fields, critic_fields, loss_kw["with_entropy"])
        else:
            self._update_accumulated(f, cols, loss, fields, loss_kw)

    def _update_batch(self, f: Flow, cols: list[str], loss, fields: list[str], critic_fields: list[str],
                      with_entropy: bool | str) -> None:
        """Once every row has advantages: the critic's and the actor's mini-batches x epochs optimizer steps."""
        p, step, st = self.p, f.step, f.state
        opt = dict(mini_batches=p.cfg.trainer.mini_batches, epochs=p.cfg.trainer.epochs, seed=p.cfg.run.seed + step,
                   temperature=p.temperature, drop_truncated=p.cfg.algorithm.overlong_filter)
        for b in f.leases("update", cols, batch_rows=None, after=self._gate("update", f)):
            if not self._can_train(f, b.indexes):
                b.ack()
                continue
            with p.phases.phase("update", p.actor, step):
                if p.critic is not None:
                    m = p.critic.split_rank0(CriticWorker.train_batch,  # every rank: the global figures
                                             self._items(f, b.indexes, cols, p.critic.world_size),
                                             p.value_loss, critic_fields, **opt)
                    with st.cond:
                        st.update.update(m)
                if step > p.cfg.critic.warmup_steps or p.critic is None:
                    m = p.actor.split_rank0(PolicyWorker.train_batch,  # every rank: the global figures
                                            self._items(f, b.indexes, cols, p.actor.world_size), loss, fields,
                                            **opt, with_entropy=with_entropy)
                    with st.cond:
                        st.update.update(m)
            b.ack()

    def _update_accumulated(self, f: Flow, cols: list[str], loss, fields: list[str], loss_kw: dict) -> None:
        """Forward + backward on each chunk of groups as it gets advantages, then one optimizer step."""
        p, step, st = self.p, f.step, f.state
        consumed = 0
        for b in f.leases("update", cols, batch_rows=p.sampling.n * p.cfg.trainer.stream_groups,
                          after=self._gate("update", f)):
            with p.phases.phase("update", p.actor, step):
                p.actor.split(PolicyWorker.forward_backward, self._items(f, b.indexes, cols, p.actor.world_size),
                              loss, fields, fresh=consumed == 0, **loss_kw)
            consumed += len(b.indexes)
            b.ack()
        if f.stop.is_set() or consumed == 0 or not self._can_train(f, None):
            return  # (what was accumulated is dropped by the next update's first chunk)
        with p.phases.phase("update", p.actor, step):
            m = p.actor.all_rank0(PolicyWorker.optim_step)  # every rank steps (collective): the global figures
        with st.cond:
            st.update.update(m)

    def _can_train(self, f: Flow, indexes: list[int] | None) -> bool:
        """Whether the update can take its optimizer steps; if not, say why in the run's log and record
        ``actor/skipped_update``. DAPO's overlong filter may drop every row; with the whole batch at once
        (``indexes``), the rows left after the filter and dynamic sampling need one per mini-batch (each
        mini-batch is an optimizer step; the engine cuts them from every rank's rows together, so a rank holding
        none of a mini-batch's rows, or none at all, still takes it)."""
        p, st = self.p, f.state
        records = st.kept_records()
        rows = sum(len(r.lengths) for r in records)
        cut = {i: t for r in records for i, t in zip(st.rows[r.group], r.truncated)}
        if p.cfg.algorithm.overlong_filter:
            with st.cond:
                st.update["actor/overlong_filtered"] = float(sum(cut.values()))
        why = None
        if p.cfg.algorithm.overlong_filter and sum(cut.values()) >= rows:
            why = (f"algorithm.overlong_filter dropped all {rows} responses (every one was cut at "
                   f"rollout.max_new_tokens={p.sampling.max_new_tokens}; raise it)")
        elif indexes is not None:
            mb = p.cfg.trainer.mini_batches
            left = sum(not (p.cfg.algorithm.overlong_filter and cut.get(i, False)) for i in indexes)
            if left < mb:
                why = (f"{left} of {rows} rows are left to train on (after DAPO's dynamic sampling and "
                       f"algorithm.overlong_filter), fewer than trainer.mini_batches={mb} (each mini-batch is one "
                       f"optimizer step and needs a row: lower trainer.mini_batches)")
        if why is None:
            return True
        p.session.tracker.write_text(f"step {f.step}: {why}; no update this step")
        with st.cond:
            st.update["actor/skipped_update"] = 1.0
        return False

    # ----------------------------------------------------------------- helpers
    def _rows(self, stage: str) -> int | None:
        """Rows per call of ``stage``: ``trainer.stream_groups`` groups when the stage graph streams it per
        chunk, None (the whole batch in one call) when it waits for the batch."""
        p = self.p
        return p.sampling.n * p.cfg.trainer.stream_groups if p.plan.stage(stage).per == "chunk" else None

    def _gate(self, stage: str, f: Flow):
        """A stage on the rollout's pool waits for generation to end (the devices are time-shared)."""
        return f.generated if self.p.plan.stage(stage).after_generation else None

    def _shares(self, indexes: list[int], ranks: int) -> list[tuple[list[int], None]]:
        """Each rank's rows: whole groups of ``indexes``, in order (:func:`deal_groups`: the data-parallel
        replicas, ``engine.sequence_parallel`` ranks each, take contiguous runs of about equal groups). In order,
        so the ranks' rows side by side are the batch's, from which the engine cuts the mini-batches as one rank
        would (dealt out in turn, two ranks held groups 0, 2 and 1, 3, and ``trainer.mini_batches=2`` on two
        ranks took other rows than on one)."""
        n = self.p.sampling.n
        if ranks == 1:
            return [(indexes, None)]
        groups = [indexes[i:i + n] for i in range(0, len(indexes), n)]
        return [(sum(run, []), None) for run in deal_groups(groups, ranks, self.p.cfg.engine.sequence_parallel)]

    def _items(self, f: Flow, indexes: list[int], cols: list[str], ranks: int) -> list:
        """One ``(reader, slots)`` per rank over its share of ``indexes`` (``(None, None)``: no rows)."""
        dock = self.p.dock
        return [(dock.reader(f.part, idx, cols), dock.slots(f.part, idx)) if idx else (None, None)
                for idx, _ in self._shares(indexes, ranks)]


def runs(items: list, k: int) -> list[list]:
    """``items`` cut into ``k`` contiguous runs of about equal length, in order (the first ``len % k`` one
    longer; runs past the items are empty)."""
    base, extra = divmod(len(items), k)
    bounds = [r * base + min(r, extra) for r in range(k + 1)]
    return [items[bounds[r]:bounds[r + 1]] for r in range(k)]


def deal_groups(groups: list, ranks: int, sequence_parallel: int = 1) -> list[list]:
    """Each of ``ranks`` ranks' prompt groups, in order: the ``ranks / sequence_parallel`` data-parallel replicas
    (``sequence_parallel`` consecutive ranks each, which pool their rows: Ulysses,
    :mod:`relayrl.engines.training.ulysses`) take contiguous runs of about equal groups, and each replica's run is
    spread over its ranks the same way. Dealt to the ranks alone, 2 groups on 4 ranks as 2 SP groups would put
    both on the first SP group and leave the second idle."""
    sp = sequence_parallel
    if sp < 1 or ranks % sp:
        raise ValueError(f"engine.sequence_parallel={sp} must divide the trainer group's {ranks} ranks (each "
                         f"data-parallel replica is {sp} ranks)")
    return [rank for run in runs(groups, ranks // sp) for rank in runs(run, sp)]
