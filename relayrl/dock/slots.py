"""Handles for other processes: reserved rows (``Slots``), write receipts, and ``RowReader``.

A rollout worker should send its samples straight to the storage units, not
through the driver: MindSpeed RL's workers put into the transfer dock's
warehouses themselves, and AsyncFlow's clients write to the storage units while
only metadata reaches the controllers. Here the driver hands a worker a
``Slots`` (which rows to fill and on which units they live; picklable, a few
hundred bytes); the worker calls ``slots.write(columns)``, which stores the
data in the units and returns a ``Receipt`` (row indexes, schemas and row
lengths: metadata only); the driver's ``dock.publish(receipt)`` then makes the
cells visible to the stages. Until published, written cells are invisible, so
the rows of a worker that dies between write and publish are never seen half
written. ``dock.put`` is the same three steps in one process.

Reading is the mirror image: ``dock.reader(partition, indexes, columns)``
checks in the driver that every cell is written and returns a ``RowReader``
(row indexes, their units, the partition generation: metadata only); a
trainer rank calls ``reader.read()`` and gets ``{column: [tensor per row]}``
from the units in request order. A read after the partition was closed raises
``PartitionClosedError`` (the units remember dropped generations).

Which backend reaches the units from where:

* ``backend="local"``: units are objects in the driver; ``Slots`` and
  ``RowReader`` work in the driver's threads and refuse to be pickled.
* ``backend="process"``: each unit is a local process behind a Unix socket
  (``unitproc.py``). The handles pickle into a few hundred bytes and connect
  from whichever process unpickles them: the ranks of a
  ``ClusterConfig(in_process=False)`` group, processes spawned or forked by
  the driver. This is the data plane for the local multi-process backend.
* ``backend="ray"``: units are actors; the handles work in any process of the
  Ray cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

import torch

from .columns import ColumnSchema, Rows, normalize_column
from .config import DockWriteError, PartitionClosedError


@dataclass(frozen=True)
class Receipt:
    """Proof that a ``Slots.write`` stored its data; ``dock.publish`` it in the driver.

    Attributes:
        partition: partition name.
        gen: the partition's generation when the slots were handed out.
        indexes: ``[n]`` int64 rows written.
        columns: column -> (schema, ``[n]`` row lengths).
    """

    METADATA: ClassVar[bool] = True  # row indexes and lengths: not counted as sample bytes (payload_bytes)

    partition: str
    gen: int
    indexes: np.ndarray
    columns: dict[str, tuple[ColumnSchema, np.ndarray]]


def normalize_columns(where: str, data: Mapping[str, Any], n_rows: int | None) -> dict[str, Rows]:
    """Every column of a write as ``Rows``; all columns must have the same row count (``n_rows`` if given)."""
    if not data:
        raise ValueError(f"{where}: no columns given")
    cols: dict[str, Rows] = {}
    for name, values in data.items():
        cols[name] = col = normalize_column(name, values, n_rows)
        n_rows = len(col.values)
    return cols


class _RowSet:
    """Rows of one partition generation held by index (the part ``Slots`` and ``RowReader`` share)."""

    partition: str
    _idx: np.ndarray

    @property
    def indexes(self) -> list[int]:
        return self._idx.tolist()

    def __len__(self) -> int:
        return len(self._idx)

    def _rows_repr(self) -> str:
        return f"{self.partition!r}, rows {self.indexes[:4]}{'...' if len(self) > 4 else ''}"


class Slots(_RowSet):
    """Rows of one partition generation that a writer may fill, and the units that hold them.

    Get one from ``dock.reserve`` (new rows) or ``dock.slots`` (columns of
    existing rows). ``write`` works in any process that can reach the units
    (see the module docstring).
    """

    def __init__(self, partition: str, gen: int, n_rows: int, indexes: np.ndarray, owner: np.ndarray, plane: Any) -> None:
        self.partition, self._gen, self._n_rows = partition, gen, n_rows
        self._idx, self._owner, self._plane = indexes, owner, plane

    def __repr__(self) -> str:
        return f"Slots({self._rows_repr()})"

    def select(self, positions: Sequence[int]) -> "Slots":
        """The slots at ``positions`` (0-based, into these slots' rows): a writer fills only some of its rows."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(pos) and (pos.min() < 0 or pos.max() >= len(self._idx)):
            raise IndexError(f"select: positions {pos.tolist()[:8]} out of range for {len(self._idx)} slots")
        return Slots(self.partition, self._gen, self._n_rows, self._idx[pos], self._owner[pos], self._plane)

    @classmethod
    def join(cls, parts: Sequence["Slots"]) -> "Slots":
        """The rows of several ``Slots`` of one partition as one (in order), so a writer that has filled several
        groups stores them in one write with one receipt."""
        if not parts:
            raise ValueError("Slots.join: no slots given")
        first = parts[0]
        for p in parts[1:]:
            if (p.partition, p._gen, p._n_rows) != (first.partition, first._gen, first._n_rows):
                raise ValueError(f"Slots.join: {p!r} and {first!r} are of different partitions or generations")
        return cls(first.partition, first._gen, first._n_rows, np.concatenate([p._idx for p in parts]),
                   np.concatenate([p._owner for p in parts]), first._plane)

    def write(self, data: Mapping[str, Any]) -> Receipt:
        """Store ``data`` (column -> one tensor or scalar per slot row) in the units; nothing is visible yet.

        Raises ``DockWriteError`` (with ``.indexes``) when the units did not all
        confirm, and ``PartitionClosedError`` when the partition was closed.
        """
        return self.write_rows(normalize_columns(f"write to {self!r}", data, len(self._idx)))

    def write_rows(self, cols: dict[str, Rows]) -> Receipt:
        """``write`` for columns already normalized (``dock.put`` checks them before any data moves)."""
        try:
            self._plane.write(self._gen, self._n_rows, self._idx, self._owner, cols)
        except DockWriteError as e:
            e.indexes = self._idx.tolist()  # retry these rows with dock.slots(partition, e.indexes)
            raise
        return Receipt(self.partition, self._gen, self._idx, {n: (c.schema, c.lengths) for n, c in cols.items()})


class RowReader(_RowSet):
    """Rows of one partition generation to read from any process that can reach the units.

    Get one from ``dock.reader`` (which checked that every cell is written);
    send it to a worker and call ``read()`` there. It holds metadata only (16
    bytes per row plus the column schemas).
    """

    def __init__(self, partition: str, gen: int, indexes: np.ndarray, owner: np.ndarray, columns: tuple[str, ...],
                 schemas: dict[str, ColumnSchema], plane: Any) -> None:
        self.partition, self.columns, self._gen = partition, columns, gen
        self._idx, self._owner, self._schemas, self._plane = indexes, owner, schemas, plane

    def __repr__(self) -> str:
        return f"RowReader({self._rows_repr()}, columns {list(self.columns)})"

    def read(self) -> dict[str, list[torch.Tensor]]:
        """``{column: [one tensor per row]}`` in ``indexes`` order.

        The tensors are fresh CPU copies (process and Ray backends) or the
        stored tensors themselves (local backend: do not modify them). Raises
        ``PartitionClosedError`` if the partition was closed since the reader
        was made; with the process backend, ``UnitLostError`` naming the unit
        and its pid if a unit died or stopped answering.
        """
        try:
            return self._plane.read(self._gen, self.columns, self._idx, self._owner, self._schemas)
        except PartitionClosedError as e:
            raise PartitionClosedError(f"{self!r}: partition {self.partition!r} was closed after this reader was "
                                       "made; its rows are gone") from e
