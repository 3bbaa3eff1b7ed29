"""Configuration and error type of the reward engine.

The reward of one response is ``verifier(response, answer) + format_weight *
format(response)``: a rule verifier (seed 001's rule-based reward for math and
code-like tasks, as in DeepSeek-R1/DAPO) plus an optional format term.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.errors import UserError

__all__ = ["RewardConfig", "RewardError"]


class RewardError(UserError, ValueError):
    """A reward function broke its contract (wrong length, non-numeric or NaN values, bad inputs)."""


class RewardConfig(BaseModel):
    """How responses are scored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verifier: Literal["task", "math", "exact", "user"] = Field(
        "task",
        description="task: the built-in task's verify; math: math-verify equivalence of the boxed answer (or the "
        "last number); exact: string match after strip; user: the function named by user_fn",
    )
    user_fn: str | None = Field(None, description='"package.module:function" or "package.module.function"')
    format_weight: float = Field(0.0, description="weight of the format reward added to the verifier reward")
    format_regex: str | None = Field(None, description=r'regex searched in the format target, e.g. "^\d+$" or "\\boxed\{.+\}"')
    format_on: Literal["auto", "answer", "response"] = Field(
        "auto",
        description="what format_regex is searched in: 'answer' (first line, stripped), 'response' (the whole "
        "response); 'auto' is 'response' for the math verifier and 'answer' otherwise",
    )
    workers: int = Field(1, ge=1, description="threads for batched row-wise scoring")
    math_timeout_s: int = Field(
        5, ge=1, description="math-verify timeout per parse/compare (only enforceable on the main thread)"
    )
    math_max_chars: int = Field(
        2000, ge=1, description="longer extracted math answers score 0 and count as errors (bounds sympy time in threads)"
    )

    @model_validator(mode="after")
    def _check(self) -> "RewardConfig":
        if self.verifier == "user" and not self.user_fn:
            raise ValueError("reward.verifier='user' needs reward.user_fn='package.module:function'")
        if self.user_fn and self.verifier != "user":
            raise ValueError(
                f"reward.user_fn is set but reward.verifier={self.verifier!r}; set reward.verifier='user' "
                "or remove reward.user_fn"
            )
        if self.format_regex is not None:
            try:
                re.compile(self.format_regex)
            except re.error as e:
                raise ValueError(f"reward.format_regex {self.format_regex!r} is not a valid regex: {e}") from None
        if self.format_weight != 0.0 and self.format_regex is None:
            raise ValueError(
                f"reward.format_weight={self.format_weight} needs reward.format_regex (e.g. '^\\d+$'); "
                "or set reward.format_weight=0"
            )
        return self

    def resolved_format_on(self) -> Literal["answer", "response"]:
        """``format_on`` with ``auto`` resolved for this verifier."""
        if self.format_on != "auto":
            return self.format_on
        return "response" if self.verifier == "math" else "answer"
