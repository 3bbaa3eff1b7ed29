"""Driver-side calls for multi-turn episodes: roll out a step's episodes, evaluate with episodes.

The rollout group runs the episodes (``RolloutWorker.run_episodes``, each rank a contiguous slice of the
problems; the lists are concatenated in rank order). An episode becomes a :class:`Completion` whose
response is every token after the prompt (model turns and observations) with its ``loss_mask``, so the
rest of the GRPO step (dock, advantages, update) is the single-turn one with one more column.
"""

from __future__ import annotations

from typing import Sequence

import torch

from relayrl.config.schema import Config
from relayrl.data.tasks import Problem
from relayrl.engines.generation.base import Completion, SamplingParams
from relayrl.engines.reward.verifiers import CORRECT
from relayrl.environments.base import Episode, EpisodeEnd, EpisodeSummary
from relayrl.environments.config import EpisodeSpec, build_env_factory
from relayrl.environments.episodes import episode_metrics
from relayrl.evaluation.metrics import budgets, per_source, source_names, summarize
from relayrl.evaluation.runner import EvalResult, as_read, eval_params, sampling_record
from relayrl.workflows.rollout_worker import RolloutWorker

__all__ = ["episode_spec", "rollout_episodes", "evaluate_episodes", "log_episode_errors"]

MAX_ERROR_LINES = 5
"""Environment errors written to the run's log per call (all of them are counted in ``env/errors``)."""


def episode_spec(cfg: Config, tokenizer=None) -> EpisodeSpec | None:
    """The run's episode spec (None for single-turn runs), its environment's contract checked now (with the
    run's ``tokenizer``: its chat template for ``env.tool_results=chat``), before any worker starts
    generating."""
    if not cfg.env.enabled:
        return None
    d = cfg.data
    spec = EpisodeSpec(cfg.env, cfg.reward, d.task, dict(d.task_options), dict(d.chat_template_kwargs))
    build_env_factory(spec, tokenizer)
    return spec


def rollout_episodes(rollout, s, problems: Sequence[Problem], params: SamplingParams, spec: EpisodeSpec,
                     step: int) -> tuple[list[Completion], list[float], dict[str, float]]:
    """``params.n`` episodes per problem: (completions with loss masks, episode rewards, ``env/*`` metrics)."""
    eps: list[Episode] = rollout.split(RolloutWorker.run_episodes,
                                       [(i, s.encode(p), p) for i, p in enumerate(problems)], params, spec)
    log_episode_errors(s, eps, step)
    return [e.completion(s.tokenizer) for e in eps], [e.reward for e in eps], episode_metrics(eps)


def evaluate_episodes(rollout, s, spec: EpisodeSpec, step: int | None) -> dict[str, float]:
    """Greedy episodes on the held-out problems: ``eval/accuracy`` (reward >= 1) and the ``eval/env/*``
    metrics (tool-call rate, turns); with ``eval.k > 1`` also ``k`` sampled episodes per problem for
    ``eval/pass@k`` and ``eval/avg@k``; a report with every episode (``s.report``: under ``RUN_DIR/eval`` in
    training, ``--out`` for ``relayrl eval``); with several sources among the problems every metric also as
    ``eval/<metric>/<source>`` (:func:`~relayrl.evaluation.metrics.per_source`). ``s``: an
    :class:`~relayrl.workflows.heldout.EvalSession`; ``step``: the training step (None outside training)."""
    ro, ev = s.cfg.rollout, s.cfg.eval
    problems = s.eval_problems
    greedy, sampled = eval_params(max_new_tokens=ev.max_new_tokens or ro.max_new_tokens, k=ev.k,
                                  temperature=s.eval_temperature, top_p=ev.top_p, top_k=ev.top_k, min_p=ev.min_p,
                                  stop_strings=ro.stop_strings)
    runs = [("greedy", greedy)] + ([(f"sample@{ev.k}", sampled)] if sampled is not None else [])
    samples: list[dict] = []
    by_mode: dict[str, list[Episode]] = {}
    sources = source_names([p.meta for p in problems])
    ids = [s.encode(p) for p in problems]

    def shown(t: list[int]) -> str:  # (a chat prompt as the model read it: as_read)
        return s.tokenizer.decode(t, skip_special_tokens=False)

    for mode, params in runs:
        eps = by_mode[mode] = rollout.split(RolloutWorker.run_episodes,
                                            [(i, ids[i], p) for i, p in enumerate(problems)], params, spec)
        log_episode_errors(s, eps, step)
        samples += [{"mode": mode, "prompt": problems[e.problem_index].prompt,
                     **as_read(problems[e.problem_index], ids[e.problem_index], shown),
                     "answer": problems[e.problem_index].answer,
                     "response": s.tokenizer.decode(e.token_ids, skip_special_tokens=True), "reward": e.reward,
                     "turns": e.turns, "tool_calls": e.tool_calls, "end": e.end.value if e.end else None,
                     "error": e.error, **({"source": sources[e.problem_index]} if len(set(sources)) > 1 else {})}
                    for e in eps]

    def metrics_of(rows: Sequence[int]) -> dict[str, float]:
        keep = set(rows)
        greedy_eps = [e for e in by_mode["greedy"] if e.problem_index in keep]
        rewards = torch.tensor([e.reward for e in greedy_eps], dtype=torch.float32)
        out = {"eval/accuracy": float((rewards >= CORRECT).float().mean()), "eval/reward_mean": float(rewards.mean())}
        out.update({f"eval/{k}": v for k, v in episode_metrics(greedy_eps).items()})
        if ev.k > 1:
            index = {i: j for j, i in enumerate(rows)}
            per_problem: list[list[bool]] = [[] for _ in rows]
            for e in by_mode[f"sample@{ev.k}"]:
                if e.problem_index in keep:
                    per_problem[index[e.problem_index]].append(e.reward >= CORRECT)
            out.update({f"eval/{k}": v for k, v in summarize(per_problem, ks=budgets(ev.k)).items()})
        return out

    metrics = metrics_of(range(len(problems)))
    metrics.update(per_source(sources, metrics_of))
    s.report(EvalResult(metrics, samples, sampling_record(greedy, sampled)), step)
    return metrics


def log_episode_errors(s, eps: Sequence[Episode | EpisodeSummary], step: int | None) -> None:
    """Write the first ``MAX_ERROR_LINES`` environment errors of a step (None: of an evaluation outside
    training) to the run's log (and how many more)."""
    errors = [e for e in eps if e.end is EpisodeEnd.ERROR]
    tracker = getattr(s, "tracker", None)
    at = "relayrl eval" if step is None else f"step {step}"
    for e in errors[:MAX_ERROR_LINES]:
        line = f"{at}: episode of problem {e.problem_index} ended with an environment error: {e.error}"
        tracker.write_text(line) if tracker is not None else s.log(line)
    if len(errors) > MAX_ERROR_LINES:
        line = f"{at}: {len(errors) - MAX_ERROR_LINES} more episodes ended with environment errors"
        tracker.write_text(line) if tracker is not None else s.log(line)
