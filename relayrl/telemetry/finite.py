"""NaN/Inf guard for losses and gradient norms.

`check_finite` raises `NonFiniteError` naming the step and the first bad
metric; `check_updates` checks the loss and gradient norm of every trained role
(:data:`UPDATE_METRICS`: the actor, PPO's critic, a reward model in training)
and names the role too. The workflow decides whether that stops the run (after
saving the last good checkpoint) or skips the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from relayrl.telemetry.tracker import as_number


UPDATE_METRICS: dict[str, tuple[str, ...]] = {
    "actor": ("actor/loss", "sft/loss", "dpo/loss", "actor/grad_norm"),
    "critic": ("critic/vf_loss", "critic/grad_norm"),
    "reward model": ("rm/loss", "rm/grad_norm"),
}
"""The loss and gradient-norm metrics of each trained role (by the role's name in messages): the policy of
every workflow (``actor/*``; SFT's and DPO's losses), PPO's critic (``critic/*``) and the reward model of
``workflow: rm`` (``rm/*``). An engine's metrics carry its role's prefix (``metric_prefix``)."""


class NonFiniteError(RuntimeError):
    """A metric was NaN or +-Inf at `step`. `bad` lists every offending (key, value); `roles` the trained roles
    whose update they belong to (empty when not checked by role)."""

    def __init__(self, step: int, key: str, value: float, bad: list[tuple[str, float]] | None = None,
                 roles: tuple[str, ...] = ()) -> None:
        self.step = step
        self.key = key
        self.value = value
        self.bad = bad if bad is not None else [(key, value)]
        self.roles = tuple(roles)
        others = ", ".join(f"{k}={v}" for k, v in self.bad if k != key)
        msg = f"step {step}: {key} is {value} (non-finite)" + (f" in {self.updates}" if roles else "")
        if others:
            msg += f"; also non-finite: {others}"
        super().__init__(msg)

    @property
    def updates(self) -> str:
        """The updates of `roles` in words: "the critic's update", "the critic's and the actor's updates"."""
        names = [f"the {r}'s" for r in self.roles]
        return f"{' and '.join(names)} update{'s' if len(names) > 1 else ''}"

    def __reduce__(self):  # keep the attributes when pickled across processes
        return (type(self), (self.step, self.key, self.value, self.bad, self.roles))


def check_finite(step: int, metrics: Mapping[str, object], keys: Iterable[str] | None = None) -> None:
    """Raise NonFiniteError if any checked metric is NaN or +-Inf.

    Args:
        step: the training step, quoted in the error.
        metrics: metric name -> number (floats, ints, NumPy scalars, 0-d tensors).
        keys: the metrics to check (e.g. ("actor/loss", "actor/grad_norm")); every
            one must be present. None checks all of `metrics`.
    """
    names = list(metrics) if keys is None else list(keys)
    missing = [k for k in names if k not in metrics]
    if missing:
        raise KeyError(f"check_finite at step {step}: metrics {missing} were not logged; present: {sorted(metrics)}")
    bad: list[tuple[str, float]] = []
    for key in names:
        value = float(as_number(key, metrics[key]))
        if not math.isfinite(value):
            bad.append((key, value))
    if bad:
        raise NonFiniteError(step, bad[0][0], bad[0][1], bad)


def check_updates(step: int, metrics: Mapping[str, object]) -> None:
    """Raise NonFiniteError naming the role(s) if a loss or gradient norm of :data:`UPDATE_METRICS` that is in
    `metrics` (this step's updates) is NaN or +-Inf."""
    keys = [k for names in UPDATE_METRICS.values() for k in names if k in metrics]
    try:
        check_finite(step, metrics, keys)
    except NonFiniteError as e:
        bad = {k for k, _ in e.bad}
        roles = tuple(r for r, names in UPDATE_METRICS.items() if bad.intersection(names))
        raise NonFiniteError(e.step, e.key, e.value, e.bad, roles) from None
