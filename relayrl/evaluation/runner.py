"""Evaluation: greedy accuracy, pass@k and avg@k with the training verifiers.

The same function serves training runs (every ``eval.every`` steps, through
the rollout worker group) and ``relayrl eval`` (through an in-process engine):
it only needs a ``generate(prompt_ids, params)`` callable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from relayrl.data.tasks import Problem
from relayrl.engines.generation.base import Completion, SamplingParams
from relayrl.engines.reward.extra import OWN, ExtraLog, sample_fields
from relayrl.engines.reward.user import with_ids
from relayrl.engines.reward.verifiers import CORRECT
from relayrl.evaluation.metrics import budgets, per_source, source_names, summarize

__all__ = ["EvalResult", "eval_params", "sampling_record", "evaluate", "write_report", "as_read", "EVAL_OWN"]

GenerateFn = Callable[[list[list[int]], SamplingParams], list[Completion]]
ScoreFn = Callable[[list[str], list[str], list[str], list, ExtraLog], list[float]]
"""``score(prompts, responses, answers, columns, extra)``: a reward per row; ``columns`` holds each row's other
dataset fields (``Problem.meta["fields"]``: the row as it was, or ``None``) for a user reward function that takes
them; ``extra`` receives the columns the reward functions log per row (``log_extra``, a verl dict's keys beside
``"score"``: :mod:`relayrl.engines.reward.extra`), which each sample record then holds, as a training
sample does."""

EVAL_OWN = OWN | {"mode", "prompt_text", "answer", "finish_reason", "interrupted", "source"}
"""An evaluation sample's own fields: a logged column of one of these names is written ``extra_NAME``."""


@dataclass(frozen=True)
class EvalResult:
    metrics: dict[str, float]
    """``eval/accuracy`` (greedy), and with k > 1 ``eval/pass@1``, ``eval/pass@k``, ``eval/avg@k``; with more
    than one source among the problems each also as ``eval/<metric>/<source>``
    (:func:`~relayrl.evaluation.metrics.source_names`)."""
    samples: list[dict]
    """One record per sample: prompt, answer, response, reward, mode, and the columns its reward functions
    logged (``pred``)."""
    sampling: dict = field(default_factory=dict)
    """How the answers were generated (:func:`sampling_record`), written to the report beside the metrics."""


def sampling_record(greedy: SamplingParams, sampled: SamplingParams | None) -> dict:
    """An evaluation report's ``sampling`` entry: the answer length, ``k`` and, with ``k > 1``, the temperature
    and filters the k samples were drawn with (the greedy answer is unfiltered)."""
    out: dict = {"max_new_tokens": greedy.max_new_tokens, "k": 1 if sampled is None else sampled.n}
    if sampled is not None:
        out.update({key: getattr(sampled, key) for key in ("temperature", "top_p", "top_k", "min_p")})
    return out


def as_read(problem: Problem, ids: Sequence[int], decode: Callable[[list[int]], str] | None) -> dict[str, str]:
    """A sample record's ``prompt_text`` for a chat prompt (its ``prompt`` is the messages as ``role: content``
    lines): the prompt's token ids decoded by ``decode``, the chat template's special tokens kept, the text the
    model read; nothing for a plain-text prompt, or without ``decode``."""
    if decode is None or "messages" not in problem.meta:
        return {}
    return {"prompt_text": decode(list(ids))}


def eval_params(*, max_new_tokens: int, k: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                min_p: float = 0.0, stop_strings: Sequence[str] = ()) -> tuple[SamplingParams, SamplingParams | None]:
    """An evaluation's ``SamplingParams``: the greedy answer's (unfiltered) and, with ``k > 1``, the k samples'
    at ``temperature`` with the ``top_p`` / ``top_k`` / ``min_p`` filters (``eval.*``); else None. Both say
    ``logprobs=False``: evaluation never reads the response log-probs, so the vLLM engine may filter in either
    of its log-prob modes (:func:`~relayrl.engines.generation.vllm_sampling.sampling_refusal`)."""
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_strings=tuple(stop_strings),
                            logprobs=False)
    if k == 1:
        return greedy, None
    return greedy, greedy.model_copy(update={"n": k, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                                             "min_p": min_p})


