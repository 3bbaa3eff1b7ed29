"""The episode loop: many multi-turn episodes at once, continuously batched across turns.

::

    generation thread (the engine's loop, NativeGenerationEngine.generate_feed)
        decode the batch; a finished turn leaves it  ──on_finish──▶  submit env.step(turn) to the pool
        free slots take ready turns from the feed    ◀──feed.put──  pool thread: append the observation,
        batch empty: wait on the feed                                 decide (next turn | episode ends)
    env pool (env.workers threads): reset and step of every episode, one at a time per episode

A turn's environment step never blocks the decoding of other episodes: the generation thread only hands
the finished turn to the pool. When the next turn is ready it rejoins the running batch as a new row whose
whole context (prompt, turns, observations, exactly the token ids seen so far: nothing is re-tokenized)
is prefilled again; the engine has no prefix cache, so that prefill is the price of rejoining.

Limits per episode: ``max_turns`` model turns, ``max_tokens`` response tokens (a turn's budget is what is
left), ``max_seconds`` of wall time from the moment its first turn enters the batch (time spent queued for a
free slot does not count), checked at turn boundaries and while its environment step runs. An environment step that raises, returns a malformed result or runs
past ``step_timeout_s`` ends its episode as an error with reward 0 here; the hung thread cannot be killed
(Python threads cannot), so it keeps its thread until it returns and its late result is dropped, and a new thread
takes its place in the pool (else ``env.workers`` hung steps would leave the episodes queued behind them waiting
forever, their own limits never started); the pool's threads are daemons, so a step that never returns does not keep the process from exiting. Tools with
their own limits (the sandbox) return on time. A training step never trains on such an episode:
``env.on_error`` fails the step naming the prompt, or drops the episode's group
(:mod:`relayrl.workflows.rollout_stream`); evaluation scores it 0 and counts it.

Departure from NeMo RL: environments step one episode at a time in threads, not a batch of
episodes in a Ray actor, so a slow step delays only its own episode.
"""

from __future__ import annotations

import queue
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from relayrl.data.tasks import Problem
from relayrl.engines.generation.base import Completion, SamplingParams
from relayrl.environments.base import (EnvError, EnvFactory, Episode, EpisodeEnd, EpisodeSummary, awaited,
                                      check_step_result)
from relayrl.data.plain_text import EnvText, EnvTextEncoder, env_parts
from relayrl.environments.extras import step_extras
from relayrl.environments.user_prints import captured_prints, note_env_prints

__all__ = ["EpisodeLimits", "run_episodes", "episode_metrics"]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_tokens: int = 256
    max_seconds: float = 60.0
    step_timeout_s: float = 30.0


class _Live:
    """An episode in progress."""

    def __init__(self, key: int, episode: Episode, env) -> None:
        self.key, self.ep, self.env = key, episode, env
        self.deadline: float | None = None  # wall-time limit, set when the first turn enters the batch
        self.step_deadline: float | None = None  # set while an environment step runs
        self.epoch = 0  # bumped when the episode ends; a late step result with an old epoch is dropped


_FAILED = object()
"""What an environment call returns when it raised or ran late (its episode is already ended)."""

_OURS = Path(__file__).resolve().parents[1]
_INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
_STDLIB = sysconfig.get_paths()["stdlib"]


def _where(exc: BaseException) -> str:
    """Where ``exc`` (or the error it was raised from) was raised, as `` (at FILE:LINE in FUNC)``: the innermost
    frame of the user's own code (neither relayrl's nor the standard library's; an installed package's only
    when no other is left), "" when there is none. The message is all a user sees of an environment's or a
    tool's crash (it happened in a worker thread), so it says where to look."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    own, installed = [], []
    for f in traceback.extract_tb(exc.__traceback__):
        if Path(f.filename).resolve().is_relative_to(_OURS):
            continue
        if f.filename.startswith(_INSTALLED):
            installed.append(f)
        elif not f.filename.startswith(_STDLIB):
            own.append(f)
    f = (own or installed or [None])[-1]
    return "" if f is None else f" (at {f.filename}:{f.lineno} in {f.name})"


def _env_name(env, make_env: EnvFactory) -> str:
    """The environment's class name (the factory's name while it has made none)."""
    if env is None or env is _FAILED:
        return getattr(make_env, "__qualname__", None) or type(make_env).__name__
    return type(env).__qualname__


def _raised(what: str, exc: Exception) -> str:
    """The episode's error for ``what`` (``env.step``) raising ``exc``: an :class:`EnvError` (a broken contract,
    a tool's crash) says itself, anything else by its type."""
    if isinstance(exc, EnvError):
        return f"{what}: {exc}{_where(exc)}"
    return f"{what} raised {type(exc).__name__}: {exc}{_where(exc)}"


