"""Data plane: spreads rows over storage units and gathers them back in request order.

Placement is by put: all new rows of one ``put`` go to the unit holding the
fewest rows of the partition (the dock records each row's unit). A put is then
one message to one unit however many units there are, concurrent producers
land on different units, and a batch of rows that were written together is
one contiguous slice of one stored chunk when read back. A read sends one
request to each unit that holds some of the requested rows, all concurrently.

``LocalPlane`` calls in-process ``LocalUnit`` objects. ``RayPlane`` owns one
Ray actor per unit (spread over nodes with Ray's ``SPREAD`` strategy, which
gives one unit per node when ``units`` equals the node count); a put packs
each column's rows into one flat numpy buffer + lengths per unit, sends all
units' shares concurrently (puts that meet at a busy unit share one call, see
``wire.py``) and returns only after every unit has confirmed (or raises
``DockWriteError``); a read asks all units concurrently and
rebuilds rows as views of one writable buffer per column and unit.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .columns import ColumnSchema, Rows, pack, unpack
from .config import DockWriteError, PartitionClosedError
from .units import LocalUnit, make_ray_unit_class
from .wire import UnitWriter


def _split_by_unit(owner: np.ndarray, n_units: int) -> list[tuple[int, np.ndarray]]:
    """``(unit, positions)`` for each unit that holds some of the rows (``owner[i]``: unit of row i)."""
    first = int(owner[0]) if len(owner) else 0
    if n_units == 1 or (owner == first).all():
        return [(first, np.arange(len(owner)))]
    return [(k, pos) for k in range(n_units) if len(pos := np.flatnonzero(owner == k))]


class LocalPlane:
    """In-process units; rows are stored by reference."""

    def __init__(self, n_units: int) -> None:
        self.n_units = n_units
        self.units = [LocalUnit() for _ in range(n_units)]

    def write(self, gen: int, n_rows: int, idx: np.ndarray, owner: np.ndarray,
              columns: dict[str, Rows]) -> None:
        rows = idx.tolist()
        parts = _split_by_unit(owner, self.n_units)
        for k, pos in parts:
            if len(parts) == 1:
                for name, col in columns.items():
                    self.units[k].put(gen, name, rows, col.values)
            else:
                pl = pos.tolist()
                for name, col in columns.items():
                    self.units[k].put(gen, name, [rows[p] for p in pl], [col.values[p] for p in pl])

    def read(self, gen: int, columns: Sequence[str], idx: np.ndarray, owner: np.ndarray,
             schemas: dict[str, ColumnSchema]) -> dict[str, list[torch.Tensor]]:
        parts = _split_by_unit(owner, self.n_units)
        if len(parts) == 1:
            return self.units[parts[0][0]].get(gen, columns, idx.tolist())
        out: dict[str, list] = {c: [None] * len(idx) for c in columns}
        for k, pos in parts:
            got = self.units[k].get(gen, columns, idx[pos].tolist())
            pl = pos.tolist()
            for c in columns:
                col = out[c]
                for p, v in zip(pl, got[c]):
                    col[p] = v
        return out

    def drop(self, gen: int) -> None:
        for u in self.units:
            u.drop(gen)

    def __reduce__(self):
        raise TypeError("the local dock's storage units live in the driver process: Slots of a backend='local' dock "
                        "cannot be sent to another process (use dock.put in the driver, or backend='ray')")

    def shutdown(self) -> None:
        self.units = []


class RayPlane:
    """One Ray actor per unit; packed numpy buffers on the wire."""

    def __init__(self, n_units: int, address: str | None, timeout_s: float) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self.n_units = n_units
        self.timeout_s = timeout_s
        actor = make_ray_unit_class()
        self.units = [actor.options(scheduling_strategy="SPREAD").remote() for _ in range(n_units)]
        ray.get([u.ping.remote() for u in self.units], timeout=timeout_s)
        self.writers = [UnitWriter(u, ray, timeout_s) for u in self.units]

    # Slots carry the plane to writers in other processes: the unit handles travel, each process
    # gets its own group-committing writers.
    def __getstate__(self) -> dict:
        return {"n_units": self.n_units, "timeout_s": self.timeout_s, "units": self.units}

    def __setstate__(self, state: dict) -> None:
        import ray

        self._ray = ray
        self.n_units, self.timeout_s, self.units = state["n_units"], state["timeout_s"], state["units"]
        self.writers = [UnitWriter(u, ray, self.timeout_s) for u in self.units]

    def write(self, gen: int, n_rows: int, idx: np.ndarray, owner: np.ndarray,
              columns: dict[str, Rows]) -> None:
        parts = _split_by_unit(owner, self.n_units)
        shares = [(k, pos, {
            name: pack(vals, schema, lengths) if len(parts) == 1 else pack([vals[p] for p in pos.tolist()], schema, lengths[pos])
            for name, (vals, schema, lengths) in columns.items()
        }) for k, pos in parts]
        # Every submitted write is waited for, even after one failed: the first waiter back from a
        # call is what lets the writer send the next one.
        tickets = [(self.writers[k], self.writers[k].submit(gen, n_rows, idx[pos], packed)) for k, pos, packed in shares]
        errors = []
        for writer, t in tickets:
            try:
                writer.wait(t)
            except Exception as e:  # noqa: BLE001 - any failure means the rows are not stored
                errors.append(e)
        if errors:
            e = errors[0]
            if isinstance(e, PartitionClosedError):  # a unit refuses writes to a dropped generation
                raise PartitionClosedError(f"put of {len(idx)} rows: the partition was closed; nothing is stored") from e
            raise DockWriteError(f"put of {len(idx)} rows (columns {list(columns)}) was not stored: {e!r}") from e

    def read(self, gen: int, columns: Sequence[str], idx: np.ndarray, owner: np.ndarray,
             schemas: dict[str, ColumnSchema]) -> dict[str, list[torch.Tensor]]:
        parts = [(pos, self.units[k].get.remote(gen, list(columns), idx[pos])) for k, pos in _split_by_unit(owner, self.n_units)]
        got = self._ray.get([ref for _, ref in parts], timeout=self.timeout_s)
        if len(parts) == 1:
            return {c: unpack(got[0][c]) for c in columns}
        out: dict[str, list] = {c: [None] * len(idx) for c in columns}
        for (pos, _), res in zip(parts, got):
            pl = pos.tolist()
            for c in columns:
                col = out[c]
                for p, v in zip(pl, unpack(res[c])):
                    col[p] = v
        return out

    def drop(self, gen: int) -> None:
        self._ray.get([u.drop.remote(gen) for u in self.units], timeout=self.timeout_s)

    def shutdown(self) -> None:
        for u in self.units:
            self._ray.kill(u)
        self.units, self.writers = [], []
