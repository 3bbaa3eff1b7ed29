"""Batches and the streaming loader (AsyncFlow §3.4: TransferQueue as a streaming dataloader).

``StreamLoader`` is the per-stage iterator: each ``next`` asks the stage's
controller for a lease on ready rows (waiting on an event, never polling),
reads those rows from the storage units and yields a ``Batch``; it stops when
every declared row of the partition is acknowledged by the stage. A ``Batch``
holds one unpadded tensor per row and column; ``ack()`` retires its rows, and
rows never acknowledged are re-delivered after the lease expires.

Data-parallel balancing (AsyncFlow's "equitable distribution of processed
tokens across DP groups"): with ``dp_size=k`` the loader leases ``k`` x
``batch_size`` rows at once and splits them into ``k`` shards with equal row
counts and nearly equal token counts (``balance_shards``), so no rank waits on
a rank that drew all the long responses.
"""

from __future__ import annotations

import heapq
import uuid
from typing import Iterator, Protocol, Sequence

import torch

class Dock(Protocol):
    """What batches and loaders ask of the dock (:class:`relayrl.dock.dock.Dock`, which imports this module)."""

    def acquire(self, partition: str, stage: str, **kwargs) -> "Batch | None": ...

    def release(self, consumer_id: str) -> int: ...

    def _ack(self, partition: str, gen: int, stage: str | None, lease: int, indexes: list[int]) -> int: ...


def balance_shards(weights: Sequence[int], sizes: Sequence[int], k: int) -> list[list[int]]:
    """Split items into ``k`` shards of equal item count and balanced total weight.

    Greedy longest-processing-time with a cardinality cap: items in decreasing
    weight go to the lightest shard that still has room.

    Args:
        weights: ``[m]`` weight (tokens) of each item.
        sizes: ``[m]`` rows in each item (1 for single rows, group size for groups).
        k: number of shards.
    Returns:
        ``k`` lists of item positions; each shard's row count is within one item
        of ``sum(sizes) / k``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(weights) != len(sizes):
        raise ValueError(f"weights ({len(weights)}) and sizes ({len(sizes)}) differ in length")
    total_rows = sum(sizes)
    cap = -(-total_rows // k)
    shards: list[list[int]] = [[] for _ in range(k)]
    rows = [0] * k
    heap = [(0, s) for s in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        skipped = []
        while True:
            w, s = heapq.heappop(heap)
            if rows[s] + sizes[i] <= cap or not heap:
                break
            skipped.append((w, s))
        shards[s].append(i)
        rows[s] += sizes[i]
        heapq.heappush(heap, (w + weights[i], s))
        for item in skipped:
            heapq.heappush(heap, item)
    return shards


class ColumnAccess:
    """``batch[column]`` and ``batch.columns`` over a ``_data`` dict of columns (the in-process dock's batches
    and the service client's share them)."""

    _data: dict[str, list[torch.Tensor]]

    def __getitem__(self, column: str) -> list[torch.Tensor]:
        """Rows of ``column``: a list of ``[L_i, *tail]`` (or 0-d) tensors, in ``indexes`` order."""
        try:
            return self._data[column]
        except KeyError:
            raise KeyError(f"batch has no column {column!r}; it holds {sorted(self._data)}") from None

    @property
    def columns(self) -> list[str]:
        return list(self._data)


class Batch:
    """Rows handed to one consumer: ``indexes`` and one unpadded tensor per row per column."""

    __slots__ = ("partition", "stage", "indexes", "_data", "_lease", "_dock", "_gen", "_tokens", "shards")

    def __init__(self, dock: "Dock | None", partition: str, gen: int, stage: str | None, indexes: list[int],
                 data: dict[str, list[torch.Tensor]], lease: int | None, tokens: list[int] | None = None) -> None:
        self._dock = dock
        self.partition = partition
        self._gen = gen
        self.stage = stage
        self.indexes = indexes
        self._data = data
        self._lease = lease
        self._tokens = tokens
        self.shards: list[Batch] = []

    def __len__(self) -> int:
        return len(self.indexes)

    __getitem__ = ColumnAccess.__getitem__
    columns = ColumnAccess.columns

    @property
    def generation(self) -> int:
        """The partition generation the rows belong to (with ``lease_id``, what ``Dock.ack`` needs)."""
        return self._gen

    @property
    def lease_id(self) -> int | None:
        return self._lease

    def flat(self, column: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``column`` as one flat tensor ``[sum L_i, *tail]`` and lengths ``[n]`` (int64)."""
        rows = self[column]
        if rows and rows[0].dim() == 0:
            return torch.stack(rows), torch.ones(len(rows), dtype=torch.int64)
        return torch.cat(rows), torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)

    def tokens(self) -> list[int]:
        """Tokens per row (sum of the stage's token-column lengths); empty if none declared."""
        return list(self._tokens or [])

    def select(self, positions: Sequence[int]) -> "Batch":
        """A sub-batch of the rows at ``positions``, sharing this batch's lease."""
        data = {c: [v[p] for p in positions] for c, v in self._data.items()}
        tokens = [self._tokens[p] for p in positions] if self._tokens else None
        return Batch(self._dock, self.partition, self._gen, self.stage, [self.indexes[p] for p in positions],
                     data, self._lease, tokens)

    def ack(self) -> list[int]:
        """Acknowledge this batch's rows; returns the indexes acknowledged by this call.

        Rows whose lease already expired and were handed elsewhere are not
        acknowledged (they are missing from the result) and will be processed again.
        """
        if self._lease is None or self._dock is None:
            raise ValueError("this batch was read with Dock.get and holds no lease; there is nothing to acknowledge")
        return self._dock._ack(self.partition, self._gen, self.stage, self._lease, self.indexes)


class StreamLoader:
    """Iterator over one stage's batches of one partition (see module docstring)."""

    def __init__(self, dock: "Dock", partition: str, stage: str, batch_size: int | None, max_tokens: int | None,
                 dp_size: int, consumer_id: str | None, timeout_s: float | None, auto_ack: bool) -> None:
        self._dock = dock
        self.partition = partition
        self.stage = stage
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.dp_size = dp_size
        self.consumer_id = consumer_id or f"{stage}-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self.auto_ack = auto_ack
        self._last: Batch | None = None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.auto_ack and self._last is not None:
            self._last.ack()
            self._last = None
        batch = self._dock.acquire(
            self.partition, self.stage, batch_size=self.batch_size, max_tokens=self.max_tokens,
            dp_size=self.dp_size, consumer_id=self.consumer_id, timeout_s=self.timeout_s,
        )
        if batch is None:
            raise StopIteration
        self._last = batch
        return batch

    def release(self) -> int:
        """Give back this loader's unacknowledged leases now (rows re-delivered at once)."""
        return self._dock.release(self.consumer_id)