class _DaemonPool:
    """``n`` daemon threads over a task queue. Daemon threads, unlike ``ThreadPoolExecutor``'s, do not keep
    the process alive at exit, so an environment step that hangs forever cannot hang the run's end."""

    def __init__(self, n: int, name: str) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.n, self.name = 0, name
        for _ in range(n):
            self.add()

    def add(self) -> None:
        """One more thread: one in place of a thread a hung call holds."""
        threading.Thread(target=self._work, name=f"{self.name}-{self.n}", daemon=True).start()
        self.n += 1

    def submit(self, fn: Callable, *args) -> None:
        self.q.put((fn, args))

    def _work(self) -> None:
        while (item := self.q.get()) is not None:
            fn, args = item
            fn(*args)

    def shutdown(self) -> None:
        for _ in range(self.n):
            self.q.put(None)


class _Feed:
    """The turns ready to generate (a :class:`relayrl.engines.generation.base.PromptFeed`), and the
    bookkeeping of the episodes still open."""

    def __init__(self, live: dict[int, _Live], limits: EpisodeLimits, turn_tokens: int,
                 on_end: Callable[[Episode], None] | None = None, on_hung: Callable[[], None] | None = None) -> None:
        self.live, self.limits, self.turn_tokens, self.on_end = live, limits, turn_tokens, on_end
        self.on_hung = on_hung  # a call ran past its limit and holds its thread: the pool gets another
        self.ready: queue.Queue[int] = queue.Queue()
        self.lock = threading.Lock()
        self.open = len(live)

    def take(self) -> tuple[int, Sequence[int], int] | None:
        self._expire()
        while True:
            try:
                key = self.ready.get_nowait()
            except queue.Empty:
                return None
            with self.lock:
                lv = self.live.get(key)
                if lv is None or lv.ep.end is not None:
                    continue
                if lv.deadline is None:  # the wall-time clock starts when the first turn enters the batch
                    lv.deadline = time.monotonic() + self.limits.max_seconds
                budget = min(self.turn_tokens, self.limits.max_tokens - len(lv.ep.token_ids))
                return key, lv.ep.prompt_ids + lv.ep.token_ids, budget

    def wait(self) -> bool:
        while True:
            self._expire()
            with self.lock:
                if self.open == 0:
                    return False
            if not self.ready.empty():
                return True
            try:  # wake up to check deadlines
                key = self.ready.get(timeout=0.05)
            except queue.Empty:
                continue
            self.ready.put(key)
            return True

    def end(self, lv: _Live, why: EpisodeEnd, error: str | None = None) -> None:
        """Close an episode (under ``lock``). An error is the episode's (``Episode.error``), not a log line: the
        driver logs the first few of a step and counts them all (``relayrl.workflows.episodes.log_episode_errors``,
        ``env/errors``), where a line per episode flooded the log with one per errored episode."""
        if lv.ep.end is not None:
            return
        lv.ep.end, lv.ep.error = why, error
        if why is EpisodeEnd.ERROR:
            lv.ep.reward = 0.0
        lv.epoch += 1
        self.open -= 1
        if self.on_end is not None:  # (under the lock: the episode is final; the callback must not block)
            self.on_end(lv.ep)

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for lv in self.live.values():
                if lv.ep.end is not None or lv.step_deadline is None:
                    continue
                if now > lv.step_deadline:
                    self.end(lv, EpisodeEnd.ERROR, f"environment step ran past env.step_timeout_s="
                                                   f"{self.limits.step_timeout_s:g} s")
                elif lv.deadline is not None and now > lv.deadline:
                    self.end(lv, EpisodeEnd.TIMEOUT)
                else:
                    continue
                if self.on_hung is not None:  # (its call runs on, holding its thread: the pool gets another)
                    self.on_hung()


