"""Retiring solved prompts: ScaleRL's "no-positive-resampling" (Khatri et al. 2025, "The Art of Scaling
Reinforcement Learning Compute for LLMs", arXiv 2510.13786) and POLARIS's removal of easy samples during
training (An et al. 2025).

A prompt whose group of responses reaches a pass rate ``>= threshold`` (ScaleRL: 0.9) in a step teaches little
once solved, so it is never sampled again in that run. The pass rate of a group is the share of its responses
that are solved, a response being solved when its score is ``>= solved_at`` (``data.retire_score``; its
default, 1.0, is what ``train/accuracy`` and ``eval/accuracy`` count as correct, and a graded reward, a user
function's partial credit or a reward model's, sets its own). The score is the one before any shaping (DAPO's
overlong penalty), the value ``algorithm.dynamic_sampling_metric=score`` compares: a correct answer near the
length limit is still solved.

Departures: ScaleRL removes a solved prompt from the later epochs; here the row is skipped from the next draw
on, in the rest of the current epoch too. The pass rate is that of one step's group (a prompt met twice in a
step, or in two steps, is retired when either group reaches it). A response whose score failed
(``reward.on_error=drop_group``: NaN) counts as not solved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["pass_rates", "solved_groups"]


def pass_rates(scores: Sequence[float], groups: Sequence[int], solved_at: float) -> dict[int, float]:
    """Each group's pass rate: the share of its responses whose score is ``>= solved_at`` (NaN: not solved).

    Args:
        scores: ``[N]`` the responses' scores, before shaping.
        groups: ``[N]`` the prompt group of each score.
        solved_at: the score from which a response is solved (``data.retire_score``), a finite number.
    Returns ``{group: pass rate in [0, 1]}`` for every group present, in order of first appearance.
    """
    if len(scores) != len(groups):
        raise ValueError(f"pass_rates: {len(scores)} scores but {len(groups)} group ids")
    if not math.isfinite(solved_at):
        raise ValueError(f"pass_rates: solved_at must be a finite score, got {solved_at}")
    solved: dict[int, list[int]] = {}
    for s, g in zip(scores, groups):
        tally = solved.setdefault(int(g), [0, 0])
        tally[0] += s >= solved_at  # (False for NaN)
        tally[1] += 1
    return {g: hit / total for g, (hit, total) in solved.items()}


def solved_groups(rates: dict[int, float], threshold: float) -> list[int]:
    """The groups whose pass rate is ``>= threshold`` (``data.retire_solved``, in ``(0, 1]``), sorted."""
    if not 0 < threshold <= 1:
        raise ValueError(f"solved_groups: threshold must be in (0, 1], got {threshold}")
    return sorted(g for g, rate in rates.items() if rate >= threshold)
