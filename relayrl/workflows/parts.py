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
from relayrl.environments.config import EpisodeSpec
from relayrl.workflows.losses import PolicyLoss, ValueLoss

__all__ = ["StepParts", "Phases"]


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
        group.all("memory_reset")
        with self.s.span(name, group.name, step):
            yield
        key = f"memory/{name}_peak_gb"
        self.metrics[key] = max(self.metrics.get(key, 0.0), max(group.all("memory_peak_gb")))

    def idle(self, *groups: WorkerGroup | None) -> None:
        """``trainer.offload``: these roles' idle state to host (the actor keeps its weights on the device
        when the rollout runs on them)."""
        if self.offload:
            for g in groups:
                if g is not None:
                    kw = {"weights": not self.shared} if g is self.actor else {}
                    self._seconds(g.all("offload", **kw))

    def wake(self, *groups: WorkerGroup | None, **kwargs: Any) -> None:
        """Undo :meth:`idle` (``kwargs`` go to the roles' ``reload``)."""
        if self.offload:
            for g in groups:
                if g is not None:
                    self._seconds(g.all("reload", **kwargs))

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
    score: Callable[..., Any]
    """``score(method, *args)``: a :class:`~relayrl.workflows.scoring.ScoreWorker` call (driver threads or
    its pool)."""
    sampling: SamplingParams
    greedy: SamplingParams
    """ReMax's baseline: one greedy response per prompt."""
    loss: PolicyLoss
    value_loss: ValueLoss | None
    temperature: float
    """The trainer's log-prob passes divide logits by the rollout's temperature (1 for greedy)."""
    episodes: EpisodeSpec | None
    phases: Phases
    score_calls: int = 8
    """Reward calls in flight at once on the driver's threads (``reward.stream=group``)."""
    sample_calls: int = 32
    """The same with ``reward.stream=sample`` (calls of a row or a few each)."""
    between_polls: Callable[[], None] | None = None
    """Called between two polls of the rollout ranks (off-policy partial rollout hands over new weights)."""

    def same_pool_as_rollout(self, group: WorkerGroup) -> bool:
        """A group sharing the rollout's pool time-shares its devices: its stages wait for generation."""
        return group.pool is self.rollout.pool