def run_episodes(engine, tokenizer, problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
                 make_env: EnvFactory, params: SamplingParams, limits: EpisodeLimits, *, workers: int = 4,
                 generator: torch.Generator | None = None, log: Callable[[str], None] = print,
                 on_end: Callable[[Episode], None] | None = None,
                 between: Callable[[], bool] | None = None) -> list[Episode]:
    """``params.n`` episodes per problem on ``engine`` (a NativeGenerationEngine); episodes in (problem,
    sample) order. ``prompts[i]`` is problem i's prompt token ids; ``params.max_new_tokens`` caps a turn.

    ``on_end`` gets each episode the moment it ends (from whichever thread ends it, holding the loop's lock:
    it must hand the episode on, not work on it), e.g. a streaming rollout writing finished groups into the
    dock. ``between`` is the engine's partial-rollout hook (weights loaded between two decode steps)."""
    turn = params.model_copy(update={"n": 1})
    live: dict[int, _Live] = {}
    for i, p in enumerate(problems):
        for s in range(params.n):
            key = len(live)
            live[key] = _Live(key, Episode(i, s, list(prompts[i]), weight_version=engine.weight_version), None)
    pool = _DaemonPool(workers, "relayrl-env")
    feed = _Feed(live, limits, params.max_new_tokens, on_end, on_hung=pool.add)
    tok_lock = threading.Lock()  # a fast tokenizer is not safe to call from several threads at once
    env_text = EnvTextEncoder(tokenizer)

    def encode(text: str, room: int) -> list[int]:
        """An environment's text as plain text but for its markup (:mod:`relayrl.data.plain_text`): a tool's
        output that prints ``<|im_end|>`` must not end the model's turn in the context it is trained on. Its
        first ``room`` ids only (the episode's tokens left), so megabytes are cut before they are tokenized."""
        with tok_lock:
            said = bool(env_text.forged)
            ids = env_text.head(text, max(room, 0))
            if env_text.forged and not said:
                log("relayrl: an environment's text held the tokenizer's special-token strings "
                    f"{', '.join(sorted(env_text.forged))}; they are tokenized as plain text, so that tool output "
                    "cannot end a turn or the sequence (said once per rollout). An environment that writes the chat "
                    "template's own tokens marks them: relayrl.data.plain_text.markup")
            return ids

    def call(lv: _Live, what: str, fn: Callable[[], object], counted: bool = True):
        """Run an environment method (``counted``: a call of ``env/step_seconds_mean``; else the factory) with its
        step deadline; ``_FAILED`` (and the episode ended) on failure.
        (Not None: a method that returns None, e.g. a ``reset`` without ``return ""``, is the environment's
        malformed result, which must end the episode too, or it would stay open and the loop wait forever.)"""
        with feed.lock:
            if lv.ep.end is not None:
                return _FAILED
            lv.step_deadline = time.monotonic() + limits.step_timeout_s
            epoch = lv.epoch
        t0 = time.monotonic()
        with captured_prints() as printed:  # (its prints are not the console's: user_prints)
            try:
                out = awaited(fn())  # (an async def reset or step: run to its end here)
                err = None
            except Exception as e:  # an environment's or a tool's own failure: the episode ends, the run goes on
                out, err = None, _raised(what, e)
        note_env_prints(_env_name(lv.env if lv.env is not None else out, make_env), what, printed)
        with feed.lock:
            if counted:
                lv.ep.env_seconds += time.monotonic() - t0
                lv.ep.env_calls += 1
            lv.step_deadline = None
            if lv.epoch != epoch or lv.ep.end is not None:
                return _FAILED  # it timed out meanwhile: drop the late result
            if err is not None:
                feed.end(lv, EpisodeEnd.ERROR, err)
                return _FAILED
        return out

    def reset(lv: _Live) -> None:
        # (the factory under the step deadline too: one that hangs, a service it waits on, ends its episode)
        env = call(lv, "making the environment", make_env, counted=False)
        if env is _FAILED:
            return
        if env is None:
            with feed.lock:
                feed.end(lv, EpisodeEnd.ERROR, "the environment factory returned None; expected an environment")
            return
        lv.env = env
        text = call(lv, "env.reset", lambda: env.reset(problems[lv.ep.problem_index]))
        if text is _FAILED:
            return
        if not isinstance(text, str):
            with feed.lock:
                feed.end(lv, EpisodeEnd.ERROR, f"env.reset returned {type(text).__name__}; expected str")
            return
        ids = encode(text, limits.max_tokens - 1)  # context like an observation: it opens the response
        with feed.lock:
            lv.ep.token_ids += ids
            lv.ep.logprobs += [0.0] * len(ids)
            lv.ep.loss_mask += [0] * len(ids)
            lv.ep.token_versions += [lv.ep.weight_version] * len(ids)
        if text:
            lv.ep.observations.append(str(text))
        feed.ready.put(lv.key)

    def step(lv: _Live, c: Completion) -> None:
        raw = call(lv, "env.step", lambda: lv.env.step(c.text))
        if raw is _FAILED:
            return
        try:
            result = check_step_result(raw, f"{type(lv.env).__name__}.step")
            extras = step_extras(result.info, f"{type(lv.env).__name__}.step")
        except Exception as e:
            with feed.lock:
                feed.end(lv, EpisodeEnd.ERROR, str(e))
            return
        with tok_lock:
            text = after_turn(tokenizer, c, result.observation)
        with feed.lock:
            room = limits.max_tokens - len(lv.ep.token_ids)  # (its turn is done: nothing adds tokens meanwhile)
        obs = encode(text, room)
        with feed.lock:
            ep = lv.ep
            if ep.end is not None:
                return
            ep.reward += float(result.reward)
            ep.extras.update(extras)
            ep.tool_calls += int("tool" in result.info)
            if result.observation:
                ep.observations.append(str(result.observation))
            ep.token_ids += obs[:room]
            ep.logprobs += [0.0] * len(obs[:room])
            ep.loss_mask += [0] * len(obs[:room])
            ep.token_versions += [ep.weight_version] * len(obs[:room])
            if result.done:
                feed.end(lv, EpisodeEnd.DONE)
            elif ep.turns >= limits.max_turns:
                feed.end(lv, EpisodeEnd.MAX_TURNS)
            elif len(ep.token_ids) >= limits.max_tokens:
                feed.end(lv, EpisodeEnd.MAX_TOKENS)
            elif lv.deadline is not None and time.monotonic() > lv.deadline:
                feed.end(lv, EpisodeEnd.TIMEOUT)
            else:
                feed.ready.put(lv.key)

    def guarded(fn: Callable[[_Live], None]) -> Callable[..., None]:
        """Run an episode task; an exception in relayrl's own bookkeeping ends that episode (it would
        otherwise stay open and the generation loop would wait for it forever)."""
        def run(lv: _Live, *args) -> None:
            try:
                fn(lv, *args)
            except Exception as e:
                with feed.lock:
                    feed.end(lv, EpisodeEnd.ERROR, f"episode bookkeeping failed: {type(e).__name__}: {e}")
        return run

    def on_finish(c: Completion) -> None:  # generation thread: record the turn, hand the step to the pool
        lv = live[c.prompt_index]
        with feed.lock:
            ep = lv.ep
            if ep.end is not None:
                return
            ep.token_ids += c.token_ids.tolist()
            ep.logprobs += c.logprobs.tolist()
            ep.loss_mask += [1] * len(c.token_ids)
            ep.token_versions += (c.token_versions.tolist() if c.token_versions is not None
                                  else [c.weight_version] * len(c.token_ids))
            ep.turns += 1
            ep.turn_texts.append(c.text)
            ep.weight_version = c.weight_version
            if c.routed_experts is not None:  # (its context was the whole episode so far: prompt + tokens)
                ep.routed_experts = c.routed_experts
        pool.submit(guarded(step), lv, c)

    try:
        for lv in live.values():
            pool.submit(guarded(reset), lv)
        engine.generate_feed(feed, turn, generator, on_finish, between)
    finally:
        pool.shutdown()  # a hung step keeps its (daemon) thread; its result is dropped
    return [live[k].ep for k in sorted(live)]