def evaluate(generate: GenerateFn, encode: Callable[[Problem], list[int]], problems: Sequence[Problem],
             score: ScoreFn, *, max_new_tokens: int, k: int = 1, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, min_p: float = 0.0, stop_strings: Sequence[str] = (), interrupted: bool = False,
             decode: Callable[[list[int]], str] | None = None) -> EvalResult:
    """Greedy accuracy on ``problems``; with ``k > 1`` also k samples per prompt at ``temperature``, filtered by
    ``top_p`` / ``top_k`` / ``min_p`` (:func:`eval_params`); every metric also per source when the problems come
    from several (:func:`~relayrl.evaluation.metrics.per_source`). ``interrupted``: ``generate`` applies a
    thinking budget (``rollout.interrupt``): report ``eval/interrupted_frac``, the greedy answers it interrupted,
    and mark the samples. ``decode``: token ids to text with special tokens, for a chat prompt's ``prompt_text``
    (:func:`as_read`)."""
    if not problems:
        raise ValueError("evaluate: no problems to evaluate")
    prompts = [encode(p) for p in problems]
    answers = [p.answer for p in problems]
    texts = [p.prompt for p in problems]
    columns = [p.meta.get("fields") for p in problems]
    sources = source_names([p.meta for p in problems])
    named = len(set(sources)) > 1  # (then each sample says its source)
    greedy_params, sampled_params = eval_params(max_new_tokens=max_new_tokens, k=k, temperature=temperature,
                                                top_p=top_p, top_k=top_k, min_p=min_p, stop_strings=stop_strings)
    greedy = generate(prompts, greedy_params)
    g_log = ExtraLog(len(greedy))
    g_rewards = score(texts, [c.text for c in greedy], answers, with_ids(columns, [c.token_ids for c in greedy]),
                      g_log)
    samples = [{"mode": "greedy", "prompt": t, **as_read(problems[i], prompts[i], decode), "answer": a,
                "response": c.text, "reward": r,
                "finish_reason": c.finish_reason, **({"interrupted": c.interrupted} if interrupted else {}),
                **({"source": sources[i]} if named else {}), **sample_fields(x, EVAL_OWN)}
               for i, (t, a, c, r, x) in enumerate(zip(texts, answers, greedy, g_rewards, g_log.rows(len(greedy))))]
    per_prompt: list[list[bool]] = [[] for _ in problems]
    if sampled_params is not None:
        sampled = generate(prompts, sampled_params)
        s_log = ExtraLog(len(sampled))
        rewards = score([texts[c.prompt_index] for c in sampled], [c.text for c in sampled],
                        [answers[c.prompt_index] for c in sampled],
                        with_ids([columns[c.prompt_index] for c in sampled], [c.token_ids for c in sampled]), s_log)
        for c, r, x in zip(sampled, rewards, s_log.rows(len(sampled))):
            per_prompt[c.prompt_index].append(r >= CORRECT)
            samples.append({"mode": f"sample@{k}", "prompt": texts[c.prompt_index],
                            **as_read(problems[c.prompt_index], prompts[c.prompt_index], decode),
                            "answer": answers[c.prompt_index],
                            "response": c.text, "reward": r, "finish_reason": c.finish_reason,
                            **({"interrupted": c.interrupted} if interrupted else {}),
                            **({"source": sources[c.prompt_index]} if named else {}), **sample_fields(x, EVAL_OWN)})

    def metrics_of(rows: Sequence[int]) -> dict[str, float]:
        greedy_rewards = [g_rewards[i] for i in rows]
        out = {"eval/accuracy": sum(r >= CORRECT for r in greedy_rewards) / len(rows),
               "eval/reward_mean": sum(greedy_rewards) / len(rows)}
        if interrupted:
            out["eval/interrupted_frac"] = sum(greedy[i].interrupted for i in rows) / len(rows)
        if k > 1:
            summary = summarize([per_prompt[i] for i in rows], ks=budgets(k))
            out.update({f"eval/{key}": v for key, v in summary.items()})
        return out

    metrics = metrics_of(range(len(problems)))
    metrics.update(per_source(sources, metrics_of))
    return EvalResult(metrics, samples, sampling_record(greedy_params, sampled_params))


def write_report(result: EvalResult, out_dir: Path, *, name: str = "eval", extra: dict | None = None) -> tuple[Path, Path]:
    """``NAME.json`` (metrics, how the answers were sampled, ``extra``) and ``NAME_samples.jsonl`` (one readable
    record per sample)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / f"{name}.json"
    body = {"metrics": result.metrics, **({"sampling": result.sampling} if result.sampling else {}), **(extra or {})}
    report.write_text(json.dumps(body, indent=2) + "\n")
    samples = out_dir / f"{name}_samples.jsonl"
    with samples.open("w") as f:
        for s in result.samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    return report, samples
