"""The plan of a GRPO-family step: the one reader of the algorithm, step-mode and placement keys.

Every GRPO-family run (GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++, ReMax, PPO with a critic, episodes) is one
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

from dataclasses import dataclass
from typing import Any, Literal

from relayrl.algorithms.estimators import Estimator, estimator

Config = Any  # relayrl.config.schema.Config (which asks this module; not imported back, no cycle)

__all__ = ["StepPlan", "step_plan", "ROLES"]

ROLES = ("actor", "rollout", "reference", "critic", "teacher")
"""The worker roles of a GRPO-family step, in the order they are built."""


@dataclass(frozen=True)
class StepPlan:
    """What one GRPO-family step does (module docstring)."""

    estimator: Estimator
    roles: tuple[str, ...]
    """The worker groups to build (a subset of :data:`ROLES`): ``reference`` when the KL needs one outside
    the actor, ``critic`` when the estimator reads values, ``teacher`` for on-policy distillation."""
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
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and their prompts replaced."""
    baseline: bool
    """The estimator reads one greedy response per prompt, scored (ReMax)."""
    recompute_old: bool
    """pi_old is a separate forward pass of the trainer before the update (the batch is used more than once,
    or ``algorithm.old_logprobs=recompute``); otherwise the update's own pass gives it, detached."""
    tri_model: bool
    """The actor computes the reference log-probs in its own layout (no reference group)."""
    notes: tuple[str, ...] = ()
    """What the run says at start-up about how the step departs from what its keys suggest."""

    def keep_groups(self, scores, groups) -> list[bool]:
        """Per row: whether its prompt group is kept. With dynamic sampling (DAPO) a group whose scores are all
        equal carries no signal and is dropped; otherwise every row is kept. ``scores``, ``groups``: ``[N]``."""
        if not self.group_filter:
            return [True] * len(scores)
        from relayrl.algorithms.dapo import dynamic_sampling_filter

        return dynamic_sampling_filter(scores, groups)[0].tolist()

    @property
    def mode(self) -> str:
        """``sync``, ``periodic`` or ``off-policy k=<ahead>`` (for messages and the run's first line)."""
        if self.ahead:
            return f"off-policy k={self.ahead}" + (" (partial rollout)" if self.partial else "")
        return "periodic" if self.overlapped else "sync"

    def describe(self) -> str:
        """One line: the mode, the estimator, the roles and where they run, the update."""
        where = ", ".join(f"{r}@{self.pools[r]}" for r in self.roles)
        extra = [n for n, on in (("dynamic sampling", self.group_filter), ("greedy baseline", self.baseline),
                                 ("pi_old pass", self.recompute_old), ("tri-model", self.tri_model)) if on]
        return (f"step: {self.mode}, advantage={self.estimator.name}, update={self.update}, roles {where}"
                + (f"; {', '.join(extra)}" if extra else ""))


def rollout_pool(cfg: Config) -> tuple[str, dict[str, int]]:
    """The rollout's pool and the extra pools: off-policy rollouts run ahead on a pool of their own, so when
    the placement names none the plan adds ``rollout`` (1 device; ``rollout_ahead`` if that name is taken)."""
    pl = cfg.placement
    if not cfg.trainer.off_policy_steps or pl.split:
        return pl.rollout, dict(pl.pools)
    name = "rollout" if "rollout" not in pl.pools else "rollout_ahead"
    return name, {**pl.pools, name: 1}


def step_plan(cfg: Config) -> StepPlan:
    """The plan of ``cfg``'s GRPO-family step (``cfg`` is a validated config of workflow grpo)."""
    a, t, pl = cfg.algorithm, cfg.trainer, cfg.placement
    est = estimator(a.advantage)
    roles = ["actor", "rollout"]
    if a.kl_coef > 0 and not t.tri_model:
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
        (f"advantage={est.name} whitens over the whole batch", not est.group_relative and not est.values),
        (f"trainer.mini_batches={t.mini_batches} splits the batch", t.mini_batches > 1),
        (f"trainer.epochs={t.epochs} repeats the batch", t.epochs > 1)) if on]
    update = "accumulate" if overlapped and not why_batch else "batch"
    same_pool = all(pools[r] == rollout for r in roles) and pl.reward in ("driver", rollout)
    sequential = (ahead == 0 and update == "batch" and same_pool and not a.dynamic_sampling
                  and cfg.reward.stream == "group")
    notes = []
    if a.tis_cap is not None:
        notes.append(f"algorithm.tis_cap={a.tis_cap} runs as algorithm.correction.level=token, mode=truncate, "
                     f"high={a.tis_cap} (the correction section also has sequence weights, masking and "
                     f"divergence masking; metrics correction/*)")
    if overlapped and why_batch:
        notes.append(f"the update waits for the whole batch ({'; '.join(why_batch)}); generation, scoring and the "
                     f"forward-only passes still overlap per prompt group")
    return StepPlan(
        estimator=est, roles=tuple(roles), pools={r: pools[r] for r in roles}, ahead=ahead, overlapped=overlapped, update=update,
        colocated=rollout == "main", sequential=sequential, partial=cfg.rollout.partial and ahead > 0,
        group_filter=a.dynamic_sampling, baseline=est.baseline,
        recompute_old=a.old_logprobs == "recompute" or (a.old_logprobs == "auto" and t.epochs * t.mini_batches > 1),
        tri_model=t.tri_model, notes=tuple(notes))
