"""The reward engine: batched, optionally threaded scoring with metrics.

``score`` takes a batch of responses and returns one reward per row plus
metrics; ``score_async`` runs the same on a background thread and returns a
``concurrent.futures.Future``, so a workflow can score one batch while it
computes log-probs for another (the reward stage overlapping other stages, as
in HybridFlow's and AsyncFlow's dataflow). Row-wise verifiers (task, math, exact) are spread
over ``workers`` threads in contiguous chunks; a user function receives the
whole batch in one call (it may look across rows, e.g. within a group), and, by keyword, the rows'
dataset fields it takes (``columns``: :class:`~relayrl.engines.reward.user.CallShape`); what a TRL-shaped
one logs per row (``log_extra``) stays with the row it was logged for (:mod:`relayrl.engines.reward.extra`).

A source that fails (a verifier on one row, a user function, reward model or judge on a batch) is handled by
the policy :mod:`relayrl.engines.reward.calls` describes: ``reward.on_error`` decides after the call is made again
per prompt, and no failed call becomes a reward.

The time limit runs the user function on a daemon thread and waits for it. A
Python function cannot be interrupted: a call that runs past the limit is
abandoned, and its thread runs on until the function returns (its result is
dropped). More than ``MAX_ABANDONED`` such threads alive at once stop the run
whatever ``reward.on_error`` says (the function hangs for good, and each hung
call holds a thread).

Learned rewards (``reward.model``: a reward model, ``reward.judge.path``: an LLM
judge) are scored in the same call, on the engine's device, and combined with
the verifier and format term by their weights; the verifier is computed and
logged even at weight 0. The models load on first use, so a run that never
scores (SFT, DPO) never loads them. Evaluation calls :meth:`verify`, the
verifier and format term alone.

Threads share the GIL, so pure-Python verifiers gain little from ``workers > 1``
beyond overlapping with torch work that releases the GIL; the point of the
thread pool is non-blocking scoring, not CPU parallelism.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch

from relayrl.algorithms.reward_model import RunningMoments, normalize_rewards
from relayrl.engines.reward.calls import (Columns, Scorer, StopRun, TooManyHung, check_inputs, guarded,
                                         judge_scores, mean, model_scores, on_rows, std, verifier_rows)
from relayrl.engines.reward.config import RewardConfig, RewardError
from relayrl.engines.reward.extra import ExtraError, ExtraLog
from relayrl.engines.reward.judge import LLMJudge
from relayrl.engines.reward.user import (CALL_ARGS, Overtime, UserFn, call_within, check_rewards, fn_metrics,
                                        load_user_fns, standalone_refusal)
from relayrl.engines.reward.verifiers import CORRECT, exact_reward, format_reward, math_reward

__all__ = ["RewardEngine", "MAX_ABANDONED"]

log = logging.getLogger(__name__)

MAX_ABANDONED = 16
"""Calls of the user function still running past ``reward.timeout_s`` (abandoned threads) that stop the run."""


class RewardEngine:
    """Scores responses with the verifier and format reward chosen in :class:`RewardConfig`.

    ``task`` is the built-in task (anything with ``verify(response, answer) -> float``);
    it is required for ``verifier="task"``. A user function is loaded and its
    signature checked here, so a bad ``user_fn`` fails at construction.
    """

    def __init__(self, cfg: RewardConfig, task=None, *, chat_template: bool | None = None, device: str = "cpu",
                 judge_ask: Callable[[list[str]], list[str]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        cfg.check_paths()
        self.cfg = cfg
        self.chat_template, self.template_kwargs = chat_template, template_kwargs  # (the reward model's prompts)
        self.device = str(device) if cfg.model_device == "auto" else cfg.model_device
        self._rm = None  # the reward model's scorer, loaded on first use
        self._judge = LLMJudge(cfg.judge, device=self.device, ask=judge_ask) if cfg.judge.path or judge_ask else None
        self.moments = RunningMoments() if cfg.normalize == "running" else None  # (checkpointed with the run)
        """``reward.normalize=running``: the moments of every reward of the steps ended so far (:meth:`fold_moments`):
        what a step's rewards are whitened by, in whichever calls they are scored."""
        self._step_rewards: list[float] = []  # the current step's rewards (learn=True), folded in after it
        self._lock = threading.Lock()  # concurrent score calls (the dataflow's driver threads): one load, one update
        self._row_fn: Callable[[str, str], float] | None = None
        self._user: list[UserFn] = []  # the user functions (reward.verifier=user): their weighted sum
        self._unmet: set[tuple[str, str]] = set()  # (function, field): a field with a default a batch lacked
        self._said_unscored = False  # rows every user function returned None for: warned once
        if cfg.verifier == "task":
            if task is None or not callable(getattr(task, "verify", None)):
                raise RewardError(
                    "reward.verifier='task' needs a built-in task with verify(response, answer) "
                    "(use data.task, or reward.verifier=math/exact/user for a user dataset)"
                )
            self._row_fn = task.verify
            self.verifier_name = f"task:{getattr(task, 'name', type(task).__name__)}"
        elif cfg.verifier == "math":
            self._row_fn = partial(math_reward, timeout_s=cfg.math_timeout_s, max_chars=cfg.math_max_chars)
            self.verifier_name = "math"
        elif cfg.verifier == "exact":
            self._row_fn = exact_reward
            self.verifier_name = "exact"
        else:
            self._user = load_user_fns(cfg.user_fns, cfg.user_weights)
            self.verifier_name = "user:" + "+".join(cfg.user_fns)
        self._format = re.compile(cfg.format_regex) if cfg.format_regex is not None else None
        self._format_on = cfg.resolved_format_on()
        self._pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix="reward") if cfg.workers > 1 else None
        self._driver: ThreadPoolExecutor | None = None
        self._closed = False
        self._abandoned: list[threading.Thread] = []  # user-function calls that ran past reward.timeout_s

    # ---------------------------------------------------------------- pickling
    _TRANSIENT = ("_lock", "_pool", "_driver", "_abandoned", "_rm", "_user")

    def __getstate__(self) -> dict:
        """The engine as a scorer on a pool of its own receives it (``placement.reward`` on Ray: an actor there):
        its config, task, verifier, judge and running moments; not its threads and lock, nor a loaded reward
        model (loaded again on first use) or the user functions (loaded again from ``reward.user_fn``, which
        names their files: a function of a file loaded by path does not pickle by reference)."""
        if self._closed:
            raise RewardError("a closed reward engine cannot be sent to another process")
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock, self._rm, self._driver, self._abandoned = threading.Lock(), None, None, []
        self._user = load_user_fns(self.cfg.user_fns, self.cfg.user_weights) if self.cfg.verifier == "user" else []
        self._pool = ThreadPoolExecutor(self.cfg.workers, thread_name_prefix="reward") if self.cfg.workers > 1 else None

    # ---------------------------------------------------------------- scoring
    def place(self, device) -> None:
        """Score the learned rewards on ``device`` (a reward worker on its own pool's device)."""
        self.device = str(device)
        if self._rm is not None:
            self._rm.to(device)
        if self._judge is not None:
            self._judge.to(device)

    @property
    def reward_model(self):
        """The reward model's :class:`~relayrl.models.reward.RewardModelScorer` (loaded on first use)."""
        with self._lock:
            if self._rm is None and self.cfg.model is not None:
                from relayrl.models.reward import RewardModelScorer

                self._rm = RewardModelScorer(self.cfg.model, device=self.device, batch_size=self.cfg.model_batch,
                                             chat_template=self.chat_template, template_kwargs=self.template_kwargs)
        return self._rm

    def verify(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
               columns: Columns | None = None, extra: ExtraLog | None = None) -> list[float]:
        """The verifier plus the format term (unweighted verifier; no learned reward, no normalisation): what
        held-out accuracy is measured with. ``columns``, ``extra``: as for :meth:`score_each`."""
        n = self._check_inputs(prompts, responses, answers, None, columns)
        if self._user:
            verifier, _, _ = self._user_scores(list(prompts), list(responses), list(answers), self._rows(columns, n),
                                               extra)
            if any(v != v for v in verifier):  # reward.on_error=drop_group: no group to drop in an evaluation
                log.warning("evaluation: the reward function failed on %d of %d rows, scored 0 (reward.on_error="
                            "drop_group)", sum(v != v for v in verifier), len(verifier))
                verifier = [0.0 if v != v else v for v in verifier]
        else:
            verifier, _ = self._score_rows(list(responses), list(answers))
        if self._format is None:
            return verifier
        return [v + self.cfg.format_weight * format_reward(self._format_target(responses[i]), self._format)
                for i, v in enumerate(verifier[:n])]

    def score(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
              finish_reasons: Sequence[str] | None = None, columns: Columns | None = None, *,
              learn: bool = True) -> tuple[list[float], dict[str, float]]:
        """Rewards ``[N]`` and metrics for ``N`` rows; NaN for the rows of a prompt a source failed on with
        ``reward.on_error=drop_group`` (module docstring).

        ``columns`` (optional): each row's dataset fields (a dict, or ``None``; ``Problem.meta["fields"]``),
        passed by keyword to a user function that takes them; other sources ignore them.

        ``finish_reasons`` (``"stop"``/``"length"`` per row, optional): a truncated row (``"length"``) gets
        format reward 0, since its format never finished; its fraction is logged as ``reward/truncated_frac``.

        Metrics: ``reward/mean``, ``reward/std``, ``reward/verifier_mean``, ``reward/verifier_accuracy``
        (rows the verifier accepts, score >= 1, whatever its weight), ``reward/format_mean`` (when a format regex
        is set), ``reward/errors`` (rows whose built-in verifier raised, scored 0, and rows left NaN),
        ``reward/truncated_frac`` (when finish reasons are given), ``reward/score_time_s``; with several user
        functions ``reward/fn/NAME_mean`` and ``_std``; with a reward model ``reward/model_mean``,
        ``reward/model_std``; with a judge ``reward/judge_mean``, ``reward/judge_malformed`` (verdicts scored by
        ``reward.judge.malformed_score``); with normalisation ``reward/raw_mean`` (before it),
        ``reward/norm_mean``, ``reward/norm_std`` (the moments used); with clipping ``reward/clip_frac``.

        ``reward.normalize=running``: the rows are whitened by :attr:`moments`, the rewards of the steps ended
        so far, which no call of the step changes; its rows (``learn=True``) are kept for :meth:`fold_moments`.
        ``learn=False``: whitened the same, not kept (ReMax's greedy baseline, a reference point).
        """
        rewards, metrics, _ = self.score_each(prompts, responses, answers, finish_reasons, columns, learn=learn)
        return rewards, metrics

    def score_each(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
                   finish_reasons: Sequence[str] | None = None, columns: Columns | None = None,
                   extra: ExtraLog | None = None, *, learn: bool = True
                   ) -> tuple[list[float], dict[str, float], list[list[float]]]:
        """:meth:`score`, and each user function's score of each row (``[N][K]``, the functions in
        ``reward.user_fn``'s order; NaN where a function returned ``None`` for the row, and in the rows left
        NaN): what ``reward.user_aggregation=normalize_then_sum`` normalises. ``[]`` per row without user
        functions. ``extra``: receives the columns the user functions log per row (``log_extra``:
        :mod:`relayrl.engines.reward.extra`); None: they are checked, not kept."""
        if self._closed:
            raise RuntimeError("RewardEngine.score after close()")
        t0 = time.perf_counter()
        n = self._check_inputs(prompts, responses, answers, finish_reasons, columns)
        prompts, responses, answers, columns = list(prompts), list(responses), list(answers), self._rows(columns, n)
        learned: dict[str, float] = {}
        each: list[list[float]] = [[] for _ in range(n)]
        if self._user:
            verifier, learned, each = self._user_scores(prompts, responses, answers, columns, extra)
            errors: list[tuple[int, str]] = []
        else:
            verifier, errors = self._score_rows(responses, answers)
        c = self.cfg
        rm = judged = None
        if self.reward_model is not None:  # (rows a source failed on are not scored by the next one)
            rm = self._on_rows(self._rm_once, "the reward model", verifier, prompts, responses, answers, columns)
        if self._judge is not None:
            malformed: list[int] = []
            judged = self._on_rows(partial(self._judge_once, malformed=malformed), "the judge",
                                   rm or verifier, prompts, responses, answers, columns)
        ok = [i for i in range(n) if all(x[i] == x[i] for x in (verifier, rm, judged) if x is not None)]
        pick = (lambda xs: [xs[i] for i in ok])
        truncated = [fr == "length" for fr in finish_reasons] if finish_reasons is not None else [False] * n
        fmt = None
        rewards = [c.verifier_weight * v for v in pick(verifier)]
        if self._format is not None:
            fmt = [0.0 if truncated[i] else format_reward(self._format_target(responses[i]), self._format) for i in ok]
            rewards = [x + c.format_weight * f for x, f in zip(rewards, fmt)]
        if rm is not None:
            rewards = [x + c.model_weight * m for x, m in zip(rewards, pick(rm))]
            learned.update({"reward/model_mean": mean(pick(rm)), "reward/model_std": std(pick(rm))})
        if judged is not None:
            rewards = [x + c.judge.weight * j for x, j in zip(rewards, pick(judged))]
            learned.update({"reward/judge_mean": mean(pick(judged)), "reward/judge_malformed": float(sum(malformed))})
        if (self.moments is not None or c.clip is not None) and rewards:
            learned["reward/raw_mean"] = mean(rewards)
            with self._lock:  # (the moments frozen until the step ends: calls of a step in any grouping agree)
                if learn and self.moments is not None:
                    self._step_rewards += rewards
                out, norm = normalize_rewards(torch.tensor(rewards, dtype=torch.float64), self.moments, clip=c.clip)
            rewards = out.tolist()
            learned.update(norm)
        if errors:
            i, msg = errors[0]
            log.warning("reward: %d of %d rows raised in verifier %s and scored 0 (first: row %d: %s)",
                        len(errors), n, self.verifier_name, i, msg)
        metrics = {
            "reward/mean": mean(rewards),
            "reward/std": std(rewards),
            "reward/verifier_mean": mean(pick(verifier)),
            "reward/verifier_accuracy": mean([float(v >= CORRECT) for v in pick(verifier)]),
            "reward/errors": float(len(errors) + n - len(ok)),  # built-in verifier rows scored 0, failed rows
        }
        if fmt is not None:
            metrics["reward/format_mean"] = mean(fmt)
        metrics.update(learned)
        if finish_reasons is not None:
            metrics["reward/truncated_frac"] = mean([float(truncated[i]) for i in ok])
        full = [math.nan] * n  # reward.on_error=drop_group: the rows a source failed on stay NaN
        for i, r in zip(ok, rewards):
            full[i] = r
        rewards = full
        each = [xs if r == r else [math.nan] * len(xs) for xs, r in zip(each, rewards)]
        if len(self._user) > 1:  # (each function's mean and std over the rows it scored, of those kept)
            metrics.update(fn_metrics(each, self.fn_names))
        metrics["reward/score_time_s"] = time.perf_counter() - t0
        return rewards, metrics, each

    def fold_moments(self) -> None:
        """Between two steps (``reward.normalize=running``): the rewards the step scored, in any number of
        calls, join :attr:`moments` in one update (in sorted order, so how the calls split them and the order
        they finished in do not change a bit); the next step is whitened by them. Call it when no call of the
        step is left and none of the next has begun."""
        with self._lock:
            if self.moments is not None:
                self.moments.update(torch.tensor(self._step_rewards, dtype=torch.float64))
            self._step_rewards = []

    def folded_moments(self) -> dict[str, float] | None:
        """The state :attr:`moments` will have after :meth:`fold_moments` (a checkpoint's; None without
        ``reward.normalize``), the moments left as they are."""
        with self._lock:
            if self.moments is None:
                return None
            after = RunningMoments(**self.moments.state())
            after.update(torch.tensor(self._step_rewards, dtype=torch.float64))
            return after.state()

    def load_moments(self, state: dict[str, float]) -> None:
        """A checkpoint's :meth:`folded_moments` back: the moments, and no rewards of a step under way."""
        with self._lock:
            if self.moments is not None:
                self.moments.load(state)
            self._step_rewards = []

    def score_async(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
        finish_reasons: Sequence[str] | None = None,
        columns: Columns | None = None,
    ) -> Future:
        """Run :meth:`score` on a background thread; the Future resolves to ``(rewards, metrics)``.

        The inputs are copied before returning, so the caller may reuse its lists.
        Batches submitted in order are scored in order (one driver thread).
        """
        if self._closed:
            raise RuntimeError("RewardEngine.score_async after close()")
        if self._driver is None:
            self._driver = ThreadPoolExecutor(1, thread_name_prefix="reward-driver")
        args = (list(prompts), list(responses), list(answers), None if finish_reasons is None else list(finish_reasons),
                None if columns is None else list(columns))
        return self._driver.submit(self.score, *args)

    def close(self) -> None:
        """Wait for pending async scoring and stop the threads."""
        self._closed = True
        for pool in (self._driver, self._pool):
            if pool is not None:
                pool.shutdown(wait=True)

    def __enter__(self) -> "RewardEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers
    def _check_inputs(self, prompts, responses, answers, finish_reasons, columns=None) -> int:
        return check_inputs(prompts, responses, answers, finish_reasons, columns,
                            verifier=None if self._user else self.verifier_name)

    @staticmethod
    def _rows(columns: Columns | None, n: int) -> list:
        return [None] * n if columns is None else list(columns)

    def _format_target(self, response: str) -> str:
        return response.split("\n", 1)[0].strip() if self._format_on == "answer" else response

    def _on_rows(self, fn: Scorer, what: str, before: list[float], prompts: list[str], responses: list[str],
                 answers: list, columns: list) -> list[float]:
        """:func:`~relayrl.engines.reward.calls.on_rows` under ``reward.on_error``."""
        return on_rows(fn, what, self.cfg.on_error, before, prompts, responses, answers, columns)

    def _user_scores(self, prompts: list[str], responses: list[str], answers: list, columns: list,
                     extra: ExtraLog | None = None) -> tuple[list[float], dict[str, float], list[list[float]]]:
        """The user functions' weighted sum per row (NaN where one failed: ``drop_group``), what they reported
        (``reward/user/NAME``), and each row's score by each function (NaN for ``None``). A function's ``None``
        for a row (TRL's "not this function's row") adds nothing to it; a row no function scores gets 0, said
        once."""
        n = len(responses)
        total, scored, metrics, each = [0.0] * n, [False] * n, {}, [[] for _ in range(n)]
        logged: dict[str, list[float]] = {}
        for u in self._user:
            got = guarded(partial(self._user_once, u, logged, extra), "the function", self.cfg.on_error, prompts,
                          responses, answers, list(enumerate(columns)))  # (each row with its index: log_extra's rows)
            total = [t if x is None else t + u.weight * x for t, x in zip(total, got)]  # (NaN stays NaN)
            scored = [s or x is not None for s, x in zip(scored, got)]
            for xs, x in zip(each, got):
                xs.append(math.nan if x is None else x)
        metrics.update({f"reward/user/{k}": mean(v) for k, v in logged.items() if v})
        unscored = scored.count(False)
        if unscored and not self._said_unscored:
            self._said_unscored = True
            log.warning("reward: %d of %d rows have no score: every reward function returned None for them (first: "
                        "prompt %r); they score 0 (said once)", unscored, len(scored),
                        prompts[scored.index(False)][:200])
        return total, metrics, each

    def _user_once(self, u: UserFn, logged: dict[str, list[float]], extra: ExtraLog | None, prompts: list[str],
                   responses: list[str], answers: list[str | None], rows: list[tuple[int, dict | None]]) -> list[float]:
        """One call of ``u`` on the rows (``(index in the batch, columns)`` each); what it reports (``log_metric``,
        a verl dict's other keys) is added to ``logged`` (name -> values), what it logs per row (``log_extra``) to
        ``extra`` once the call succeeds."""
        name = u.path  # as configured (a file path is absolute since the config loaded)
        limit = None if self.cfg.timeout_s is None else self.cfg.timeout_s * len(set(prompts))
        indexes, columns = [i for i, _ in rows], [c for _, c in rows]
        args, kwargs = u.shape.arguments(prompts, responses, answers, columns)
        extras = (extra or ExtraLog(0)).call(len(responses))
        self._check_fields(u, columns, kwargs)

        def log_metric(key: str, value: float) -> None:
            logged.setdefault(str(key), []).append(float(value))

        try:
            result = self._within(limit, u.shape.call, u.fn, args, kwargs, log_metric, extras.log, name=name)
        except StopRun:
            raise
        except ExtraError as e:  # (the function's bug, not a row's: no retry per prompt, whatever reward.on_error)
            raise StopRun(f"reward function {name} {e}") from None
        except RewardError as e:  # a result the call's shape cannot read (a verl dict without "score")
            raise RewardError(f"reward function {name} {e}") from None
        except Overtime:
            raise RewardError(f"reward function {name} ran past reward.timeout_s={self.cfg.timeout_s:g} "
                              f"({limit:g} s for the {len(set(prompts))} prompt(s) of the call)") from None
        except Exception as e:
            raise RewardError(f"reward function {name} raised {type(e).__name__}: {e}") from e
        if extras.error is not None:  # (a breach the function caught and went on from)
            raise StopRun(f"reward function {name} {extras.error}")
        scores = check_rewards(result, len(responses), name, none_ok=True)
        if extra is not None:
            extra.add(indexes, extras)
        return scores

    def _within(self, limit: float | None, fn: Callable, *args, name: str):
        """``fn(*args)`` within ``limit`` seconds (:func:`call_within`; ``None``: on this thread, no limit);
        refuses once ``MAX_ABANDONED`` abandoned calls are alive (module docstring)."""
        if limit is None:
            return fn(*args)
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            if len(self._abandoned) >= MAX_ABANDONED:
                raise TooManyHung(f"{len(self._abandoned)} calls of reward function {name} "
                                  f"are still running past reward.timeout_s={self.cfg.timeout_s:g}: it hangs (each "
                                  f"hung call holds a thread); fix the function or raise reward.timeout_s")
        try:
            return call_within(limit, fn, *args)
        except Overtime as e:
            with self._lock:
                self._abandoned.append(e.thread)
            raise

    @property
    def fn_names(self) -> list[str]:  # (in reward.user_fn's order, each's)
        return [u.name for u in self._user]  # (reward/fn/NAME_*)

    @property
    def fields_needed(self) -> frozenset[str]:
        """The dataset fields the user functions cannot do without (TRL's shape: parameters without a
        default)."""
        return frozenset(k for u in self._user for k in u.shape.required)

    def check_fields(self, columns: Columns) -> None:
        """Raise :class:`RewardError` when a user function needs a field (a parameter without a default: TRL's
        shape) that the rows ``columns`` lack; warn once for a named field with a default that they lack. A run
        calls it on its first rows before it starts; each call checks its own."""
        n = len(columns)
        for u in self._user:
            self._check_fields(u, columns, u.shape.arguments([""] * n, [""] * n, [None] * n, columns)[1])

    def check_standalone(self) -> None:
        """Raise :class:`RewardError` when a user function needs what only a training run gives (``relayrl eval``)."""
        if (why := standalone_refusal(self._user)) is not None:
            raise StopRun(why)

    def _check_fields(self, u: UserFn, columns: Columns, kwargs: dict) -> None:
        present = ", ".join(dict.fromkeys(k for c in columns if c for k in c if k != "completion_ids")) or \
            "none: a built-in task's rows"
        missing = sorted(u.shape.required - set(kwargs))
        if missing:
            raise StopRun(f"reward function {u.path} needs the dataset field(s) {', '.join(missing)}, which the "
                          f"rows lack (fields: {present}); rename the parameter after a field they have, give it a "
                          f"default, or use a dataset with that column")
        unmet = sorted(k for k in (u.shape.takes or frozenset()) - set(kwargs) - CALL_ARGS
                       if (u.path, k) not in self._unmet)
        if unmet:
            self._unmet.update((u.path, k) for k in unmet)
            log.warning("reward function %s takes %s, but the rows scored have no such field: it gets its default "
                        "(fields: %s)", u.path, ", ".join(unmet), present)

    def _rm_once(self, prompts: list[str], responses: list[str], answers: list, columns: list) -> list[float]:
        return model_scores(self.reward_model, f"reward model {self.cfg.model}", prompts, responses, columns)

    def _judge_once(self, prompts: list[str], responses: list[str], answers: list, columns: list, *,
                    malformed: list[int]) -> list[float]:
        """The judge's scores; the count of malformed verdicts (scored ``malformed_score``) into ``malformed``."""
        return judge_scores(self._judge, f"LLM judge {self.cfg.judge.path or 'judge_ask'}", prompts, responses,
                            answers, malformed=malformed)

    def _score_rows(self, responses: list[str], answers: list[str]) -> tuple[list[float], list[tuple[int, str]]]:
        return verifier_rows(self._row_fn, self._pool, self.cfg.workers, responses, answers)
