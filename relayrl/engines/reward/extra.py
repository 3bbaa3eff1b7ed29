"""TRL's ``log_extra``: per-response columns a reward function adds to the samples table.

A TRL-shaped reward function that takes ``log_extra`` (by name or with ``**kwargs``) gets it, as TRL's
``GRPOTrainer`` passes it: ``log_extra(column, values)`` with one value per row of the call (e.g. the answer
it extracted, a judge's reasoning). relayrl's counterpart of TRL's completions table is
``telemetry.samples_per_step``: the step's first scored responses in ``RUN_DIR/samples.jsonl`` and the W&B
table ``samples``, where each logged column becomes a field of its rows (``null`` in a row it was not logged
for).

A call's rows are not the step's: a batch may be retried per prompt (:meth:`RewardEngine._guarded`), scored
in chunks as it streams, its groups dropped. So a call's values are kept per row, by the row's index in the
scoring batch (:class:`ExtraLog`), and travel with that row's score to the sample it becomes; a call that fails
keeps nothing. Each call checks what it is given whether or not anything is kept (the same function fails
the same way with ``samples_per_step=0``): ``column`` a non-empty string, ``values`` a list (tuple, 1-D
array) of exactly one value per row, each value JSON-able (``None``, bool, int, float, str, and lists and
string-keyed dicts of those; a NaN or infinite float is kept as ``null``); a breach raises
:class:`ExtraError` naming the column and the reason, which stops the run (a bug of the function, not of
a row). A column logged again for the same rows (by the same function, or by a later one of
``reward.user_fn``'s list) keeps the last values, as TRL's table does. A column named like one of the
sample's own fields (:data:`OWN`) is written as ``extra_NAME``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

from relayrl.engines.reward.config import RewardError

__all__ = ["ExtraError", "CallExtras", "ExtraLog", "OWN", "sample_fields", "json_value"]

OWN = frozenset({"step", "group", "prompt", "response", "score", "reward", "length"})
"""The fields a sample of ``RUN_DIR/samples.jsonl`` has of its own: a logged column of one of these names is
written as ``extra_NAME``."""


class ExtraError(RewardError):
    """A ``log_extra`` call broke its contract (module docstring)."""


class CallExtras:
    """What one call of a reward function logs: ``log`` is the ``log_extra`` it is given; ``columns`` the
    checked values by column (the last values of a column logged twice). ``keep=False``: checked, not kept."""

    def __init__(self, rows: int, keep: bool = True) -> None:
        self.rows, self.keep = rows, keep
        self.columns: dict[str, list] = {}
        self.error: ExtraError | None = None
        """The first breach (raised in the function too: kept should the function catch it)."""

    def log(self, column: str, values: Sequence) -> None:
        """TRL's ``log_extra(column, values)``: one value per row of the call."""
        try:
            self._log(column, values)
        except ExtraError as e:
            self.error = self.error or e
            raise

    def _log(self, column: str, values: Sequence) -> None:
        if not isinstance(column, str) or not column:
            raise ExtraError(f"log_extra({column!r}, ...): the column must be a non-empty string")
        if hasattr(values, "tolist") and getattr(values, "ndim", 1) == 1:  # numpy array, torch tensor
            values = values.tolist()
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
            raise ExtraError(f"log_extra({column!r}, ...): values is a {type(values).__name__}; expected a list "
                             f"of {self.rows} values, one per completion of the call")
        if len(values) != self.rows:
            raise ExtraError(f"log_extra({column!r}, ...): {len(values)} values for the {self.rows} completions "
                             f"of the call; expected one per completion, in their order")
        clean = [_json(v, column, i) for i, v in enumerate(values)]
        if self.keep:
            self.columns[column] = clean


class ExtraLog:
    """The columns logged for a scoring batch's rows (one per call of :meth:`RewardEngine.score_each`):
    ``keep`` of its first rows are kept (the rows the step's samples may take; the rest are checked only)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._rows: dict[int, dict[str, Any]] = {}

    def call(self, rows: int) -> CallExtras:
        """A ``log_extra`` for one call on ``rows`` rows."""
        return CallExtras(rows, keep=self.keep > 0)

    def add(self, indexes: Sequence[int], got: CallExtras) -> None:
        """A succeeded call's columns, its rows being the batch's rows ``indexes`` (in the call's order)."""
        for column, values in got.columns.items():
            for i, v in zip(indexes, values):
                if i < self.keep:
                    self._rows.setdefault(i, {})[column] = v

    def rows(self, n: int) -> list[dict[str, Any]]:
        """The columns of the batch's first ``min(n, keep)`` rows, one dict each (``{}``: none logged)."""
        return [dict(self._rows.get(i, {})) for i in range(min(n, self.keep))]


def sample_fields(columns: dict[str, Any], own: frozenset[str] = OWN) -> dict[str, Any]:
    """A row's logged columns as a sample's fields: a name of the sample's own fields ``own`` (a training
    sample's: :data:`OWN`) prefixed ``extra_``."""
    return {f"extra_{k}" if k in own else k: v for k, v in columns.items()}


def json_value(v: Any, column: str, i: int) -> Any:
    """``v`` (row ``i`` of ``column``) as a sample's field holds it; :class:`ExtraError` when JSON cannot."""
    return _json(v, column, i)


def _json(v: Any, column: str, i: int, depth: int = 0) -> Any:
    """``v`` as JSON holds it (numpy scalars as Python numbers, tuples as lists, a non-finite float as None);
    :class:`ExtraError` for anything else."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        f = float(v)
        return f if math.isfinite(f) else None
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0:  # a numpy bool, a 0-d tensor
        return _json(v.item(), column, i, depth)
    if depth < 8:
        if isinstance(v, (list, tuple)):
            return [_json(x, column, i, depth + 1) for x in v]
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {k: _json(x, column, i, depth + 1) for k, x in v.items()}
    raise ExtraError(f"log_extra({column!r}, ...): the value at index {i} is a {type(v).__name__} ({str(v)[:80]!r}); "
                     f"expected JSON-able values (None, bool, int, float, str, lists and str-keyed dicts of those), "
                     f"e.g. str(value)")
