"""Forced length interruption: a thinking budget enforced by writing the end of the thinking for the model.

ScaleRL (Khatri et al. 2025, "The Art of Scaling Reinforcement Learning Compute for LLMs") controls
response length with *forced interruptions* instead of a length penalty: a response that reaches its
thinking budget without having closed its reasoning gets an end-of-thinking phrase appended ("Okay, time is
up. Let me stop thinking and formulate a final answer now. </think>") and the model then writes its answer
within an answer budget. Qwen3's "thinking budget" is the same mechanism at inference.

Here it is a driver of an engine's :class:`~relayrl.engines.generation.base.PromptFeed` (the native and
the vLLM engine both take one), so the engines know nothing of it; a response is a row that may re-enter the
feed, as a multi-turn episode's next turn does (:mod:`relayrl.environments.episodes`)::

    think:  prompt                         -> up to after_tokens      ends (EOS / stop): done, untouched
                                                                      hits after_tokens without the marker:
    answer: prompt + think + phrase        -> up to the answer budget   the phrase's ids appended (loss_mask 0)
                                                                      hits after_tokens with the marker:
    rest:   prompt + think                 -> up to max_new_tokens      it goes on to the usual limit

The phrase is tokenized once (:func:`build_interrupt`); a row's token ids continue as they are (nothing is
re-tokenized). The completion a caller gets is the whole response: every token, ``loss_mask`` 1 on the
sampled ones and 0 on the phrase's, whose log-probs are recorded as 0 (no sampler drew them); the trainer
masks them out of the loss, the ratio and the metrics as it does an environment's tokens.

Departures: a row that re-enters is prefilled again (prompt and tokens so far; the engines keep no cache
across rows, vLLM's prefix cache aside), so an interrupted or still-thinking response pays one extra prefill
at ``after_tokens``. Every sample of a prompt is its own row (``n`` prefills of the prompt where the plain
path shares one), and on CUDA the native engine decodes fed rows on its dynamic cache, not the static
graphed one. Whether the thinking was closed is read on the text (the marker as a substring of the decoded
tokens, special tokens kept), so it holds however the tokenizer splits the marker. An engine checks
``stop_strings`` on the tokens of the row it runs, so a stop string that straddles ``after_tokens`` is not seen.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

import torch

from relayrl.engines.generation.base import Completion, SamplingParams, check_prompts
from relayrl.errors import UserError

__all__ = ["Interrupt", "InterruptError", "Phase", "build_interrupt", "generate_interrupted"]


class InterruptError(UserError, ValueError):
    """``rollout.interrupt`` does not fit the response budget, or the engine cannot re-enter rows."""


@dataclass(frozen=True)
class Interrupt:
    """A thinking budget, its phrase as token ids, and an answer budget (module docstring)."""

    after_tokens: int
    """The thinking budget: a response this long that has not ended nor closed its thinking is interrupted."""
    forced_ids: tuple[int, ...]
    """The end-of-thinking phrase's token ids, appended to an interrupted response."""
    answer_tokens: int
    """Tokens the model may write after the phrase."""
    marker: str = "</think>"
    """Text that says the thinking was closed; a response holding it at ``after_tokens`` is not interrupted."""

    def rest_tokens(self, max_new_tokens: int) -> int:
        """Tokens a response that closed its thinking may still write after ``after_tokens``."""
        return max_new_tokens - self.after_tokens


def build_interrupt(tokenizer, *, after_tokens: int, text: str, answer_tokens: int | None, marker: str,
                    max_new_tokens: int, budget_key: str = "rollout.max_new_tokens",
                    after_key: str = "rollout.interrupt.after_tokens") -> Interrupt:
    """The :class:`Interrupt` of ``rollout.interrupt``: ``text`` tokenized once with ``tokenizer`` (no special
    tokens added); ``answer_tokens`` None takes what ``max_new_tokens`` (the whole response's cap, read from
    ``budget_key``) leaves after the thinking and the phrase. Raises :class:`InterruptError` naming the keys
    when they do not fit."""
    ids = tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise InterruptError(f"rollout.interrupt.text={text!r} tokenizes to no tokens; give a phrase")
    answer = answer_tokens if answer_tokens is not None else max_new_tokens - after_tokens - len(ids)
    need = after_tokens + len(ids) + max(answer, 1)
    if answer < 1 or need > max_new_tokens:
        what = f"rollout.interrupt.answer_tokens={answer_tokens}" if answer_tokens is not None else "one answer token"
        raise InterruptError(
            f"{after_key}={after_tokens} + the phrase's {len(ids)} tokens + {what} = {need} do not fit in "
            f"{budget_key}={max_new_tokens}, which caps the whole response (the phrase included): raise "
            f"{budget_key} to at least {need}, or lower {after_key}")
    return Interrupt(after_tokens=after_tokens, forced_ids=ids, answer_tokens=answer, marker=marker)


