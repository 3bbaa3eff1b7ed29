"""How the reward engine (:class:`~relayrl.engines.reward.engine.RewardEngine`) calls each source of a reward,
and what it does when one fails: the inputs checked, the built-in verifiers' rows spread over threads, the reward
model's and the judge's calls with their contract checked, and the failure policy.

A verifier that raises on one row scores that row 0 and counts it in ``reward/errors``: model output is untrusted
text and one odd response must not stop a run. A *user function*, a *reward model* or an *LLM judge* that raises
or breaks its contract on a batch (wrong length, non-numeric, NaN; a user function that runs past
``reward.timeout_s``; a judge verdict with no valid score when ``reward.judge.malformed_score`` is null) is called
again once per prompt (the rows sharing a prompt text: a group), so the failure names its prompt (:func:`guarded`);
then ``reward.on_error`` decides: ``fail`` raises :class:`RewardError` naming the prompt and the cause,
``drop_group`` scores those rows NaN (the score stage drops their group; evaluation scores them 0 with a warning)
and counts them in ``reward/errors``. No failed call becomes a reward. A failure no prompt alone causes
(:class:`StopRun`) stops the run whatever ``reward.on_error`` says.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from relayrl.engines.reward.config import RewardError
from relayrl.engines.reward.judge import JudgeError
from relayrl.engines.reward.user import check_rewards
from relayrl.models.reward import scored_prompts

__all__ = ["Columns", "Scorer", "StopRun", "TooManyHung", "check_inputs", "guarded", "judge_scores", "mean",
           "model_scores", "on_rows", "std", "verifier_rows"]

log = logging.getLogger("relayrl.engines.reward.engine")  # (the engine's warnings, under the engine's name)

Scorer = Callable[[list[str], list[str], list, list], list[float]]
"""One source of a reward (the user function, the reward model, the judge): finite scores of the rows
``(prompts, responses, answers, columns)``, or :class:`RewardError`."""

Columns = Sequence["dict | None"]
"""Each row's dataset fields, its prompt under ``"prompt"`` (``Problem.meta["fields"]``; ``None``: none, as a built-in
task's rows), for a user function."""


class StopRun(RewardError):
    """A failure no prompt alone causes: the run stops whatever ``reward.on_error`` says (no retry per prompt)."""


class TooManyHung(StopRun):
    """More than ``MAX_ABANDONED`` calls of the user function run past the time limit."""


def check_inputs(prompts, responses, answers, finish_reasons, columns, *, verifier: str | None) -> int:
    """The rows' count, once the columns agree in length and hold what the engine reads; else
    :class:`RewardError` naming the column and row. ``verifier``: the built-in verifier's name, whose answers
    must be strings (``None``: user functions, which take any ground truth)."""
    n = len(responses)
    lengths = {"prompts": len(prompts), "responses": n, "answers": len(answers)}
    if finish_reasons is not None:
        lengths["finish_reasons"] = len(finish_reasons)
    if columns is not None:
        lengths["columns"] = len(columns)
        for i, c in enumerate(columns):
            if c is not None and not isinstance(c, dict):
                raise RewardError(f"columns[{i}] is {type(c).__name__}; expected a dict of the row's fields, "
                                  f"or None")
    if len(set(lengths.values())) > 1:
        raise RewardError(f"reward inputs differ in length: {lengths}")
    for i, r in enumerate(responses):
        if not isinstance(r, str):
            raise RewardError(f"responses[{i}] is {type(r).__name__}, expected str (decoded text)")
    if verifier is not None:
        for i, a in enumerate(answers):
            if not isinstance(a, str):
                raise RewardError(
                    f"answers[{i}] is {type(a).__name__}; verifier {verifier!r} needs a ground-truth string"
                )
    if finish_reasons is not None:
        for i, fr in enumerate(finish_reasons):
            if fr not in ("stop", "length"):
                raise RewardError(f"finish_reasons[{i}] is {fr!r}; expected 'stop' or 'length'")
    return n


