"""A GRPO-family step's metrics from what its stages gathered (:class:`~relayrl.workflows.state.StepState`)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Mapping

import torch

from relayrl.engines.reward.verifiers import CORRECT
from relayrl.environments.episodes import episode_metrics
from relayrl.workflows.episodes import log_episode_errors
from relayrl.workflows.state import StepState

__all__ = ["sample_metrics", "step_metrics", "add_call_metrics", "staleness_metrics", "kl_metrics", "weighted", "step_tokens",
           "mismatch_warning", "MISMATCH_WARN"]

COUNTS = ("reward/errors", "reward/judge_malformed")
"""Reward metrics that count rows: a step reports the sum over its scoring calls (the others: a mean by rows)."""

RUNNING = ("reward/norm_mean", "reward/norm_std")
"""The moments a step's rewards are whitened by (``reward.normalize=running``: the earlier steps'), the same in
every call of the step; not of a call's rows."""


def _pooled(key: str, metrics: Mapping[str, float]) -> bool:
    """Whether ``key`` is a std over a call's rows with its mean beside it (``reward/model_std``,
    ``reward/fn/NAME_std``): the step's is pooled from its calls' (:func:`add_call_metrics`)."""
    return key.endswith("_std") and key not in RUNNING and key[:-3] + "mean" in metrics


def add_call_metrics(calls: dict[str, list[tuple[float, int]]], metrics: Mapping[str, float], scored: int,
                     rows: Mapping[str, int] | None = None) -> None:
    """Gather one scoring call's reward ``metrics`` into ``calls`` (name -> ``(value, rows)`` per call), each
    weighed by the rows it is over (``rows``, else the ``scored`` rows). A std beside its mean is gathered as
    the rows' mean square, so that the step's std is over all its rows (:func:`step_metrics`): a mean of the
    calls' stds is not (a call of one row, ``reward.stream=sample``, has std 0)."""
    rows = rows or {}
    for k, v in metrics.items():
        if _pooled(k, metrics):
            v = v * v + metrics[k[:-3] + "mean"] ** 2
        calls.setdefault(k, []).append((v, rows.get(k, scored)))


