"""The reference model's summed log-probs of the rows a dpo or kto step trains on: from the reference group each
step, or, with ``trainer.precompute_ref`` (TRL's ``precompute_ref_log_probs``), from one pass before the first step.

Precomputed::

    plan     <- the rows every step left will draw: a fork of the prompt source, walked as the steps walk it
    rows     <- each (prompt, completion) of the plan once, rows of one prompt side by side
    stored   <- reference.logprobs(rows), summed per row, 2 x trainer.batch_size rows a call   (progress logged)
    release the reference group: its model leaves memory for the rest of the run
    each step: its rows' values, looked up by (prompt text, completion text)

A row is keyed by its text, which fixes its tokens (the session encodes a prompt by its text): the key does not
depend on where the row stands, so a dataset walked in a new permutation each epoch, a row met again in a later
epoch or two rows with the same text all find their value. The values are not checkpointed: the reference is the
starting model, so a resumed run computes them again, for the steps it has left (its plan starts at the restored
data position). A call takes as many rows as a step's reference pass, so the pass needs no more memory than a step.

Departures from TRL. TRL scores its whole training dataset in order; here the pass scores the rows the run's
steps will draw: every row of a dataset once the run spans an epoch, fewer for a shorter run, and the sums the
built-in arith task will draw (it has no fixed set). For KTO, TRL fixes each example's mismatched completion when
it prepares the dataset (its neighbour in a batch of the dataset's order, whose sampling must then be sequential)
and stores one reference value per example for its KL row. relayrl's KL rows pair each example with the one before
it in its step's batch, which the per-epoch shuffle changes from epoch to epoch, so the plan holds the KL rows of
every step left: a run with the precompute computes the same ``z0`` as one without, at the cost of one reference
row per example and step for the KL term (TRL's pass: one per dataset row).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from relayrl.cluster import WorkerGroup
from relayrl.data.tasks import Problem
from relayrl.engines.training.base import SequenceBatch
from relayrl.workflows.prompt_source import PromptSource
from relayrl.workflows.session import Session
from relayrl.workflows.sft import answer_ids
from relayrl.workflows.trainer_workers import ReferenceWorker

__all__ = ["Row", "row_key", "planned_rows", "ReferenceLogps", "PROGRESS_EVERY_S"]

Row = tuple[Problem, str]
"""A row the reference scores: a problem (its prompt) and a completion's text."""

Take = Callable[[int], list[Problem]]

PROGRESS_EVERY_S = 10.0
"""A pass longer than this logs a progress line this often."""


def row_key(row: Row) -> tuple[str, str]:
    """``(prompt text, completion text)``: a row's identity, whatever its position in the data."""
    return row[0].prompt, row[1]


def planned_rows(source: PromptSource, steps: int, draw: Callable[[Take], list[Row]]) -> list[Row]:
    """Every row of the next ``steps`` steps, each ``(prompt, completion)`` once, the rows of a prompt side by side
    (prompts in the order first drawn). ``draw(take)``: one step's rows, drawn with ``take`` as the step draws
    them; the plan draws from a fork of ``source``, which does not move."""
    fork = source.fork()
    by_prompt: dict[str, dict[str, Row]] = {}
    for _ in range(steps):
        for row in draw(fork.take):
            prompt, completion = row_key(row)
            by_prompt.setdefault(prompt, {}).setdefault(completion, row)
    return [row for rows in by_prompt.values() for row in rows.values()]


def rows_batch(s: Session, rows: list[Row]) -> SequenceBatch:
    """``rows`` as token ids (prompt, completion + EOS), one prompt group per run of rows with the same prompt."""
    groups, g = [], -1
    for i, (p, _) in enumerate(rows):
        g += i == 0 or p.prompt != rows[i - 1][0].prompt
        groups.append(g)
    return SequenceBatch([torch.tensor(s.encode(p)) for p, _ in rows], [answer_ids(s, text) for _, text in rows],
                         groups=groups)


class ReferenceLogps:
    """The reference's summed log-probs of a step's rows (``__call__``), from its group or, after
    :meth:`precompute`, from the stored values (the group then released)."""

    def __init__(self, s: Session, group: WorkerGroup, release: Callable[[WorkerGroup], None]) -> None:
        self.s, self.group, self._release = s, group, release
        self.stored: dict[tuple[str, str], float] | None = None
        """``row_key -> summed log-prob`` once precomputed; None while the group scores each step."""

    def __call__(self, rows: list[Row], batch: SequenceBatch, step: int) -> list[float]:
        """Summed log-probs of ``rows``; ``batch`` holds the same rows as token ids (for the group's pass)."""
        if self.stored is None:
            with self.s.span("ref_logprob", "reference", step):
                return [float(lp.sum()) for lp in self.group.split(ReferenceWorker.logprobs, batch)]
        out = []
        for row in rows:
            value = self.stored.get(row_key(row))
            if value is None:
                raise RuntimeError(f"trainer.precompute_ref: step {step} drew the row (prompt {row[0].prompt!r}, "
                                   f"completion {row[1]!r}), which the pass before training did not plan: the "
                                   f"steps drew other rows than their plan (a bug); set trainer.precompute_ref=false "
                                   f"to run the reference each step")
            out.append(value)
        return out

    def precompute(self, rows: list[Row], per_call: int) -> None:
        """Score ``rows`` (:func:`planned_rows`) in calls of ``per_call`` rows, logging progress on a long pass;
        store the values and release the reference group."""
        s, group, n = self.s, self.group, len(rows)
        s.log(f"relayrl: trainer.precompute_ref: the reference scores the {n} rows of the steps left, {per_call} "
              f"a call, then leaves memory")
        stored: dict[tuple[str, str], float] = {}
        t0 = last = time.perf_counter()
        for start in range(0, n, per_call):
            part = rows[start:start + per_call]
            padded = part + [part[-1]] * (group.world_size - len(part))  # every rank takes a row (FSDP: all run)
            lps = group.split(ReferenceWorker.logprobs, rows_batch(s, padded))
            stored.update((row_key(r), float(lp.sum())) for r, lp in zip(part, lps))
            now = time.perf_counter()
            if now - last >= PROGRESS_EVERY_S and len(stored) < n:
                s.log(f"relayrl: trainer.precompute_ref: {len(stored)}/{n} rows ({100 * len(stored) // n}%), "
                      f"{now - t0:.0f} s")
                last = now
        self._release(group)
        self.group, self.stored = None, stored
        s.log(f"relayrl: trainer.precompute_ref: {n} reference log-probs in {time.perf_counter() - t0:.1f} s; "
              f"the reference model is released (the steps run no reference pass)")
