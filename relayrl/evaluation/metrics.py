"""Evaluation metrics over sampled answers: pass@k and avg@k.

Implements the unbiased pass@k estimator of Chen et al. 2021 ("Evaluating
Large Language Models Trained on Code", section 2.1): draw n >= k samples per
problem, count the c correct ones, and estimate the probability that at least
one of k samples is correct as

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over problems. The ratio of binomials is evaluated as the product
prod_{i = n-c+1}^{n} (1 - k / i), which stays accurate for large n and never
builds huge integers. avg@k (the DAPO paper's "avg@32") is the mean reward of
all k samples of a prompt, averaged over prompts; with 0/1 rewards it equals
pass@1.

Departure from the paper: none in the estimator; `summarize` additionally
requires every prompt to have the same number of samples so that the
`avg@n` key names one n.

Several held-out sources (verl's ``data.val_files`` list, or a dataset whose
rows carry different ``data_source`` values): `source_names` names each row's
source and `per_source` computes every metric again over each source's rows,
as ``<metric>/<source>`` (``eval/accuracy/gsm8k``), as verl reports its
validation metrics per ``data_source``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePath
from typing import Any

__all__ = ["pass_at_k", "avg_at_k", "budgets", "summarize", "source_names", "per_source"]

SOURCE_FIELD = "data_source"
"""The row field that names a row's source (verl's parquet column), before its file's name."""


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased estimate of pass@k for one problem (Chen et al. 2021).

    Args:
        num_samples: n, the number of samples drawn for the problem (n >= 1).
        num_correct: c, how many of them are correct (0 <= c <= n).
        k: the budget of attempts (1 <= k <= n).

    Returns:
        1 - C(n-c, k) / C(n, k), a float in [0, 1].
    """
    n, c = int(num_samples), int(num_correct)
    if n < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 0 <= c <= n:
        raise ValueError(f"num_correct must be in [0, num_samples={n}], got {num_correct}")
    if not 1 <= k <= n:
        raise ValueError(
            f"k must be in [1, num_samples={n}], got {k}; draw at least k samples per prompt"
        )
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    all_wrong = math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    return 1.0 - all_wrong


def avg_at_k(rewards_per_prompt: Sequence[Sequence[float]]) -> float:
    """Mean reward per prompt, averaged over prompts.

    Args:
        rewards_per_prompt: [P][k_p] rewards of the k_p samples of each of P
            prompts (k_p >= 1; prompts may have different k_p).

    Returns:
        mean_p(mean_j rewards_per_prompt[p][j]).
    """
    if len(rewards_per_prompt) == 0:
        raise ValueError("rewards_per_prompt is empty; need at least one prompt")
    total = 0.0
    for row, rewards in enumerate(rewards_per_prompt):
        if len(rewards) == 0:
            raise ValueError(f"rewards_per_prompt[{row}] has no samples")
        values = [float(r) for r in rewards]
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"rewards_per_prompt[{row}] contains a non-finite reward: {values}")
        total += sum(values) / len(values)
    return total / len(rewards_per_prompt)


def budgets(n: int) -> list[int]:
    """The pass@k budgets an evaluation of ``n`` samples per prompt reports: 1, the powers of two below ``n``, and
    ``n`` (n = 16: 1, 2, 4, 8, 16), so one run shows how pass@k grows with k (the ladder of n verl's validation metrics use)."""
    if n < 1:
        raise ValueError(f"n={n} samples per prompt; need n >= 1")
    return sorted({1 << i for i in range(n.bit_length()) if 1 << i < n} | {1, n})


def summarize(per_prompt_correct: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[str, float]:
    """pass@k for each k in `ks` (pass@1 always) and avg@n over a batch of prompts.

    Args:
        per_prompt_correct: [P][n] correctness of the n samples of each of P
            prompts; entries are bools or 0/1 integers, n equal for all rows.
        ks: budgets k to report, each 1 <= k <= n.

    Returns:
        {"pass@1": .., "pass@<k>": .. for k in ks, "avg@<n>": ..}, each the mean
        over prompts.
    """
    if len(per_prompt_correct) == 0:
        raise ValueError("per_prompt_correct is empty; need at least one prompt")
    n = len(per_prompt_correct[0])
    counts: list[int] = []
    for row, samples in enumerate(per_prompt_correct):
        if len(samples) != n:
            raise ValueError(
                f"per_prompt_correct[{row}] has {len(samples)} samples but row 0 has {n}; "
                "summarize needs the same number of samples for every prompt"
            )
        if n == 0:
            raise ValueError(f"per_prompt_correct[{row}] has no samples")
        for j, s in enumerate(samples):
            if s not in (0, 1):  # True/False compare equal to 1/0
                raise ValueError(
                    f"per_prompt_correct[{row}][{j}] = {s!r}; expected a bool or 0/1"
                )
        counts.append(sum(int(s) for s in samples))
    out: dict[str, float] = {}
    for k in sorted({1, *(int(k) for k in ks)}):
        if not 1 <= k <= n:
            raise ValueError(f"ks contains {k}, but each prompt has only n={n} samples; need 1 <= k <= n")
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
    out[f"avg@{n}"] = avg_at_k([[float(s) for s in samples] for samples in per_prompt_correct])
    return out


def source_names(metas: Sequence[Mapping[str, Any]]) -> list[str]:
    """The source of each row (a ``Problem.meta``): its ``data_source`` field (``meta["fields"]``) when it has
    one, else the stem of the file or dataset it came from (``meta["source"]``: ``test`` for
    ``gsm8k/test.parquet``). Files whose stems collide are named ``parent/stem`` (``gsm8k/test``,
    ``math500/test``), and by their path as given when that collides too. A row with neither (a built-in
    task's) is named ``""``."""
    def own(meta: Mapping[str, Any]) -> str | None:
        fields = meta.get("fields")
        value = fields.get(SOURCE_FIELD) if isinstance(fields, Mapping) else None
        return None if value is None or str(value) == "" else str(value)

    paths = sorted({str(m["source"]) for m in metas if own(m) is None and m.get("source") is not None})
    labels: dict[str, str] = {}
    for name in (lambda p: PurePath(p).stem, lambda p: "/".join((*PurePath(p).parts[-2:-1], PurePath(p).stem))):
        left = [p for p in paths if p not in labels]
        taken = [name(p) for p in left]
        for p, label in zip(left, taken):
            if taken.count(label) == 1 and label not in labels.values():
                labels[p] = label
    names = []
    for m in metas:
        label = own(m)
        if label is None and m.get("source") is not None:
            label = labels.get(str(m["source"]), str(m["source"]))
        names.append(label or "")
    return names


def per_source(sources: Sequence[str], metrics_of: Callable[[list[int]], Mapping[str, float]]) -> dict[str, float]:
    """Each metric of ``metrics_of(rows)`` (the metrics of the rows at those indices) computed over every
    source's rows, keyed ``<metric>/<source>``, sources in order of first appearance; ``{}`` when all rows
    share one source (the overall metrics say it all)."""
    groups: dict[str, list[int]] = {}
    for i, source in enumerate(sources):
        groups.setdefault(source, []).append(i)
    if len(groups) < 2:
        return {}
    return {f"{key}/{source}": value for source, rows in groups.items() for key, value in metrics_of(rows).items()}
