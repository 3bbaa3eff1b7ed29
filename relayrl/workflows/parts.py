"""What the stages of a GRPO-family step work with (:class:`StepParts`), and the memory phases of its roles
(:class:`Phases`). The pipeline builds both; the stages never see the pipeline."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from relayrl.cluster import WorkerGroup
from relayrl.config.plan import StepPlan
from relayrl.config.schema import Config
from relayrl.dock import Dock
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.interrupt import Interrupt
from relayrl.environments.config import EpisodeSpec
from relayrl.workflows.episodes import episode_spec
from relayrl.workflows.losses import PolicyLoss, ValueLoss
from relayrl.workflows.worker_base import MemoryProbe

__all__ = ["StepParts", "Phases", "build_parts"]


class Phases:
    """Timed stages of a step whose peak memory is logged (``memory/<name>_peak_gb``), and
    ``trainer.offload``: the idle roles' state moved to host between their phases on a shared device."""

    def __init__(self, session, offload: bool, actor: WorkerGroup, shared: bool) -> None:
        self.s, self.offload, self.actor, self.shared = session, offload, actor, shared
        self.metrics: dict[str, float] = {}
        """``memory/<phase>_peak_gb`` and ``timing/offload_s`` of the current step (the pipeline resets it)."""

    @contextlib.contextmanager
    def phase(self, name: str, group: WorkerGroup, step: int):
        """A timeline span of ``group`` whose peak memory is the largest over its ranks and the stage's
        repeats within the step."""
        group.all(MemoryProbe.memory_reset)  # (every role's worker class has the probe)
        with self.s.span(name, group.name, step):
            yield
        key = f"memory/{name}_peak_gb"
        self.metrics[key] = max(self.metrics.get(key, 0.0), max(group.all(MemoryProbe.memory_peak_gb)))

    def idle(self, *groups: WorkerGroup | None) -> None:
        """``trainer.offload``: these roles' idle state to host (the actor keeps its weights on the device
        when the rollout runs on them)."""
        if self.offload:
            for g in groups:
                if g is not None:
                    kw = {"weights": not self.shared} if g is self.actor else {}
                    # by name: each role's class has an offload of its own (no common base defines it)
                    self._seconds(g.all("offload", **kw))

    def wake(self, *groups: WorkerGroup | None, **kwargs: Any) -> None:
        """Undo :meth:`idle` (``kwargs`` go to the roles' ``reload``)."""
        if self.offload:
            for g in groups:
                if g is not None:
                    self._seconds(g.all("reload", **kwargs))  # by name, as offload above

    def _seconds(self, seconds: list[float]) -> None:
        self.metrics["timing/offload_s"] = self.metrics.get("timing/offload_s", 0.0) + max(seconds)


@dataclass
class StepParts:
    """The worker groups, the dock and the settings a step's stages use."""

    cfg: Config
    plan: StepPlan
    session: Any
    """:class:`relayrl.workflows.session.Session`: prompts, tokenizer, spans, the run's log."""
    dock: Dock
    actor: WorkerGroup
    rollout: WorkerGroup
    reference: WorkerGroup | None
    critic: WorkerGroup | None
    teacher: WorkerGroup | None
    """On-policy distillation's frozen teacher (``algorithm.distill.teacher``): log-probs only."""
    score: Callable[..., Any]
    """``score(ScoreWorker.method, *args)``: a :class:`~relayrl.workflows.scoring.ScoreWorker` call (driver
    threads or its pool); the method by reference (its name is accepted too)."""
    sampling: SamplingParams
    greedy: SamplingParams
    """ReMax's baseline: one greedy response per prompt."""
    loss: PolicyLoss
    value_loss: ValueLoss | None
    temperature: float
    """The trainer's log-prob passes divide logits by the rollout's temperature (1 for greedy)."""
    episodes: EpisodeSpec | None
    phases: Phases
    interrupt: Interrupt | None = None
    """``rollout.interrupt``: the rollout's thinking budget (its phrase tokenized), or None."""
    score_calls: int = 8
    """Reward calls in flight at once on the driver's threads (``reward.stream=group``)."""
    sample_calls: int = 32
    """The same with ``reward.stream=sample`` (calls of a row or a few each)."""
    between_polls: Callable[[], None] | None = None
    """Called between two polls of the rollout ranks (off-policy partial rollout hands over new weights)."""

    @property
    def masked(self) -> bool:
        """The rows carry a ``loss_mask`` (tokens written for the model: episodes' observations, an
        interrupted response's phrase) that the advantages, the losses and the critic read."""
        return self.episodes is not None or self.interrupt is not None


def build_parts(cfg: Config, plan: StepPlan, session, dock: Dock, groups: dict[str, WorkerGroup],
                score: Callable[..., Any], phases: Phases, between_polls: Callable[[], None]) -> StepParts:
    """The step's parts from the config: the losses, the sampling settings, the episode spec (its
    environment's contract checked now, before any worker generates)."""
    ro, a = cfg.rollout, cfg.algorithm
    critic = groups.get("critic")
    return StepParts(
        cfg=cfg, plan=plan, session=session, dock=dock, actor=groups["actor"], rollout=groups["rollout"],
        reference=groups.get("reference"), critic=critic, teacher=groups.get("teacher"), score=score,
        loss=PolicyLoss(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, agg=a.loss_agg,
                        level=a.ratio_level, kl_coef=0.0 if a.kl_in_reward else a.kl_coef, kl_kind=a.kl_kind,
                        entropy_coef=a.entropy_coef, agg_constant=float(ro.max_new_tokens), kind=a.policy_loss,
                        correction=a.rollout_correction(), options=a.loss_options(),
                        top_entropy=a.top_entropy_quantile, kl_ratio_weighted=a.kl_bias_correction,
                        old_key="gen_logprobs" if a.old_logprobs == "rollout" else "old_logprobs"),
        value_loss=ValueLoss(clip=cfg.critic.value_clip) if critic is not None else None,
        sampling=ro.sampling(),
        greedy=SamplingParams(n=1, temperature=0.0, max_new_tokens=ro.max_new_tokens,
                              stop_strings=tuple(ro.stop_strings)),
        # the rollout records log-probs under softmax(logits / T); every trainer pass that meets them divides
        # its logits by the same T (greedy: T=1), as verl and NeMo-RL do
        temperature=ro.temperature if ro.temperature > 0 else 1.0,
        episodes=episode_spec(cfg, session.tokenizer), phases=phases, between_polls=between_polls,
        interrupt=session.interrupt)
