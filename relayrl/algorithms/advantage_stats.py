"""Statistics of a step's advantages: ``advantage/mean``, ``/std``, ``/max``, ``/min`` over the valid response
tokens (verl's ``critic/advantages/mean|max|min``) and ``advantage/zero_frac``, the fraction of responses whose
advantage is 0 on every valid token (for a group estimator, GRPO's and RLOO's, the responses of groups whose
rewards were all equal: groups that gave no signal).

A step computes its advantages group by group as the groups arrive, or once on the batch, so the figures are
kept as sums (:class:`AdvantageSums`) that add up over the calls and are turned into the metrics once the step
is done; the result is the same however the rows were cut. The std is the unbiased one (``torch.std``'s, as for
``reward/std``), from float64 sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["AdvantageSums", "advantage_stats"]


@dataclass(frozen=True)
class AdvantageSums:
    """Sums over some responses' valid tokens that :meth:`metrics` turns into the ``advantage/*`` figures;
    ``a + b`` is the sums of both sets of responses."""

    tokens: int = 0
    """Valid response tokens (a ``loss_mask``'s 1 tokens; all of them without one)."""
    total: float = 0.0
    """Sum of their advantages."""
    total_sq: float = 0.0
    """Sum of their squares."""
    max: float = -math.inf
    min: float = math.inf
    responses: int = 0
    """Responses with at least one valid token."""
    zero_responses: int = 0
    """Of those, the ones whose advantage is 0 on every valid token."""

    @classmethod
    def of(cls, advantages: Sequence[torch.Tensor], masks: Sequence[torch.Tensor] | None = None) -> "AdvantageSums":
        """The sums of ``advantages`` (one ``[L_i]`` row per response) over the tokens ``masks`` (one ``[L_i]``
        row of 0/1 each; None: every token) keeps."""
        rows = [a.double() if masks is None else a.double()[m.bool()] for a, m in
                zip(advantages, masks if masks is not None else advantages)]
        rows = [r for r in rows if r.numel()]
        if not rows:
            return cls()
        flat = torch.cat(rows)
        return cls(tokens=int(flat.numel()), total=float(flat.sum()), total_sq=float((flat * flat).sum()),
                   max=float(flat.max()), min=float(flat.min()), responses=len(rows),
                   zero_responses=sum(bool((r == 0).all()) for r in rows))

    def __add__(self, other: "AdvantageSums") -> "AdvantageSums":
        return AdvantageSums(self.tokens + other.tokens, self.total + other.total, self.total_sq + other.total_sq,
                             max(self.max, other.max), min(self.min, other.min), self.responses + other.responses,
                             self.zero_responses + other.zero_responses)

    def metrics(self) -> dict[str, float]:
        """``advantage/mean``, ``/std``, ``/max``, ``/min`` over the tokens and ``advantage/zero_frac`` over the
        responses; ``{}`` without a token."""
        n = self.tokens
        if n == 0:
            return {}
        mean = self.total / n
        var = max(self.total_sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
        return {"advantage/mean": mean, "advantage/std": math.sqrt(var), "advantage/max": self.max,
                "advantage/min": self.min, "advantage/zero_frac": self.zero_responses / self.responses}


def advantage_stats(advantages: Sequence[torch.Tensor],
                    masks: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
    """The ``advantage/*`` metrics of ``advantages`` (``[L_i]`` per response) over the tokens ``masks`` keeps."""
    return AdvantageSums.of(advantages, masks).metrics()