class Phase(Enum):
    """Where a response is (module docstring's diagram)."""

    THINK = "think"
    """Its first row, up to ``after_tokens``."""
    ANSWER = "answer"
    """Interrupted: the phrase written, the answer's row running."""
    REST = "rest"
    """It closed its thinking by ``after_tokens``: a row running on to ``max_new_tokens``."""


@dataclass
class _Response:
    """One response being generated in up to two rows: its tokens so far and which phase it is in."""

    prompt: list[int]
    phase: Phase = Phase.THINK
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)

    def extend(self, c: Completion) -> None:
        """A finished row's sampled tokens."""
        self.tokens += c.token_ids.tolist()
        self.logps += c.logprobs.tolist()
        self.versions += (c.token_versions.tolist() if c.token_versions is not None
                          else [c.weight_version] * len(c.token_ids))
        self.mask += [1.0] * len(c.token_ids)

    def force(self, ids: Sequence[int], version: int) -> None:
        """The phrase's tokens: written, not sampled (log-prob 0, loss_mask 0)."""
        self.tokens += ids
        self.logps += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [0.0] * len(ids)


class _Feed:
    """The rows to generate (a :class:`~relayrl.engines.generation.base.PromptFeed`): ``(key, context,
    budget)`` of every sample of every prompt, then of the responses that re-enter, which go first."""

    def __init__(self, rows: Sequence[tuple[int, list[int], int]]) -> None:
        self.waiting: deque[tuple[int, list[int], int]] = deque(rows)

    def take(self) -> tuple[int, Sequence[int], int] | None:
        return self.waiting.popleft() if self.waiting else None

    def wait(self) -> bool:
        # a row re-enters from on_finish, which the engine calls in its loop before it asks again
        return bool(self.waiting)

    def again(self, key: int, context: list[int], budget: int) -> None:
        self.waiting.appendleft((key, context, budget))


def generate_interrupted(engine, prompts: Sequence[Sequence[int]], params: SamplingParams, interrupt: Interrupt,
                         generator: torch.Generator | None = None,
                         on_finish: Callable[[Completion], None] | None = None,
                         between: Callable[[], bool] | None = None) -> list[Completion]:
    """``params.n`` responses per prompt on ``engine`` (one with ``generate_feed``: the native or the vLLM
    engine) under ``interrupt``; completions in (prompt, sample) order, each with its ``loss_mask`` (0 on the
    phrase) and ``interrupted``. ``params.max_new_tokens`` caps every response, phrase included.
    ``on_finish`` and ``between`` are the engine's (a finished response; weights loaded between two steps)."""
    if not hasattr(engine, "generate_feed"):
        raise InterruptError(f"rollout.interrupt re-enters rows into a running batch, which the "
                             f"{type(engine).__name__} cannot do: use rollout.engine=native or vllm, or drop "
                             f"rollout.interrupt.after_tokens")
    if interrupt.after_tokens >= params.max_new_tokens:
        raise InterruptError(f"rollout.interrupt.after_tokens={interrupt.after_tokens} must be below the "
                             f"response budget max_new_tokens={params.max_new_tokens}")
    check_prompts(prompts)
    n, tok = params.n, engine.tokenizer
    responses = {i * n + s: _Response(list(p)) for i, p in enumerate(prompts) for s in range(n)}
    feed = _Feed([(k, r.prompt, interrupt.after_tokens) for k, r in responses.items()])
    out: dict[int, Completion] = {}

    def finished(c: Completion) -> None:
        key = c.prompt_index
        r = responses[key]
        r.extend(c)
        if r.phase is Phase.THINK and c.finish_reason == "length":  # the budget, without EOS or a stop
            if interrupt.marker in tok.decode(r.tokens, skip_special_tokens=False):
                r.phase = Phase.REST
                feed.again(key, r.prompt + r.tokens, interrupt.rest_tokens(params.max_new_tokens))
                return
            r.force(interrupt.forced_ids, engine.weight_version)
            r.phase = Phase.ANSWER
            feed.again(key, r.prompt + r.tokens, interrupt.answer_tokens)
            return
        done = Completion(
            prompt_index=key // n, sample_index=key % n, token_ids=torch.tensor(r.tokens, dtype=torch.long),
            logprobs=torch.tensor(r.logps, dtype=torch.float32), finish_reason=c.finish_reason,
            weight_version=c.weight_version, text=tok.decode(r.tokens, skip_special_tokens=True),
            loss_mask=torch.tensor(r.mask, dtype=torch.float32),
            token_versions=torch.tensor(r.versions, dtype=torch.long), interrupted=r.phase is Phase.ANSWER,
            routed_experts=c.routed_experts)  # (its row prefilled prompt + the response so far: they cover it all)
        del responses[key]
        out[key] = done
        if on_finish is not None:
            on_finish(done)

    one = params.model_copy(update={"n": 1})  # each response is a row of its own: it may re-enter alone
    engine.generate_feed(feed, one, generator, finished, between)
    return [out[k] for k in sorted(out)]
