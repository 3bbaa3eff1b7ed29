"""A ground truth that is not text (verl's countdown ``{"target": 24, "numbers": [...]}``, an int): the text that
relayrl's verifiers, logs and samples read, and the value the file holds, for a user reward function.

A :class:`GroundTruth` is a ``str``, the answer's text (a number as ``str(n)``, as relayrl has always read it; a
list, dict or boolean as its JSON), so whatever reads ``Problem.answer`` reads it as before; beside it,
``value`` is the row's field as the file has it (plain Python: :func:`plain`), which a verl ``compute_score``
gets as its ``ground_truth`` (:func:`truth_value`). It goes wherever the problem goes (a worker process takes
it pickled, value and all). Only rows read for a user reward function carry one
(:class:`~relayrl.data.dataset_config.DatasetConfig` ``raw_answers``); a text answer is a plain ``str`` everywhere.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["GroundTruth", "plain", "truth_value"]


class GroundTruth(str):
    """An answer's text (the ``str`` itself) and the value it was read from (:attr:`value`)."""

    value: Any
    """The field as the file holds it: an int, a float, a bool, a list or a dict (of plain Python values)."""

    def __new__(cls, text: str, value: Any) -> "GroundTruth":
        self = super().__new__(cls, text)
        self.value = value
        return self

    @classmethod
    def of(cls, value: Any) -> "GroundTruth":
        """``value`` with its text: a number as ``str(value)`` (relayrl's text of a number answer), anything
        else as its JSON."""
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return cls(str(value) if number else json.dumps(value, ensure_ascii=False, default=str), value)

    def __reduce__(self):  # (str's own would rebuild the text without its value)
        return type(self), (str(self), self.value)


def truth_value(answer: Any) -> Any:
    """What a verl ``compute_score`` gets as ``ground_truth``: a :class:`GroundTruth`'s value, else ``answer``."""
    return answer.value if isinstance(answer, GroundTruth) else answer


def plain(value: Any) -> Any:
    """``value`` in plain Python types: numpy scalars and arrays (anything with ``tolist``) as the numbers and
    lists they hold, tuples as lists, inside dicts and lists too; the rest as it is."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if callable(getattr(value, "tolist", None)):  # (numpy's; np.str_ and np.float64 too, subclasses of Python's)
        return plain(value.tolist())
    return value
