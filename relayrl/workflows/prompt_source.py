"""The training prompts of a run in a reproducible order (:class:`PromptSource`): fresh problems of a built-in
task from a seeded generator, or a dataset's rows walked epoch by epoch in a seeded shuffle, less the rows
``data.retire_solved`` retired. Its :meth:`PromptSource.state` is the data position a checkpoint holds."""

from __future__ import annotations

import hashlib
import json
import random
import threading
from typing import Iterable

from relayrl.data.tasks import Problem
from relayrl.errors import RunStopped

__all__ = ["PromptSource", "Drawn", "RowsExhausted"]


class Drawn(list):
    """Problems a :class:`PromptSource` drew, in order (a ``list[Problem]``), with :attr:`positions`: each one's
    position in the training rows (its index in ``PromptSource.problems``, the row's identity for
    ``data.retire_solved``; None for a built-in task's fresh problem)."""

    def __init__(self, problems: list[Problem], positions: list[int | None]) -> None:
        super().__init__(problems)
        self.positions = positions


class RowsExhausted(RunStopped):
    """Every training row is retired (``data.retire_solved``): there is no prompt left to draw."""


class PromptSource:
    """Training prompts in a reproducible order; :meth:`state` is the data position in checkpoints.

    A built-in task draws fresh problems from a seeded ``random.Random``,
    skipping the prompts in ``exclude`` (the held-out set, so that it stays
    held out); a dataset is walked in a per-epoch permutation (``shuffle``), or in its own order, skipping the
    rows :meth:`retire` took out (ScaleRL's no-positive-resampling, ``data.retire_solved``): in the rest of the
    current epoch's permutation and in every later one. The permutation of an epoch is the same with or without
    retired rows, so a row keeps its place among the others. ``lock`` guards the position and the retired set
    (an off-policy rollout thread draws while the trainer retires).
    """

    def __init__(self, seed: int, *, task=None, problems: list[Problem] | None = None,
                 exclude: frozenset[str] = frozenset(), shuffle: bool = True) -> None:
        if (task is None) == (problems is None):
            raise ValueError("PromptSource needs exactly one of task or problems")
        if problems is not None and not problems:
            raise ValueError("the training dataset is empty")
        self.task, self.problems, self.seed, self.exclude, self.shuffle = task, problems, seed, exclude, shuffle
        self.rng = random.Random(seed)
        self.epoch, self.pos, self.consumed = 0, 0, 0
        self.retired: set[int] = set()
        """Positions (indexes into ``problems``) never drawn again."""
        self.lock = threading.Lock()
        self._order = self._permutation()
        self._digest: dict | None = None  # (rows_digest, computed on the first checkpoint)

    def _permutation(self) -> list[int]:
        if self.problems is None:
            return []
        order = list(range(len(self.problems)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    @property
    def active_rows(self) -> int | None:
        """Training rows not retired (None: a built-in task, which has no rows)."""
        return None if self.problems is None else len(self.problems) - len(self.retired)

    def take(self, n: int) -> Drawn:
        """The next ``n`` problems, with their positions; raises :class:`RowsExhausted` when every row is
        retired."""
        problems, positions = [], []
        with self.lock:
            for _ in range(n):
                if self.task is not None:
                    problems.append(self._draw())
                    positions.append(None)
                    continue
                if not self.active_rows:
                    raise RowsExhausted(f"every one of the {len(self.problems):,} training rows is retired "
                                        f"(data.retire_solved): no prompt is left to draw")
                while True:
                    if self.pos == len(self._order):
                        self.epoch, self.pos = self.epoch + 1, 0
                        self._order = self._permutation()
                    i = self._order[self.pos]
                    self.pos += 1
                    if i not in self.retired:
                        break
                problems.append(self.problems[i])
                positions.append(i)
            self.consumed += n
        return Drawn(problems, positions)

    def retire(self, positions: Iterable[int]) -> int:
        """Never draw the rows at ``positions`` again; returns how many were not retired before."""
        rows = len(self.problems or ())
        with self.lock:
            fresh = set(positions) - self.retired
            bad = sorted(i for i in fresh if not 0 <= i < rows)
            if bad:
                raise ValueError(f"cannot retire row {bad[0]}: the training set has rows 0..{rows - 1}")
            self.retired |= fresh
            return len(fresh)

    def _draw(self) -> Problem:
        for _ in range(10_000):
            p = self.task.sample(self.rng)
            if p.prompt not in self.exclude:
                return p
        raise RuntimeError(f"task {self.task.name!r}: 10,000 draws in a row were held-out prompts; "
                           f"the task's problem space is too small for its held-out set")

    def fork(self) -> "PromptSource":
        """An independent source at this one's position: it draws the problems this one will draw next, and
        neither moves the other (the rows are shared, not copied)."""
        other = PromptSource(self.seed, task=self.task, problems=self.problems, exclude=self.exclude,
                             shuffle=self.shuffle)
        other.load_state(self.state())
        return other

    def state(self) -> dict:
        """The position, the task's sampler state, the retired rows (sorted positions) and what identifies the
        rows (:meth:`rows_digest`), as JSON values."""
        with self.lock:
            rng = self.rng.getstate()
            return {"rng": [rng[0], list(rng[1]), rng[2]], "epoch": self.epoch, "pos": self.pos,
                    "consumed": self.consumed, "retired": sorted(self.retired), "rows": self.rows_digest()}

    def rows_digest(self) -> dict | None:
        """The training rows' count and a SHA-256 of their prompts and answers in order (None: a built-in task):
        a resume on other rows (the file edited, reordered, another ``data.path``) is said, since the data
        position then walks rows the run did not see. Computed once (a checkpoint saves it every time)."""
        if self.problems is None:
            return None
        if self._digest is None:
            from relayrl.data.prompts import prompt_identity

            h = hashlib.sha256()
            for p in self.problems:
                h.update(json.dumps([prompt_identity(p), p.answer, p.meta.get("rejected"), p.meta.get("label")],
                                    default=str).encode())
            self._digest = {"count": len(self.problems), "sha256": h.hexdigest()}
        return self._digest

    def rows_changed(self, state: dict) -> str | None:
        """What differs between the rows a checkpoint's :meth:`state` was saved on and these (None: the same, or
        a checkpoint from before the digest)."""
        then, now = state.get("rows"), self.rows_digest()
        if then is None or now is None or then == now:
            return None
        if then["count"] != now["count"]:
            return f"{then['count']:,} rows then, {now['count']:,} now"
        return f"the same {now['count']:,} rows in count, but their prompts, answers or order differ"

    def load_state(self, state: dict) -> None:
        """Back to :meth:`state`'s position (a checkpoint written before ``data.retire_solved`` has no retired
        rows)."""
        v, internal, gauss = state["rng"]
        retired, rows = set(state.get("retired", ())), len(self.problems or ())
        bad = sorted(i for i in retired if not 0 <= i < rows)
        if bad:
            raise ValueError(f"the data position retires row {bad[0]}, but the training set has {rows:,} rows")
        with self.lock:
            self.rng.setstate((v, tuple(internal), gauss))
            self.epoch, self.pos, self.consumed = state["epoch"], state["pos"], state["consumed"]
            self.retired = retired
            self._order = self._permutation()
