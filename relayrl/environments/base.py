"""The environment interface of multi-turn episodes: typed records and two small protocols.

NeMo RL (its NeMo Gym environments) gives an environment a batched ``step(message_logs, metadata) -> (observations,
metadata, next_stop_strings, rewards, terminateds)`` run as a Ray actor. relayrl keeps one environment
object per episode with a two-method protocol instead, because the episode loop
(:mod:`relayrl.environments.episodes`) already runs environment steps concurrently in worker threads, one
episode at a time, as each turn finishes (continuous batching across turns); a batched interface would
wait for the slowest turn of a batch.

An episode::

    context <- the problem's prompt tokens + tokens(env.reset(problem))   (the reset text: context, loss_mask 0)
    repeat:
        turn   <- the model generates from the context        (trained: its tokens carry loss_mask 1)
        result <- env.step(turn text)                        (observation, reward, done)
        context += turn + tokens(result.observation)          (the observation is context: loss_mask 0)
                                                              (tokens(): as plain text, relayrl.data.plain_text)
    until result.done or a limit (turns, tokens, wall time) or an error

The episode's reward is the sum of its step rewards; an episode that ends with an error gets 0.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import math
import numbers
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from relayrl.data.tasks import Problem

if TYPE_CHECKING:  # torch: only an episode's training record needs it; the toolsum task (data.task) and the
    # env config are read while a recipe is validated, before torch is imported
    from relayrl.engines.generation.base import Completion

__all__ = ["StepResult", "Environment", "EnvFactory", "EpisodeEnd", "Episode", "EpisodeSummary", "EnvError",
           "check_step_result", "awaited"]


class EnvError(RuntimeError):
    """An environment or tool broke its contract (raised, hung, returned a malformed observation)."""


@dataclass(frozen=True)
class StepResult:
    """What an environment returns for one model turn."""

    observation: str
    """Text appended to the context after the model's turn (tool output, a user's reply); "" for none. Plain
    text: special-token strings in it (``<|im_end|>``) are ordinary text tokens, but in parts marked with
    :func:`relayrl.data.plain_text.markup` (the chat template's own tokens)."""
    reward: float = 0.0
    """Reward of this step; the episode's reward is the sum over its steps."""
    done: bool = False
    """The episode ends after this step."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form details; ``info["tool"]`` names the tool this step ran (counted as a tool call)."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. Its methods run in a worker thread, never in the generation loop."""

    def reset(self, problem: Problem) -> str:
        """Start an episode on ``problem``; returns text placed after the prompt, before the first turn
        (context: loss mask 0; usually ""). Plain text but for its markup, as an observation."""
        ...

    def step(self, action: str) -> StepResult:
        """React to the model's turn ``action`` (its decoded text)."""
        ...


EnvFactory = Callable[[], Environment]
"""Makes a fresh environment for each episode."""


class EpisodeEnd(str, enum.Enum):
    """Why an episode ended."""

    DONE = "done"
    """The environment said done."""
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    TIMEOUT = "timeout"
    """The episode's wall-time limit passed."""
    ERROR = "error"
    """The environment raised, hung past its step limit or returned a malformed result (reward 0)."""


@dataclass
class Episode:
    """A finished episode: what the trainer needs (tokens, log-probs, loss mask, reward) and what the logs
    need (turns, tool calls, why it ended)."""

    problem_index: int
    sample_index: int
    prompt_ids: list[int]
    """The problem's prompt: context, not part of the response (the reset text opens the response, masked)."""
    token_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: the model's turns and the environment's observations, in order."""
    logprobs: list[float] = field(default_factory=list)
    """The sampler's log-prob of each model token; 0 on observation tokens."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on tokens the model wrote (trained), 0 on tokens the environment wrote (context only)."""
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    end: EpisodeEnd | None = None
    error: str | None = None
    weight_version: int = 0
    turn_texts: list[str] = field(default_factory=list)
    """The decoded text of each model turn (the last one is the final answer when the episode is done)."""
    observations: list[str] = field(default_factory=list)
    env_seconds: float = 0.0
    """Time spent in the environment's calls (its reset and steps)."""
    env_calls: int = 0
    """Calls of the environment's reset and step that ``env_seconds`` adds up."""
    token_versions: list[int] = field(default_factory=list)
    """The weight version of each token: the one that sampled it for the model's tokens, the episode's
    latest for the environment's (a partial rollout may swap weights between, or inside, turns)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Columns for the episode's sample record (``RUN_DIR/samples.jsonl``), from a step's
    ``info["log_extra"]``: the tools environment's final answer puts there what the reward functions logged
    for it (``log_extra``, a verl dict's extras), as a single-turn response's are."""
    routed_experts: Any = None
    """An engine that records MoE routing: its last turn's ``Completion.routed_experts``, which cover the prompt
    and every token before that turn's last (each turn prefills the whole context again); None otherwise."""

    def summary(self) -> "EpisodeSummary":
        """What the logs and metrics need of the episode, without its tokens."""
        model = sum(self.loss_mask)
        return EpisodeSummary(self.problem_index, self.sample_index, self.reward, self.turns, self.tool_calls,
                              self.end, self.error, model, len(self.loss_mask) - model, self.env_seconds,
                              self.env_calls)

    def completion(self, tokenizer) -> Completion:
        """The episode as the record the GRPO driver trains on (response = turns and observations)."""
        import torch

        from relayrl.engines.generation.base import Completion

        return Completion(
            prompt_index=self.problem_index, sample_index=self.sample_index,
            token_ids=torch.tensor(self.token_ids, dtype=torch.long),
            logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            finish_reason="stop" if self.end is EpisodeEnd.DONE else "length",
            weight_version=self.weight_version,
            text=tokenizer.decode(self.token_ids, skip_special_tokens=True),
            loss_mask=torch.tensor(self.loss_mask, dtype=torch.float32), routed_experts=self.routed_experts)


@dataclass(frozen=True)
class EpisodeSummary:
    """An episode's record for metrics and logs (``env/*``); what a streaming rollout sends the driver."""

    problem_index: int
    sample_index: int
    reward: float
    turns: int
    tool_calls: int
    end: EpisodeEnd | None
    error: str | None
    model_tokens: int
    env_tokens: int
    env_seconds: float
    env_calls: int = 0


def awaited(value: Any) -> Any:
    """``value``, or what it resolves to when it is awaitable: an ``async def`` tool or environment method (verl's
    tools are coroutines) runs to its end on an event loop of its own per call, as an async reward function does.
    The environment's worker threads run no loop of their own."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


def check_step_result(result: Any, where: str) -> StepResult:
    """``result`` with a Python float reward and bool done if it is a well-formed :class:`StepResult`, else
    :class:`EnvError` naming the breach. A numpy or torch scalar (``np.float32``, ``np.int64``, a 0-d tensor;
    ``np.bool_`` for done) is the number it holds, as a reward function's is."""
    if not isinstance(result, StepResult):
        raise EnvError(f"{where} returned {type(result).__name__}; expected a StepResult(observation, reward, done)")
    if not isinstance(result.observation, str):
        raise EnvError(f"{where} returned an observation of type {type(result.observation).__name__}; expected str")
    reward, done = (_scalar(v) for v in (result.reward, result.done))
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvError(f"{where} returned reward {result.reward!r}; expected a finite float")
    if abs(reward) > _FLOAT32_MAX:  # (inf once a float32 tensor holds it, as a reward function's is checked)
        raise EnvError(f"{where} returned reward {result.reward!r}, beyond float32's range (+-{_FLOAT32_MAX:.1e}, "
                       "as rewards train); scale it down")
    if not isinstance(done, bool):
        raise EnvError(f"{where} returned done={result.done!r}; expected a bool")
    return replace(result, reward=float(reward), done=done)


_FLOAT32_MAX = 3.4028234663852886e38  # (relayrl.engines.reward.user.FLOAT32_MAX; not imported: no torch here)


def _scalar(v: Any) -> Any:
    """A numpy scalar or a 0-d array or tensor as the Python number it holds (``np.bool_``: a bool), else ``v``."""
    return v.item() if hasattr(v, "item") and getattr(v, "ndim", None) == 0 else v
