"""Configuration and error type of the reward engine.

The reward of one response is::

    verifier_weight * verifier(response, answer) + format_weight * format(response)
      + model_weight * reward_model(prompt, response) + judge.weight * judge(prompt, response, answer)

a rule verifier (DAPO's rule-based reward for math and code-like tasks, as
in DeepSeek-R1/DAPO), an optional format term, an optional learned reward
model (``model``, trained by ``workflow: rm``) and an optional LLM judge
(``judge.path``); then optionally whitened by running moments (``normalize``)
and clipped (``clip``). The verifier is computed and logged even at
``verifier_weight=0``, so a learned reward's hacking shows beside it.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relayrl.config.paths import LocalPath
from relayrl.engines.reward.judge import JudgeConfig
from relayrl.errors import UserError
from relayrl.plugins import absolute_file

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
    user_fn: str | list[str] | None = Field(
        None, description='"package.module:function", "package.module.function" or "path/to/file.py:function" '
        '(made absolute when the config loads) of fn(prompts, responses, answers, **fields) -> list[float] (the '
        'rows\' dataset fields by keyword), of a reward function written for TRL\'s GRPOTrainer '
        '(fn(completions, **columns)) or of a compute_score written for verl (fn(data_source, solution_str, '
        'ground_truth, extra_info)); a list: the verifier is their weighted sum (user_weights), each logged as '
        'reward/fn/NAME_mean')
    user_weights: list[float] | None = Field(
        None, description="weight of each function of a user_fn list (TRL's reward_weights); null: 1 each")
    user_aggregation: Literal["sum", "normalize_then_sum"] = Field(
        "sum", description="how the advantages combine the functions of a user_fn list (TRL's "
        "multi_objective_aggregation): sum: of their weighted sum (TRL's sum_then_normalize); "
        "normalize_then_sum (GDPO): of the weighted sum of each function's score normalised within its prompt "
        "group, (s - group mean) / (group std + 1e-4), a function's None rows left out; with "
        "algorithm.advantage=grpo-batch-std that sum is normalised over the batch, as in TRL. The reward "
        "(reward/mean) stays the weighted sum of the scores")
    on_error: Literal["fail", "drop_group"] = Field(
        "fail", description="a reward function (user_fn), reward model (model) or LLM judge (judge.path) that "
        "raises, returns garbage (NaN, wrong length, non-numbers) or runs past timeout_s for a batch: its prompt "
        "groups are scored one by one; fail stops the step naming the prompt and the cause, drop_group drops the "
        "groups that fail from the step (counted in reward/errors)")
    timeout_s: float | None = Field(
        None, gt=0, description="reward.verifier=user: seconds a call of the reward function may take per prompt "
        "group it scores (a call of g groups: g x timeout_s); a call past it is a failure under on_error. The "
        "call is abandoned, not interrupted (Python cannot stop a thread): its thread runs on until the function "
        "returns; null: no limit")
    format_weight: float = Field(0.0, description="weight of the format reward added to the verifier reward")
    format_regex: str | None = Field(None, description=r'regex searched in the format target, e.g. "^\d+$" or "\\boxed\{.+\}"')
    format_on: Literal["auto", "answer", "response"] = Field(
        "auto",
        description="what format_regex is searched in: 'answer' (first line, stripped), 'response' (the whole "
        "response); 'auto' is 'response' for the math verifier and 'answer' otherwise",
    )
    verifier_weight: float = Field(1.0, description="weight of the verifier in the reward; 0: logged only "
                                   "(reward/verifier_mean), e.g. with a learned reward")
    model: LocalPath | None = Field(None, description="directory of a reward model (what workflow rm saves) "
                                    "scoring each (prompt, response); null: none")
    model_weight: float = Field(1.0, description="weight of the reward model's score in the reward")
    model_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="device of the reward model and judge; auto: the run's model device (a reward worker on "
        "its own pool, placement.reward=<pool>, takes that pool's device)")
    model_batch: int = Field(64, ge=1, description="rows per reward-model forward pass")
    judge: JudgeConfig = JudgeConfig()
    normalize: Literal["none", "running"] = Field(
        "none", description="running: whiten a step's rewards by the mean and std of every reward of the earlier "
        "steps (frozen at the step's start; the step's rewards join them at its end; the first step unwhitened)")
    clip: float | None = Field(None, gt=0.0, description="clip the (normalised) reward to [-clip, clip]; null: no clip")
    workers: int = Field(1, ge=1, description="threads for batched row-wise scoring")
    stream: Literal["group", "sample"] = Field(
        "group", description="streaming dataflow (a role on its own pool, trainer.mode=periodic, off-policy): "
        "'group' scores each finished prompt group in one call (rewards that batch: a reward model, a judge); "
        "'sample' writes each response into the dock the moment it ends and scores it at once (Periodic Asynchrony), so a "
        "group's rewards wait only for the call of its last response (verifiers with latency: code runs, "
        "judge calls)")
    math_timeout_s: int = Field(
        5, ge=1, description="math-verify timeout per parse/compare (only enforceable on the main thread)"
    )
    math_max_chars: int = Field(
        2000, ge=1, description="longer extracted math answers score 0 and count as errors (bounds sympy time in threads)"
    )

    @field_validator("user_fn")
    @classmethod
    def _user_file(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if not v:
                raise ValueError("reward.user_fn=[] names no function; give one or more, or set reward.user_fn=null")
            if len(set(v)) < len(v):
                raise ValueError(f"reward.user_fn names a function twice ({v}); weigh it with reward.user_weights")
            return [absolute_file(x, f"reward.user_fn[{i}]") for i, x in enumerate(v)]
        return None if v is None else absolute_file(v, "reward.user_fn")

    @property
    def user_fns(self) -> list[str]:
        """The user functions, a list whatever ``user_fn``'s form."""
        return [] if self.user_fn is None else [self.user_fn] if isinstance(self.user_fn, str) else list(self.user_fn)

    @property
    def fn_weights(self) -> list[float]:
        """Each user function's weight, in ``user_fns``' order: ``user_weights``, or 1 each."""
        return [1.0] * len(self.user_fns) if self.user_weights is None else [float(w) for w in self.user_weights]

    @property
    def decoupled(self) -> bool:
        """The advantages read each user function's group-normalised score (``user_aggregation=normalize_then_sum``,
        GDPO), not the reward."""
        return self.user_aggregation == "normalize_then_sum"

    @model_validator(mode="after")
    def _check(self) -> "RewardConfig":
        if self.verifier == "user" and not self.user_fn:
            raise ValueError("reward.verifier='user' needs reward.user_fn='package.module:function'")
        if self.on_error != "fail" and self.verifier != "user" and self.model is None and self.judge.path is None:
            raise ValueError(f"reward.on_error={self.on_error} applies to a reward function (reward.verifier=user), "
                             f"a reward model (reward.model) or an LLM judge (reward.judge.path); the built-in "
                             f"verifiers score a row they raise on 0 (counted in reward/errors): drop reward.on_error")
        if self.timeout_s is not None and self.verifier != "user":
            raise ValueError(f"reward.timeout_s limits a reward function (reward.verifier=user); verifier "
                             f"{self.verifier!r} has its own limits (reward.math_timeout_s): drop reward.timeout_s")
        if self.user_weights is not None:
            if len(self.user_weights) != len(self.user_fns):
                raise ValueError(f"reward.user_weights has {len(self.user_weights)} weight(s) for "
                                 f"{len(self.user_fns)} function(s) in reward.user_fn; give one per function")
            bad = [w for w in self.user_weights if not math.isfinite(w)]
            if bad:
                raise ValueError(f"reward.user_weights holds {bad[0]}; weights are finite numbers")
        if self.decoupled:
            self._check_decoupled()
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
        if (self.verifier_weight == 0 and self.model is None and self.judge.path is None
                and self.format_weight == 0):
            raise ValueError("reward.verifier_weight=0 leaves no reward: set reward.model (a reward model), "
                             "reward.judge.path (an LLM judge) or reward.format_weight, or raise reward.verifier_weight")
        if self.format_weight != 0.0 and self.format_regex is None:
            raise ValueError(
                f"reward.format_weight={self.format_weight} needs reward.format_regex (e.g. '^\\d+$'); "
                "or set reward.format_weight=0"
            )
        return self

    def _check_decoupled(self) -> None:
        """``user_aggregation=normalize_then_sum``: the advantages read each user function's scores and nothing
        else, so a term added to the reward outside those functions would be ignored: refused."""
        key = f"reward.user_aggregation={self.user_aggregation}"
        if len(self.user_fns) < 2:
            raise ValueError(f"{key} normalises each of several reward functions (a reward.user_fn list, with "
                             f"reward.verifier=user) on its own, but reward.user_fn names {len(self.user_fns)} "
                             f"(one alone is the plain group normalisation): list two or more in reward.user_fn, "
                             f"or drop reward.user_aggregation")
        others = [k for k, on in (("reward.format_weight", self.format_weight != 0),
                                  ("reward.model", self.model is not None),
                                  ("reward.judge.path", self.judge.path is not None),
                                  ("reward.normalize", self.normalize != "none"),
                                  ("reward.clip", self.clip is not None),
                                  ("reward.verifier_weight", self.verifier_weight != 1.0)) if on]
        if others:
            raise ValueError(f"{key} computes the advantages from each reward function's scores alone, so "
                             f"{', '.join(others)} would change the logged reward and not the training: unset "
                             f"{'it' if len(others) == 1 else 'them'} (a format check or a rescaled function can be "
                             f"one more function of reward.user_fn, weighted in reward.user_weights), or use "
                             f"reward.user_aggregation=sum")

    def check_paths(self) -> None:
        """The model directories exist (checked when a run starts, not when a recipe is read: a recipe may
        name a reward model that an earlier run will write)."""
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise RewardError(f"reward.model={self.model!r} is not a model directory (no config.json); give the "
                              f"directory a 'workflow: rm' run saved (its run.dir/model) or set reward.model=null")
        if self.judge.path is not None and not (Path(self.judge.path) / "config.json").is_file():
            raise RewardError(f"reward.judge.path={self.judge.path!r} is not a model directory (no config.json); "
                              f"give a local causal LM or set reward.judge.path=null")

    def resolved_format_on(self) -> Literal["answer", "response"]:
        """``format_on`` with ``auto`` resolved for this verifier."""
        if self.format_on != "auto":
            return self.format_on
        return "response" if self.verifier == "math" else "answer"
