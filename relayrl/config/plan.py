"""The plan of a GRPO-family step: the one reader of the algorithm, step-mode and placement keys.

Every GRPO-family run (GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++, ReMax, PPO with a critic, online DPO, episodes) is one
step whose shape is set by a few parameters. :func:`step_plan` works them out from the config once; the
config checks and the workflows ask the plan instead of reading ``trainer.mode``, ``off_policy_steps``,
``placement.*`` or ``algorithm.advantage`` themselves::

    ahead      how many weight versions the rollout may run ahead of the trainer (0: on-policy;
               k = trainer.off_policy_steps: every token sampled by weights at most k updates old)
    update     'batch': the update waits for the whole batch (mini-batches, epochs);
               'accumulate': forward + backward on each prompt group as it arrives, one optimizer step
               when the batch is consumed (the same update, overlapped with generation)
    colocated  the rollout shares the actor's pool (generation and training take turns on its devices);
               a stage whose group shares the rollout's pool waits for generation to end, one on another
               pool starts on the first prompt group

The synchronous colocated step is ``ahead=0, update=batch`` on one pool; periodic asynchrony is ``ahead=0,
update=accumulate`` with the rollout on its own pool; k-step off-policy is ``ahead=k``; partial rollout is a
rollout option of an off-policy plan. Where a mode cannot accumulate (a critic, an estimator whitened over
the batch, several optimizer steps per batch) the plan says so in :attr:`StepPlan.notes`, which the run
prints at start-up, instead of quietly doing something else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from relayrl.algorithms.estimators import Estimator, estimator

Config = Any  # relayrl.config.schema.Config (which asks this module; not imported back, no cycle)

__all__ = ["StepPlan", "step_plan", "ROLE_NAMES", "Stage", "stage_graph", "FORWARD_STAGES", "PARTIAL_POLL_S"]

ROLE_NAMES = ("actor", "critic", "rollout", "reference", "teacher")
"""The names of the worker roles a GRPO-family step may build (:attr:`StepPlan.roles`); each is a row of
``relayrl.workflows.roles.ROLES``, which builds them in this order."""


FORWARD_STAGES = {"reference": "reference", "teacher": "teacher", "old": "actor", "values": "critic"}
"""The forward-only stages of a step and the role each runs on."""

PARTIAL_POLL_S = 0.02
"""Partial rollout: the longest the driver's poll of a generating rollout rank waits. Weights the trainer
stages meanwhile go to the ranks after the poll returns, so this bounds how long they wait."""


@dataclass(frozen=True)
class Stage:
    """One stage of the step's dataflow: the pipeline runs it as a thread over the step's partition
    (:mod:`relayrl.workflows.produce`, :mod:`relayrl.workflows.consume`), the planner's simulator schedules it
    (:mod:`relayrl.planner.simulate`)."""

    name: str
    role: str
    """The worker role that runs it (``scorer``: the reward's scorer, on the driver or a pool of its own)."""
    pool: str
    """The pool it runs on (``driver``: threads of the driver process)."""
    reads: tuple[str, ...]
    """The stages whose output it needs for a prompt group before it can take that group."""
    per: Literal["chunk", "batch"]
    """``chunk``: one call per ready chunk of ``trainer.stream_groups`` groups; ``batch``: one call once every
    group is ready."""
    after_generation: bool
    """Its pool is the rollout's: it starts once generation has ended (the devices are time-shared)."""
    producing: bool
    """It fills the partition (with ``ahead`` > 0 it runs on the rollout thread, ahead of the trainer)."""


def stage_graph(*, roles: tuple[str, ...], pools: dict[str, str], reward_pool: str, update: str, sequential: bool,
                group_filter: bool, baseline: bool, recompute_old: bool, kl_in_reward: bool,
                group_relative: bool, token_stats: bool = False, reads_reference: bool = False) -> tuple[Stage, ...]:
    """The stages of a step in the order a sequential step runs them (each stage's ``reads`` come before it;
    in a ``sequential`` step each stage also reads the one before it). ``pools``: the pool of each role in
    ``roles`` (``rollout`` and ``actor`` always). ``token_stats``: the advantages read the pi_old pass (OTB's
    per-token statistics, online DPO's log-probs; that pass must be in the step, ``recompute_old``).
    ``reads_reference``: the advantages read the reference's log-probs (online DPO; as the KL in the reward)."""
    rollout = pools["rollout"]
    on_rollout = {r: pools[r] == rollout for r in roles}
    whole = "batch" if sequential else "chunk"
    out = [Stage("sample", "rollout", rollout, (), whole, False, True),
           Stage("score", "scorer", reward_pool, ("sample",), whole, False, True)]
    if baseline:
        out.append(Stage("baseline", "scorer", reward_pool, ("sample", "score"), "chunk", False, True))
    forward = [name for name, role in FORWARD_STAGES.items() if role in roles and (name != "old" or recompute_old)]
    for name in forward:
        role = FORWARD_STAGES[name]
        gated = on_rollout[role]
        out.append(Stage(name, role, pools[role], ("sample",) + (("score",) if group_filter else ()),
                         "batch" if gated else "chunk", gated, False))
    # group-relative advantages go per chunk unless every consumer waits for generation anyway
    waits = update == "batch" and all(on_rollout[r] for r in roles if r != "rollout")
    reads = ("score",) + (("reference",) if (kl_in_reward or reads_reference) and "reference" in roles else ()) \
        + (("values",) if "critic" in roles else ()) + (("baseline",) if baseline else ()) \
        + (("teacher",) if "teacher" in roles else ()) + (("old",) if token_stats and "old" in forward else ())
    out.append(Stage("advantages", "scorer", reward_pool, reads, "chunk" if group_relative and not waits else "batch",
                     False, False))
    reads = ("advantages",) + tuple(n for n in ("reference", "old", "values") if n in forward)
    out.append(Stage("update", "actor", pools["actor"], reads, "chunk" if update == "accumulate" else "batch",
                     on_rollout["actor"], False))
    if sequential:  # one after another on the driver's thread: each stage also waits for the one before
        out[1:] = [replace(st, reads=tuple(dict.fromkeys((prev.name, *st.reads)))) for prev, st in zip(out, out[1:])]
    return tuple(out)


@dataclass(frozen=True)
class StepPlan:
    """What one GRPO-family step does (module docstring)."""

    estimator: Estimator
    roles: tuple[str, ...]
    """The worker groups to build (a subset of :data:`ROLE_NAMES`): ``reference`` when the KL needs one outside
    the actor or the estimator reads one (online DPO), ``critic`` when the estimator reads values, ``teacher``
    for on-policy distillation."""
    pools: dict[str, str]
    """The pool of each role in :attr:`roles` (``main``: the actor's)."""
    ahead: int
    overlapped: bool
    """The trainer consumes prompt groups while later ones generate (periodic or off-policy)."""
    update: Literal["batch", "accumulate"]
    colocated: bool
    sequential: bool
    """Every stage waits for the one before (one pool for every role and the scorer, the whole batch at once,
    no refill rounds, whole groups scored): the stages run one after another on the driver's main thread,
    the rollout writing its groups once generation ends (HybridFlow's colocated hybrid engine)."""
    partial: bool
    """Off-policy: weights staged while a batch generates go into it between two decode steps."""
    group_filter: bool
    """DAPO's dynamic sampling: groups whose :attr:`group_metric` values are all equal are dropped and their
    prompts replaced."""
    baseline: bool
    """The estimator reads one greedy response per prompt, scored (ReMax)."""
    recompute_old: bool
    """pi_old is a separate forward pass of the trainer before the update (the batch is used more than once,
    ``algorithm.old_logprobs=recompute``, or the estimator reads that pass: OTB's ``token_stats``, online DPO's
    ``old_logprobs``); otherwise the update's own pass gives it, detached."""
    tri_model: bool
    """The actor computes the reference log-probs in its own layout (no reference group)."""
    group_metric: Literal["score", "reward"] = "score"
    """What dynamic sampling compares (``algorithm.dynamic_sampling_metric``): each row's ``score`` before
    shaping or its ``reward`` after (:meth:`keep_groups` is given the one it names)."""
    stages: tuple[Stage, ...] = ()
    """The step's dataflow (:func:`stage_graph`): what each stage reads, its pool, whether it streams per chunk
    or waits for the batch, whether it waits for generation to end."""
    notes: tuple[str, ...] = ()
    """What the run says at start-up about how the step departs from what its keys suggest."""

    def stage(self, name: str) -> Stage:
        """The stage called ``name`` (KeyError when the step has none)."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"the step has no stage {name!r} (it has {', '.join(s.name for s in self.stages)})")

    def keep_groups(self, scores, rewards, groups) -> list[bool]:
        """Per row: whether its prompt group is kept. With dynamic sampling (DAPO) a group whose
        :attr:`group_metric` values (``scores`` or ``rewards``) are all equal is dropped (no signal; with
        ``reward``, none left in the advantages either); otherwise every row is kept. ``scores``, ``rewards``,
        ``groups``: ``[N]``."""
        if not self.group_filter:
            return [True] * len(scores)
        from relayrl.algorithms.dapo import dynamic_sampling_filter

        return dynamic_sampling_filter(rewards if self.group_metric == "reward" else scores, groups)[0].tolist()

    @property
    def mode(self) -> str:
        """``sync``, ``periodic`` or ``off-policy k=<ahead>`` (for messages and the run's first line)."""
        if self.ahead:
            return f"off-policy k={self.ahead}" + (" (partial rollout)" if self.partial else "")
        return "periodic" if self.overlapped else "sync"

    def describe(self) -> str:
        """One line: the mode, the estimator, the roles and where they run, the update."""
        where = ", ".join(f"{r}@{self.pools[r]}" for r in self.roles)
        ds = "dynamic sampling" + (" on rewards" if self.group_metric == "reward" else "")
        extra = [n for n, on in ((ds, self.group_filter), ("greedy baseline", self.baseline),
                                 ("pi_old pass", self.recompute_old), ("tri-model", self.tri_model)) if on]
        return (f"step: {self.mode}, advantage={self.estimator.name}, update={self.update}, roles {where}"
                + (f"; {', '.join(extra)}" if extra else ""))


def rollout_pool(cfg: Config) -> tuple[str, dict[str, int]]:
    """The rollout's pool and the extra pools: off-policy rollouts run ahead on a pool of their own, so when
    the placement names none the plan adds ``rollout`` (one rollout rank: ``rollout.devices_per_rank``
    devices, 1 but with vLLM's tensor parallelism; ``rollout_ahead`` if that name is taken)."""
    pl = cfg.placement
    if not cfg.trainer.off_policy_steps or pl.split:
        return pl.rollout, dict(pl.pools)
    name = "rollout" if "rollout" not in pl.pools else "rollout_ahead"
    return name, {**pl.pools, name: cfg.rollout.devices_per_rank}


def step_plan(cfg: Config) -> StepPlan:
    """The plan of ``cfg``'s GRPO-family step (``cfg`` is a validated config of workflow grpo)."""
    a, t, pl = cfg.algorithm, cfg.trainer, cfg.placement
    est = estimator(a.advantage)
    roles = ["actor", "rollout"]
    if (a.kl_coef > 0 or est.reference) and not t.tri_model:  # (tri_model with est.reference: refused by the config)
        roles.append("reference")
    if est.values:
        roles.append("critic")
    if a.distill.enabled:
        roles.append("teacher")
    rollout, _ = rollout_pool(cfg)
    pools = {"actor": "main", "rollout": rollout, "reference": pl.reference, "critic": pl.critic,
             "teacher": pl.teacher}
    ahead = t.off_policy_steps
    overlapped = t.mode == "periodic" or ahead > 0
    why_batch = [why for why, on in (
        (f"the critic (advantage={est.name}) trains on the whole batch", est.values),
        (f"advantage={est.name} reads the whole batch", not est.group_relative and not est.values),
        (f"trainer.mini_batches={t.mini_batches} splits the batch", t.mini_batches > 1),
        (f"trainer.epochs={t.epochs} repeats the batch", t.epochs > 1)) if on]
    update = "accumulate" if overlapped and not why_batch else "batch"
    same_pool = all(pools[r] == rollout for r in roles) and pl.reward in ("driver", rollout)
    sequential = (ahead == 0 and update == "batch" and same_pool and not a.dynamic_sampling
                  and cfg.reward.stream == "group")
    notes = [f"algorithm.{k}={getattr(a, k)} is unused: it {what}; {fix} to use it"
             for k, _, what, fix in a.idle_options()]  # (not refused: AlgorithmConfig.idle_options)
    if a.tis_cap is not None:
        notes.append(f"algorithm.tis_cap={a.tis_cap} runs as algorithm.correction.level=token, mode=truncate, "
                     f"high={a.tis_cap} (the correction section also has sequence weights, masking and "
                     f"divergence masking; metrics correction/*)")
    if cfg.reward.decoupled and est.name != "grpo-batch-std":
        notes.append(f"reward.user_aggregation=normalize_then_sum (GDPO) with advantage={est.name}: the decoupled "
                     f"sum of the reward functions goes through {est.name}'s own scaling; TRL and the GDPO paper "
                     f"normalise it over the batch (algorithm.advantage=grpo-batch-std)")
    if a.routing_replay != "none":
        who, where = {"rollout": ("the rollout records each token's experts", "pi_old and update passes replay them"),
                      "measure": ("the rollout records each token's experts", "passes compare their own choice with "
                                  "them (actor/routing_agreement) and replay nothing"),
                      "old": ("the pi_old pass records its routers' choice", "update passes replay them")
                      }[a.routing_replay]
        notes.append(f"algorithm.routing_replay={a.routing_replay}: {who} (routed_experts in the dock: MoE layers "
                     f"x experts per token x 2 bytes a token) and the policy's {where}")
    ranks = cfg.cluster.devices * cfg.cluster.nodes
    group = cfg.engine.expert_group(ranks)
    if group > 1:
        groups = (f" ({ranks // group} groups of {group} ranks, each holding every expert; each shard's replicas sum "
                  f"their gradients once a step)" if group < ranks else "")
        notes.append(f"engine.expert_parallel: each of the trainer's {ranks} ranks holds 1/{group} of every MoE "
                     f"layer's experts{groups}, and tokens travel to them and back (two all-to-alls a layer); the "
                     f"other parameters are FSDP2 shards")
    if overlapped and why_batch:
        notes.append(f"the update waits for the whole batch ({'; '.join(why_batch)}); generation, scoring and the "
                     f"forward-only passes still overlap per prompt group")
    pools = {r: pools[r] for r in roles}
    reuses = t.epochs * t.mini_batches > 1 and (a.loss_uses_ratio or a.correction.enabled)
    recompute_old = a.old_logprobs == "recompute" or (a.old_logprobs == "auto" and reuses)
    if est.reads_old and not recompute_old:  # (old_logprobs=rollout with such an estimator: refused by the config)
        recompute_old = True
        what = "log-probs and sum of squared probabilities per token" if est.token_stats else "log-probs"
        notes.append(f"advantage={est.name} reads the trainer's {what} before the update: the pi_old pass runs "
                     f"(algorithm.old_logprobs=recompute), and the advantages wait for it")
    if est.own_loss is not None and t.mini_batches * t.epochs > 1:
        notes.append(f"advantage={est.name}'s advantages are {est.own_loss}'s gradient at the policy before the "
                     f"update: with trainer.mini_batches={t.mini_batches} and trainer.epochs={t.epochs} the later "
                     f"optimizer steps keep those coefficients, and each mini-batch's gradient is its rows' share "
                     f"scaled to the mini-batch (an estimate of the batch's {est.own_loss} gradient)")
    stages = stage_graph(roles=tuple(roles), pools=pools, reward_pool=pl.reward, update=update, sequential=sequential,
                         group_filter=a.dynamic_sampling, baseline=est.baseline, recompute_old=recompute_old,
                         kl_in_reward=a.kl_in_reward, group_relative=est.group_relative,
                         token_stats=est.reads_old, reads_reference=est.reference)
    return StepPlan(
        estimator=est, roles=tuple(roles), pools=pools, ahead=ahead, overlapped=overlapped, update=update,
        colocated=rollout == "main", sequential=sequential, partial=cfg.rollout.partial and ahead > 0,
        group_filter=a.dynamic_sampling, group_metric=a.dynamic_sampling_metric, baseline=est.baseline,
        recompute_old=recompute_old, tri_model=t.tri_model, stages=stages, notes=tuple(notes))