def after_turn(tokenizer, turn: Completion, observation: str) -> str:
    """``observation`` without the end-of-turn token it opens with when the model's turn ended with that very
    token: a chat template's tool message (``env.tool_results=chat``) opens by closing the assistant's turn
    (Qwen2.5: ``<|im_end|>``), which a model that stopped at its end-of-turn token has written already. Only a
    :func:`~relayrl.data.plain_text.markup` opening is dropped: in plain text (a tool's output) the string is
    text, not the token."""
    ids = turn.token_ids
    parts = env_parts(observation)
    if turn.finish_reason != "stop" or len(ids) == 0 or not parts or not parts[0][1]:
        return observation
    last = int(ids[-1])
    closing = tokenizer.convert_ids_to_tokens(last)
    if not isinstance(closing, str) or not closing or not parts[0][0].startswith(closing):
        return observation  # (the usual case, decided without listing the tokenizer's special tokens)
    special = last in tokenizer.all_special_ids or last in (getattr(tokenizer, "added_tokens_decoder", None) or {})
    return EnvText(((parts[0][0][len(closing):], True), *parts[1:])) if special else observation


def episode_metrics(episodes: Sequence[Episode | EpisodeSummary]) -> dict[str, float]:
    """``env/*`` metrics of a step's episodes (or their summaries): errors (count), turns, tool calls, seconds per
    environment call (reset or step), how episodes ended."""
    episodes = [e.summary() if isinstance(e, Episode) else e for e in episodes]
    n = max(len(episodes), 1)
    out = {
        "env/errors": float(sum(e.end is EpisodeEnd.ERROR for e in episodes)),
        "env/turns_mean": sum(e.turns for e in episodes) / n,
        "env/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "env/tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / n,
        "env/model_tokens_mean": sum(e.model_tokens for e in episodes) / n,
        "env/env_tokens_mean": sum(e.env_tokens for e in episodes) / n,
        "env/step_seconds_mean": sum(e.env_seconds for e in episodes) / max(sum(e.env_calls for e in episodes), 1),
    }
    for why in EpisodeEnd:
        out[f"env/end_{why.value}"] = sum(e.end is why for e in episodes) / n
    return out
