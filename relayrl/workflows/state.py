"""The state one GRPO-family step gathers while its stages run (:class:`StepState`).

Lock discipline: every field below ``cond`` is read and written only while holding ``cond`` (a
``threading.Condition``), by any stage thread; a stage that waits for another (the sample stage waiting for
a round's groups to be judged) waits on ``cond``, and every write that could end such a wait notifies it.
The fields above it are set before the stages start and not changed while they run. Samples themselves are
in the dock; the state holds scalars and metadata only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from relayrl.algorithms.advantage_stats import AdvantageSums
from relayrl.workflows.rollout_stream import GroupRecord

__all__ = ["StepState"]


@dataclass
class StepState:
    problems: list
    """The step's prompt problems; a group's id is its index here (dynamic sampling appends replacements)."""
    positions: list[int | None]
    """Each problem's position in the training rows (``PromptSource.problems``; None: a built-in task's), the row
    ``data.retire_solved`` retires; appended with ``problems``."""
    kl_coef: float = 0.0
    """The KL coefficient the consuming stages use (the KL controller's value when they start)."""
    entropy_coef: float | None = None
    """The entropy bonus's coefficient the update uses (the entropy controller's value when it starts; None:
    ``algorithm.entropy_coef``)."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    records: list[GroupRecord] = field(default_factory=list)
    """What the rollout wrote, group by group (metadata of every generated group, dropped ones too)."""
    rows: dict[int, list[int]] = field(default_factory=dict)
    """group -> its rows in the partition."""
    scores: list[float] = field(default_factory=list)
    """Verifier scores of the kept groups' rows, in the order they were judged."""
    rewards: list[float] = field(default_factory=list)
    """Shaped rewards of the same rows."""
    reward_metrics: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Per reward call: ``(value, rows scored)`` of each metric the reward engine returned (a row-weighted mean
    over the rows a source did not fail on; the counts in ``step_metrics.COUNTS`` are summed)."""
    baselines: list[float] = field(default_factory=list)
    """ReMax: each kept group's greedy reward."""
    update: dict[str, float] = field(default_factory=dict)
    """The update's metrics (actor, critic), and its skip records."""
    kl: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Per advantage call: ``(value, rows)`` of each metric it returned (KL in the reward, distillation): a
    row-weighted mean over the calls (the largest value for ``.._max`` names)."""
    advantages: AdvantageSums = AdvantageSums()
    """The advantages' sums over the valid tokens of the rows computed so far, every call's added (the step's
    ``advantage/*``)."""
    samples: list[dict] = field(default_factory=list)
    """Up to ``telemetry.samples_per_step`` of the step's scored responses, as ``RUN_DIR/samples.jsonl`` holds
    them."""
    rounds: int = 0
    """Generation rounds (dynamic sampling: refills)."""
    judged: int = 0
    """Groups whose rewards were judged (kept or dropped)."""
    kept: int = 0
    pass_rates: dict[int, float] = field(default_factory=dict)
    """Each judged group's pass rate (share of its verifier scores >= 1.0, before shaping; kept and dropped
    groups alike): :func:`relayrl.algorithms.retire.pass_rates`."""
    dropped: set[int] = field(default_factory=set)
    """Groups dynamic sampling dropped (all rewards equal), and groups a failure dropped (``*.on_error=drop_group``)."""
    filtered_rewards: dict[int, float] = field(default_factory=dict)
    """The groups dynamic sampling dropped for equal rewards (not for a failure): each one's mean reward."""
    rollout_errors: int = 0
    """Groups whose generation request failed (``rollout.on_error=drop_group``)."""
    hold: Any = None
    """Off-policy: the rollout engine's hold for this batch, given back when its generation ends."""

    def kept_records(self) -> list[GroupRecord]:
        """Records of the groups the step trains on."""
        with self.cond:
            return [r for r in self.records if r.group not in self.dropped]
