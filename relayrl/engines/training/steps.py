"""The optimizer steps of an update: how a rank's rows are cut into mini-batches (one step each) and the
learning-rate schedule over the run's steps."""

from __future__ import annotations

import math

import torch

from relayrl.engines.training.base import OptimConfig

__all__ = ["minibatch_slices", "make_scheduler"]


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
