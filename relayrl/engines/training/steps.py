"""The optimizer steps of an update: how a rank's rows are cut into mini-batches (one step each), how the
steps' metrics make the update's, and the learning-rate schedule over the run's steps."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from relayrl.engines.training.base import OptimConfig, metric_reduction

__all__ = ["minibatch_slices", "minibatch_rows", "make_scheduler", "over_steps", "PER_STEP", "rescaled_scheduler_state"]

PER_STEP = ("grad_norm", "lr", "expert_load_imbalance")
"""A role's metrics of the optimizer step itself (``actor/grad_norm``): an update reports their mean over its
steps."""


def minibatch_slices(rows: int, mini_batches: int) -> list[range]:
    """Exactly ``mini_batches`` contiguous, non-empty slices of ``range(rows)`` whose sizes differ by at most one
    (the first ``rows % mini_batches`` are one row longer): one optimizer step each, so every data-parallel rank
    takes the same number of steps whatever its row count. ``ceil(rows / mini_batches)``-row slices would not:
    6 rows in 4 mini-batches would give 3 steps."""
    if not 1 <= mini_batches <= rows:
        raise ValueError(f"mini_batches={mini_batches} must be in [1, {rows}] (rows to slice)")
    base, extra = divmod(rows, mini_batches)
    out, start = [], 0
    for k in range(mini_batches):
        stop = start + base + (1 if k < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def minibatch_rows(perm: Sequence[int], rows: range, offset: int, held: int) -> list[int]:
    """This rank's rows of one mini-batch, as indexes into its own rows: the global rows ``perm[rows]`` (``perm``
    a permutation of every data-parallel rank's rows, numbered in rank order, the same on every rank) that fall
    in ``[offset, offset + held)``, the rank's own, shifted by ``offset``. Every rank cuts the same global
    mini-batches, so ``mini_batches`` steps on N ranks take the rows one rank's would (a rank may hold none of
    a mini-batch's rows; it still joins the step). Cutting each rank's rows on their own would make a
    mini-batch of every rank's k-th slice, another update than one rank's (the rows of a rank's slice are drawn
    from its own rows only)."""
    return [g - offset for g in perm[rows.start:rows.stop] if offset <= g < offset + held]


def over_steps(steps: Sequence[tuple[Mapping[str, float], int, int]], prefix: str,
               summed: Sequence[str] = ()) -> dict[str, float]:
    """An update's metrics from its optimizer steps' ``(metrics, response tokens, responses)`` (epochs x
    mini-batches; the responses with a token to train on, ``global_seqs``).

    Each name is combined by its kind, as the micro-batches of one step are (:func:`metric_reduction`): a mean
    (``actor/entropy``, ``actor/clip_frac_low``) weighted by each step's response tokens, so the update reports
    the token mean over every token it trained on and not a mean of mini-batch means; a per-response figure
    (``correction/seq_capped_frac``) weighted by each step's responses; ``.._max`` / ``.._min`` the extreme over
    the steps; counts (``..tokens``, ``..passes``) summed. What is already normalised within a step (``..loss``
    and the loss's ``summed`` names) and the step's own figures (:data:`PER_STEP`) are averaged over the steps;
    ``{prefix}/nonfinite_grad`` is 1 when any step's gradient norm was not finite. A name some steps lack is
    combined over the steps that have it."""
    names = list(dict.fromkeys(k for m, _, _ in steps for k in m))
    out: dict[str, float] = {}
    for k in names:
        how = metric_reduction(k, summed)
        got = [(m[k], seqs if how == "seq" else tokens) for m, tokens, seqs in steps if k in m]
        values = [v for v, _ in got]
        if k == f"{prefix}/nonfinite_grad" or how == "max":
            out[k] = max(values)
        elif how == "min":
            out[k] = min(values)
        elif how == "sum" and k.endswith(("tokens", "passes")):
            out[k] = sum(values)
        elif how == "sum" or (k.partition("/")[0] == prefix and k.partition("/")[2] in PER_STEP):
            out[k] = sum(values) / len(values)
        else:
            total = sum(w for _, w in got)
            out[k] = sum(v * w for v, w in got) / total if total else sum(values) / len(values)
    return out


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up, then constant / cosine / linear decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            decay = 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def rescaled_scheduler_state(state: dict | None, old_per_step: int, new_per_step: int) -> dict | None:
    """A checkpoint's scheduler state (:func:`make_scheduler`'s, which counts optimizer steps) for a run that
    resumes with ``new_per_step`` optimizer steps per RL step where the checkpoint took ``old_per_step``
    (``trainer.mini_batches x trainer.epochs``): its position, ``step x old_per_step``, becomes
    ``step x new_per_step``, where the new config's schedule is at that RL step (a non-multiple is rounded to
    the nearest). The same per-step count, or no state: ``state`` itself."""
    if state is None or old_per_step == new_per_step:
        return state
    if old_per_step < 1 or new_per_step < 1:
        raise ValueError(f"optimizer steps per RL step must be >= 1, got {old_per_step} and {new_per_step}")
    last = int(state["last_epoch"])
    moved = (last * new_per_step + old_per_step // 2) // old_per_step
    out = dict(state, last_epoch=moved)
    if "_step_count" in state:
        out["_step_count"] = int(state["_step_count"]) - last + moved
    return out
