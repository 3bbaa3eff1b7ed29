"""Example user reward functions, loadable by dotted path.

Use one with ``reward.verifier=user reward.user_fn=relayrl.engines.reward.examples:length_penalized_exact``.
They double as templates: a user function takes the whole batch and returns
one float per response.
"""

from __future__ import annotations

__all__ = ["length_penalized_exact", "contains_answer", "LengthPenalizedExact"]


class LengthPenalizedExact:
    """Exact match on the first line, minus ``penalty`` per character beyond ``free_chars`` (floored at 0).

    An instance is a valid user function; a module-level instance with
    non-default settings can be named by dotted path like a function.
    """

    def __init__(self, free_chars: int = 16, penalty: float = 0.01) -> None:
        if free_chars < 0 or penalty < 0:
            raise ValueError(f"free_chars and penalty must be >= 0, got {free_chars}, {penalty}")
        self.free_chars = free_chars
        self.penalty = penalty

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
        out = []
        for response, answer in zip(responses, answers):
            first = response.split("\n", 1)[0].strip()
            hit = 1.0 if answer is not None and first == answer.strip() else 0.0
            excess = max(0, len(response) - self.free_chars)
            out.append(max(0.0, hit - self.penalty * excess))
        return out


length_penalized_exact = LengthPenalizedExact()
"""Exact match minus 0.01 per character beyond 16."""


def contains_answer(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
    """1.0 when the ground truth appears anywhere in the response (a lenient verifier for free-form text)."""
    return [1.0 if a is not None and a.strip() and a.strip() in r else 0.0 for r, a in zip(responses, answers)]
