"""Worker classes of the multi-process dock tests (importable by spawned ranks)."""
from __future__ import annotations

import os

import torch

from relayrl.cluster import Worker
from relayrl.dock import Receipt, RowReader, Slots


def response(i: int) -> torch.Tensor:
    """The sample a rollout rank writes for row ``i``: ``[i % 7 + 1]`` int64."""
    return torch.arange(i % 7 + 1) + 100 * i


class DockWorker(Worker):
    """A rollout rank that writes samples into the units and a trainer rank that reads them back."""

    def write(self, slots: list[Slots]) -> list[tuple[int, Receipt]]:
        """Fill each ``Slots`` with ``response(i)`` and a reward per row; returns (pid, receipt) per slots."""
        return [(os.getpid(), s.write({"response_ids": [response(i) for i in s.indexes],
                                       "rewards": [float(i) for i in s.indexes]})) for s in slots]

    def read_sums(self, reader: RowReader) -> tuple[int, list[int]]:
        """Read the rows in this process; returns (pid, sum of each response) so no tensor goes back."""
        got = reader.read()
        return os.getpid(), [int(t.sum()) for t in got["response_ids"]]

    def score(self, reader: RowReader, slots: Slots) -> Receipt:
        """A trainer step: read rows from the units, write an output column for the same rows back."""
        got = reader.read()
        return slots.write({"values": [t.float() * 0.5 for t in got["response_ids"]]})