def sample_metrics(scores: torch.Tensor, rewards: torch.Tensor, lengths: torch.Tensor,
                   truncated: torch.Tensor) -> dict[str, float]:
    """A step's reward, accuracy and response-length metrics from its samples' verifier ``scores``, shaped
    ``rewards``, response ``lengths`` and ``truncated`` flags (cut at max_new_tokens)."""
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "train/accuracy": float((scores >= CORRECT).float().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        **dict(zip(("response/length_p10", "response/length_p50", "response/length_p90"),
                   torch.quantile(lengths.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist())),
        "response/clip_ratio": float(truncated.float().mean()),
    }


def weighted(calls: dict[str, list[tuple[float, int]]]) -> dict[str, float]:
    """Metrics gathered per call as ``(value, rows)``: the row-weighted mean, or the largest value for names
    ending in ``_max`` (a step whose advantages are computed group by group reports the whole batch). Summed in
    sorted order: the calls finish in any order, and a resumed run reproduces the metrics bit for bit."""
    return {k: max(v for v, _ in vs) if k.endswith("_max") else _mean_by_rows(vs) for k, vs in calls.items()}


def _mean_by_rows(calls: list[tuple[float, int]]) -> float:
    """The row-weighted mean of ``(value, rows)`` calls, the same in any order they came in."""
    calls = sorted(calls)
    return sum(v * w for v, w in calls) / max(1, sum(w for _, w in calls))


def kl_metrics(metrics: dict[str, float], in_reward: dict[str, float], tri_model: bool) -> dict[str, float]:
    """``metrics`` with the step's KL-in-reward metrics, ``actor/kl`` and the tri-model's saved passes."""
    metrics.update(in_reward)
    if tri_model:  # each in-place reference pass replaces one a reference group would run separately
        metrics["trimodel/separate_passes_saved"] = metrics.get("actor/ref_forward_passes", 0.0)
    if "actor/ref_kl_k1" in metrics:
        metrics["actor/kl"] = metrics["actor/ref_kl_k1"]
    return metrics


def step_metrics(st: StepState, *, step: int, prompts_per_step: int, tri_model: bool,
                 session) -> dict[str, float]:
    """Reward, length, interruption, DAPO, ReMax, episode, advantage, update and KL metrics of a finished step;
    says in the run's log when dynamic sampling left nothing to train on (``dapo/skipped_step``)."""
    records = st.kept_records()
    lengths = torch.tensor([L for r in records for L in r.lengths], dtype=torch.float32)
    truncated = torch.tensor([t for r in records for t in r.truncated], dtype=torch.float32)
    m: dict[str, float] = {k: _mean_by_rows(vs) for k, vs in st.reward_metrics.items()}
    for k in [k for k in m if _pooled(k, m)]:  # (gathered as mean squares: add_call_metrics)
        m[k] = math.sqrt(max(0.0, m[k] - m[k[:-3] + "mean"] ** 2))
    for k in COUNTS:  # counts of the step's calls add up
        if k in st.reward_metrics:
            m[k] = sum(sorted(v for v, _ in st.reward_metrics[k]))
    # dynamic sampling's record (without it: nothing dropped, one round)
    m.update({"dapo/dropped_groups": float(len(st.dropped)), "dapo/sampled_groups": float(st.judged),
              "dapo/rounds": float(st.rounds), "dapo/missing_prompts": float(max(0, prompts_per_step - st.kept)),
              "rollout/errors": float(st.rollout_errors)})
    if st.filtered_rewards:  # (sorted: groups are judged in any order)
        m["dapo/dropped_reward_mean"] = sum(sorted(st.filtered_rewards.values())) / len(st.filtered_rewards)
    if st.baselines:
        m["remax/baseline_mean"] = sum(sorted(st.baselines)) / len(st.baselines)
    episodes = [e for r in st.records for e in r.episodes]  # every episode generated, dropped groups too
    if episodes:
        log_episode_errors(session, episodes, step)
        m.update(episode_metrics(episodes))
    interrupted = [x for r in records for x in r.interrupted]  # (rollout.interrupt: every row has its flag)
    if interrupted:
        m["rollout/interrupted_frac"] = sum(interrupted) / len(interrupted)
    if st.scores:  # (sorted: the rows come in the order their groups were judged)
        scores = torch.tensor(sorted(st.scores), dtype=torch.float64)
        rewards = torch.tensor(sorted(st.rewards), dtype=torch.float64)
        m.update(sample_metrics(scores, rewards, lengths, truncated))
    else:  # no sample to train on: no reward/mean (the scorer's is every row's, before the overlong shaping)
        for k in ("reward/mean", "reward/std"):
            m.pop(k, None)
        m["dapo/skipped_step"] = 1.0
        if m.get("reward/errors", 0) or st.rollout_errors or m.get("env/errors", 0):  # *.on_error=drop_group
            session.tracker.write_text(f"step {step}: every group was dropped (failures under *.on_error=drop_group: "
                                       f"rollout/errors {st.rollout_errors:g}, reward/errors "
                                       f"{m.get('reward/errors', 0):g}, env/errors {m.get('env/errors', 0):g}; or "
                                       f"equal rewards); no update this step")
        else:  # every group was uniform in every round: nothing to learn from this step
            session.tracker.write_text(f"step {step}: dynamic sampling found no group with differing rewards in "
                                       f"{st.rounds} rounds; no update this step (raise "
                                       f"algorithm.max_resample_rounds or data.prompts_per_step)")
    m.update(st.advantages.metrics())
    m.update(st.update)
    return kl_metrics(m, weighted(st.kl), tri_model)


def step_tokens(st: StepState) -> int:
    """Prompt + generated tokens of the samples the step trains on (``perf/tokens``)."""
    return sum(r.prompt_len * len(r.lengths) + sum(r.lengths) for r in st.kept_records())


def staleness_metrics(versions: list[dict[int, int]], step: int, k: int) -> dict[str, float]:
    """The token staleness of a batch trained at ``step`` (by weights ``step-1``).

    Args:
        versions: per sample, ``{weight version: tokens it sampled}``.
    Returns ``async/staleness_mean`` and ``_max`` over tokens, ``async/tokens_stale_<s>`` for ``s`` in
    ``0..k``, and ``async/multi_version_frac``; raises when a token is staler than ``k`` (the bound is
    broken: a bug, never trained on silently)."""
    counts: Counter = Counter()
    for row in versions:
        for v, c in row.items():
            counts[step - 1 - int(v)] += int(c)
    tokens = sum(counts.values())
    worst = max(counts) if counts else 0
    if worst > k or (counts and min(counts) < 0):
        raise RuntimeError(f"step {step}: tokens sampled by weight versions {sorted(step - 1 - s for s in counts)} "
                           f"break the staleness bound k={k} (trainer weights {step - 1})")
    m = {"async/staleness_mean": sum(s * c for s, c in counts.items()) / max(1, tokens),
         "async/staleness_max": float(worst),
         "async/multi_version_frac": sum(len(r) > 1 for r in versions) / max(1, len(versions))}
    m.update({f"async/tokens_stale_{s}": float(counts.get(s, 0)) for s in range(k + 1)})
    return m


MISMATCH_WARN = 1.1
"""``rollout/logprob_error`` above which an on-policy step is reported: NeMo RL calls for a look above about 1.05;
float32 runs here measure 1.000 and bf16 ones about 1.01 to 1.05."""


def mismatch_warning(metrics: dict[str, float], step: int) -> str | None:
    """A line to print when step ``step``'s generator and trainer disagree on the log-probs of tokens sampled with
    the trainer's own weights (``async/staleness_max`` 0, or no staleness metric: an on-policy step); None
    otherwise. Off-policy tokens differ by design and are not reported, nor is NaN (weights gone non-finite: the
    step's update check stops the run or skips it, ``run.on_nonfinite``)."""
    err = metrics.get("rollout/logprob_error")
    if err is None or err != err or err <= MISMATCH_WARN or metrics.get("async/staleness_max", 0.0) > 0:
        return None
    return (f"relayrl: warning: step {step}: rollout/logprob_error={err:.3g} (worst token "
            f"{metrics.get('rollout/logprob_error_max', float('nan')):.3g}) on tokens sampled with the trainer's own "
            f"weights: the generator and the trainer compute different distributions (their dtypes: rollout.dtype; "
            f"an engine's log-prob mode; a model or weights the engine does not load as the trainer has them). "
            f"Ratios and KL terms are off by as much; docs/errors.md lists the causes (said once per run)")
