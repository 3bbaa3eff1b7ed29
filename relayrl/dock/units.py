"""Storage units: the data plane of the dock (MindSpeed RL's TD warehouses, AsyncFlow's storage units).

Each unit holds the rows the dock placed on it (see ``plane.py``) for every
open partition generation. A unit only stores and returns data; it
knows nothing of readiness or consumption (that is the controllers' job).

* ``LocalUnit`` keeps the caller's row tensors by reference: no
  serialization and no copy, so the embedded default stays in the
  microsecond range per row and CUDA tensors stay on their device.
* ``PackedUnit`` is the body of a unit in another process: a Ray actor
  (``make_ray_unit_class``) or a unit process (``unitproc.py``) hosts the same
  object. Rows arrive packed (one flat numpy buffer + lengths per column, see
  ``columns.py``; several puts per call, see ``wire.py``) and are kept packed
  as received chunks with per-row offsets; a read returns the requested slices
  of each column, which the reader joins with the one copy it makes anyway.
  The Ray actor reserves no CPU (``num_cpus=0``), unlike TransferQueue's
  units, so it never starves a small Ray cluster.

Both kinds remember the generations dropped from them: a late write to one is
refused, and so is a read (a ``RowReader`` in another process learns that its
partition was closed from the unit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .config import PartitionClosedError
from .packed import PackedColumn
from .wire import decode

if TYPE_CHECKING:
    import torch


def _closed(gen: int) -> PartitionClosedError:
    return PartitionClosedError(f"partition generation {gen} is closed")


class LocalUnit:
    """In-process unit: ``{generation: {column: {row: tensor}}}``."""

    def __init__(self) -> None:
        self._data: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
        self._dropped: set[int] = set()

    def put(self, gen: int, column: str, rows: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        if gen in self._dropped:
            raise _closed(gen)
        col = self._data.setdefault(gen, {}).setdefault(column, {})
        col.update(zip(rows, values))

    def get(self, gen: int, columns: Sequence[str], rows: Sequence[int]) -> dict[str, list[torch.Tensor]]:
        if gen in self._dropped:
            raise _closed(gen)
        part = self._data.get(gen, {})
        out = {}
        for c in columns:
            col = part.get(c)
            if col is None:
                raise KeyError(f"column {c!r} holds no rows in this unit (rows {list(rows)[:8]}...)")
            try:
                out[c] = [col[r] for r in rows]
            except KeyError as e:
                raise KeyError(f"row {e.args[0]} has no value for column {c!r}") from None
        return out

    def drop(self, gen: int) -> int:
        """Forget a partition generation; returns the number of cells freed."""
        self._dropped.add(gen)
        part = self._data.pop(gen, {})
        return sum(len(c) for c in part.values())

    def export(self, gen: int, columns: Sequence[str], rows: Sequence[int]) -> dict[str, dict[int, torch.Tensor]]:
        """Rows present for each column (missing cells skipped), for checkpoints."""
        part = self._data.get(gen, {})
        return {c: {r: part[c][r] for r in rows if r in part.get(c, {})} for c in columns if c in part}


class _PackedStore:
    """One column of one generation in a ``PackedUnit``: received chunks + per-row offsets."""

    __slots__ = ("chunks", "chunk", "start", "stop", "schema")

    def __init__(self, n_rows: int, packed: PackedColumn) -> None:
        self.chunks: list[np.ndarray] = []
        self.chunk = np.full(n_rows, -1, dtype=np.int64)
        self.start = np.zeros(n_rows, dtype=np.int64)
        self.stop = np.zeros(n_rows, dtype=np.int64)
        self.schema = packed.schema

    def add(self, rows: np.ndarray, packed: PackedColumn) -> None:
        ends = np.cumsum(packed.lengths)
        self.chunk[rows] = len(self.chunks)
        self.start[rows] = ends - packed.lengths
        self.stop[rows] = ends
        self.chunks.append(packed.flat)

    def read(self, rows: np.ndarray) -> PackedColumn:
        ch = self.chunk[rows]
        if (ch < 0).any():
            missing = rows[ch < 0][:8].tolist()
            raise KeyError(f"rows {missing} have no value for this column")
        st, sp = self.start[rows], self.stop[rows]
        lengths = sp - st
        # One slice per run of rows stored back to back in one chunk (rows written
        # together are read together, so a batch is usually a few runs).
        cut = np.flatnonzero((ch[1:] != ch[:-1]) | (st[1:] != sp[:-1])) + 1
        lo = np.concatenate([[0], cut])
        hi = np.concatenate([cut, [len(rows)]])
        runs = [self.chunks[c][s:e] for c, s, e in zip(ch[lo].tolist(), st[lo].tolist(), sp[hi - 1].tolist())]
        return PackedColumn(flat=runs[0] if len(runs) == 1 else runs, lengths=lengths, schema=self.schema)


class PackedUnit:
    """Packed column store: the body of a Ray unit actor and of a unit process."""

    def __init__(self) -> None:
        self._data: dict[int, dict[str, _PackedStore]] = {}
        self._dropped: set[int] = set()  # generations closed: late writes (from other processes) are refused

    def ping(self) -> bool:
        return True

    def put(self, gen: int, n_rows: int, rows: np.ndarray, columns: dict[str, PackedColumn]) -> int:
        if gen in self._dropped:
            raise _closed(gen)
        part = self._data.setdefault(gen, {})
        for name, packed in columns.items():
            store = part.get(name)
            if store is None:
                store = part[name] = _PackedStore(n_rows, packed)
            store.add(rows, packed)
        return len(rows)

    def put_many(self, head: list, inline: bool, *args: Any) -> list[str | None]:
        """Store the writes of one group-committed call (see ``wire.py``).

        Returns one entry per write: None when stored, else why it was refused
        (its partition was closed), so one late write does not fail the others.
        """
        out: list[str | None] = []
        for w in decode(head, args if inline else args[0]):
            try:
                self.put(*w)
                out.append(None)
            except PartitionClosedError as e:
                out.append(str(e))
        return out

    def get(self, gen: int, columns: Sequence[str], rows: np.ndarray) -> dict[str, PackedColumn]:
        if gen in self._dropped:
            raise _closed(gen)
        part = self._data.get(gen, {})
        out = {}
        for c in columns:
            if c not in part:
                raise KeyError(f"column {c!r} holds no rows in this unit")
            try:
                out[c] = part[c].read(rows)
            except KeyError as e:
                raise KeyError(f"column {c!r}: {e.args[0]}") from None
        return out

    def drop(self, gen: int) -> int:
        self._dropped.add(gen)
        part = self._data.pop(gen, {})
        return len(part)


def make_ray_unit_class():
    """The Ray actor class for ``PackedUnit`` (built lazily: importing the dock never touches Ray)."""
    import ray

    class RayUnit(PackedUnit):
        def where(self) -> tuple[str, str]:
            """The IP address and Ray id of the node this unit runs on (a lost unit's error names its host)."""
            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    return ray.remote(num_cpus=0, max_restarts=0)(RayUnit)
