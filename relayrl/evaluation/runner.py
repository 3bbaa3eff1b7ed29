"""Evaluation: greedy accuracy, pass@k and avg@k with the training verifiers.

The same function serves training runs (every ``eval.every`` steps, through
the rollout worker group) and ``relayrl eval`` (through an in-process engine):
it only needs a ``generate(prompt_ids, params)`` callable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from relayrl.data.tasks import Problem
from relayrl.engines.generation.base import Completion, SamplingParams
from relayrl.engines.reward.user import with_ids
from relayrl.evaluation.metrics import summarize

__all__ = ["EvalResult", "evaluate", "write_report"]

GenerateFn = Callable[[list[list[int]], SamplingParams], list[Completion]]
ScoreFn = Callable[[list[str], list[str], list[str], list], list[float]]
"""``score(prompts, responses, answers, columns)``: a reward per row; ``columns`` holds each row's other dataset
fields (``Problem.meta["fields"]``: the row as it was, or ``None``) for a user reward function that takes them."""


@dataclass(frozen=True)
class EvalResult:
    metrics: dict[str, float]
    """``eval/accuracy`` (greedy), and with k > 1 ``eval/pass@1``, ``eval/pass@k``, ``eval/avg@k``."""
    samples: list[dict]
    """One record per sample: prompt, answer, response, reward, mode."""


def evaluate(generate: GenerateFn, encode: Callable[[Problem], list[int]], problems: Sequence[Problem],
             score: ScoreFn, *, max_new_tokens: int, k: int = 1, temperature: float = 1.0,
             stop_strings: Sequence[str] = ()) -> EvalResult:
    """Greedy accuracy on ``problems``; with ``k > 1`` also k samples per prompt at ``temperature``."""
    if not problems:
        raise ValueError("evaluate: no problems to evaluate")
    prompts = [encode(p) for p in problems]
    answers = [p.answer for p in problems]
    texts = [p.prompt for p in problems]
    columns = [p.meta.get("fields") for p in problems]
    greedy = generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                                              stop_strings=tuple(stop_strings)))
    g_rewards = score(texts, [c.text for c in greedy], answers, with_ids(columns, [c.token_ids for c in greedy]))
    samples = [{"mode": "greedy", "prompt": t, "answer": a, "response": c.text, "reward": r,
                "finish_reason": c.finish_reason} for t, a, c, r in zip(texts, answers, greedy, g_rewards)]
    metrics = {"eval/accuracy": sum(r >= 1.0 for r in g_rewards) / len(problems),
               "eval/reward_mean": sum(g_rewards) / len(problems)}
    if k > 1:
        sampled = generate(prompts, SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens,
                                                   stop_strings=tuple(stop_strings)))
        rewards = score([texts[c.prompt_index] for c in sampled], [c.text for c in sampled],
                        [answers[c.prompt_index] for c in sampled],
                        with_ids([columns[c.prompt_index] for c in sampled], [c.token_ids for c in sampled]))
        per_prompt: list[list[bool]] = [[] for _ in problems]
        for c, r in zip(sampled, rewards):
            per_prompt[c.prompt_index].append(r >= 1.0)
            samples.append({"mode": f"sample@{k}", "prompt": texts[c.prompt_index], "answer": answers[c.prompt_index],
                            "response": c.text, "reward": r, "finish_reason": c.finish_reason})
        metrics.update({f"eval/{key}": v for key, v in summarize(per_prompt, ks=sorted({1, k})).items()})
    return EvalResult(metrics, samples)


def write_report(result: EvalResult, out_dir: Path, *, name: str = "eval", extra: dict | None = None) -> tuple[Path, Path]:
    """``NAME.json`` (metrics) and ``NAME_samples.jsonl`` (one readable record per sample)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / f"{name}.json"
    report.write_text(json.dumps({"metrics": result.metrics, **(extra or {})}, indent=2) + "\n")
    samples = out_dir / f"{name}_samples.jsonl"
    with samples.open("w") as f:
        for s in result.samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    return report, samples