def guarded(fn: Scorer, what: str, on_error: str, prompts: list[str], responses: list[str], answers: list,
            columns: list) -> list[float]:
    """``fn``'s scores of the rows; a call that fails is made again per prompt (module docstring): NaN for
    the rows of a prompt it fails on with ``reward.on_error=drop_group`` (``on_error``), else :class:`RewardError`
    naming the prompt (``what``: the source, for the fix)."""
    try:
        return fn(prompts, responses, answers, columns)
    except StopRun:
        raise
    except RewardError as failed:
        if len(set(prompts)) == 1:  # (one prompt: nothing narrower to call)
            return _failed(failed, what, on_error, prompts[0], len(prompts))
        out, dropped = [math.nan] * len(prompts), 0
        for p in dict.fromkeys(prompts):
            rows = [i for i, q in enumerate(prompts) if q == p]
            try:
                got = fn([p] * len(rows), [responses[i] for i in rows], [answers[i] for i in rows],
                         [columns[i] for i in rows])
            except StopRun:
                raise
            except RewardError as e:
                _failed(e, what, on_error, p, len(rows))
                dropped += 1
                continue
            for i, v in zip(rows, got):
                out[i] = v
        if not dropped and on_error == "fail":
            raise failed  # the batch failed, no prompt alone did: nothing narrower to name
        return out


def _failed(e: RewardError, what: str, on_error: str, prompt: str, rows: int) -> list[float]:
    """A source failed on the rows of one prompt: :class:`RewardError` naming it (``reward.on_error=fail``),
    or NaN for its rows, with a warning (``drop_group``)."""
    if on_error == "fail":
        raise RewardError(f"{e}, scoring the responses to prompt {prompt[:200]!r}; fix {what}, or set "
                          f"reward.on_error=drop_group to drop such a prompt's group from its step (counted in "
                          f"reward/errors)") from None
    log.warning("reward: %s, scoring the responses to prompt %r; their rows are NaN (the step drops the group: "
                "reward.on_error=drop_group)", e, prompt[:200])
    return [math.nan] * rows


def on_rows(fn: Scorer, what: str, on_error: str, before: list[float], prompts: list[str], responses: list[str],
            answers: list, columns: list) -> list[float]:
    """:func:`guarded` on the rows an earlier source did not fail on (``before`` not NaN); NaN elsewhere."""
    rows = [i for i, v in enumerate(before) if v == v]
    out = [math.nan] * len(before)
    if rows:
        got = guarded(fn, what, on_error, [prompts[i] for i in rows], [responses[i] for i in rows],
                      [answers[i] for i in rows], [columns[i] for i in rows])
        for i, v in zip(rows, got):
            out[i] = v
    return out


def model_scores(scorer, name: str, prompts: list[str], responses: list[str], columns: list) -> list[float]:
    """The reward model ``scorer``'s scores of the rows (``name``: the model, in errors)."""
    try:
        result = scorer.score(scored_prompts(prompts, columns), responses)
    except Exception as e:
        raise RewardError(f"{name} raised {type(e).__name__}: {e}") from e
    return check_rewards(result, len(responses), name, what="")


def judge_scores(judge, name: str, prompts: list[str], responses: list[str], answers: list, *,
                 malformed: list[int]) -> list[float]:
    """The judge's scores; the count of malformed verdicts (scored ``malformed_score``) into ``malformed``."""
    try:
        scores, bad = judge.score(prompts, responses, answers)
    except JudgeError as e:
        raise RewardError(f"{name}: {e}") from None
    except Exception as e:
        raise RewardError(f"{name} raised {type(e).__name__}: {e}") from e
    scores = check_rewards(scores, len(responses), name, what="")
    malformed.append(bad)
    return scores


def _verify_chunk(row_fn: Callable[[str, str], float], responses: list[str], answers: list[str], start: int,
                  stop: int):
    scores, errors = [], []
    for i in range(start, stop):
        try:
            v = float(row_fn(responses[i], answers[i]))
            if not math.isfinite(v):
                raise ValueError(f"verifier returned {v}")
        except Exception as e:  # untrusted model output: score 0, count, go on
            v = 0.0
            errors.append((i, f"{type(e).__name__}: {e}"))
        scores.append(v)
    return scores, errors


def verifier_rows(row_fn: Callable[[str, str], float], pool: ThreadPoolExecutor | None, workers: int,
                  responses: list[str], answers: list[str]) -> tuple[list[float], list[tuple[int, str]]]:
    """A row-wise verifier's score of each row (0 where it raised or returned a non-finite number) and those
    rows' ``(index, error)``; over ``pool``'s ``workers`` threads in contiguous chunks when there is one."""
    n = len(responses)
    if pool is None or n < 2:
        return _verify_chunk(row_fn, responses, answers, 0, n)
    size = max(1, math.ceil(n / (workers * 4)))  # a few chunks per worker to even out slow rows
    futures = [pool.submit(_verify_chunk, row_fn, responses, answers, s, min(n, s + size)) for s in range(0, n, size)]
    scores: list[float] = []
    errors: list[tuple[int, str]] = []
    for f in futures:
        s, e = f.result()
        scores += s
        errors += e
    return scores, errors


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def std(xs: Sequence[float]) -> float:
    if not xs:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
