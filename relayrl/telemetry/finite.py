"""NaN/Inf guard for losses and gradient norms.

`check_finite` raises `NonFiniteError` naming the step and the first bad
metric; the workflow decides whether that stops the run (after saving the last
good checkpoint) or skips the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from relayrl.telemetry.tracker import as_number


class NonFiniteError(RuntimeError):
    """A metric was NaN or +-Inf at `step`. `bad` lists every offending (key, value)."""

    def __init__(self, step: int, key: str, value: float, bad: list[tuple[str, float]] | None = None) -> None:
        self.step = step
        self.key = key
        self.value = value
        self.bad = bad if bad is not None else [(key, value)]
        others = ", ".join(f"{k}={v}" for k, v in self.bad if k != key)
        msg = f"step {step}: {key} is {value} (non-finite)"
        if others:
            msg += f"; also non-finite: {others}"
        super().__init__(msg)

    def __reduce__(self):  # keep the attributes when pickled across processes
        return (type(self), (self.step, self.key, self.value, self.bad))


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
