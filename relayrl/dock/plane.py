"""Data plane: spreads rows over storage units and gathers them back in request order.

Row ``i`` of a partition lives in unit ``i % n_units``, so consecutive rows
(the responses of one prompt) are spread over all units and every unit takes
an equal share of each put and each read.

``LocalPlane`` calls in-process ``LocalUnit`` objects. ``RayPlane`` owns one
Ray actor per unit (spread over nodes with Ray's ``SPREAD`` strategy, which
gives one unit per node when ``units`` equals the node count); a put packs
each column's rows into one flat numpy buffer + lengths per unit, sends all
units' shares concurrently and returns only after every unit has confirmed
(or raises ``DockWriteError``); a read asks all units concurrently and
rebuilds rows as views of one writable buffer per column and unit.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .columns import ColumnSchema, pack, unpack
from .config import DockWriteError
from .units import LocalUnit, make_ray_unit_class


def _split_by_unit(idx: np.ndarray, n_units: int) -> list[np.ndarray]:
    """Positions (into ``idx``) of the rows each unit holds."""
    if n_units == 1:
        return [np.arange(len(idx))]
    owner = idx % n_units
    return [np.flatnonzero(owner == k) for k in range(n_units)]


class LocalPlane:
    """In-process units; rows are stored by reference."""

    def __init__(self, n_units: int) -> None:
        self.n_units = n_units
        self.units = [LocalUnit() for _ in range(n_units)]

    def write(self, gen: int, n_rows: int, idx: np.ndarray, columns: dict[str, tuple[list[torch.Tensor], ColumnSchema]]) -> None:
        rows = idx.tolist()
        for k, pos in enumerate(_split_by_unit(idx, self.n_units)):
            if len(pos) == 0:
                continue
            if self.n_units == 1:
                for name, (vals, _) in columns.items():
                    self.units[0].put(gen, name, rows, vals)
            else:
                pl = pos.tolist()
                for name, (vals, _) in columns.items():
                    self.units[k].put(gen, name, [rows[p] for p in pl], [vals[p] for p in pl])

    def read(self, gen: int, columns: Sequence[str], idx: np.ndarray, schemas: dict[str, ColumnSchema]) -> dict[str, list[torch.Tensor]]:
        if self.n_units == 1:
            return self.units[0].get(gen, columns, idx.tolist())
        out: dict[str, list] = {c: [None] * len(idx) for c in columns}
        for k, pos in enumerate(_split_by_unit(idx, self.n_units)):
            if len(pos) == 0:
                continue
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

    def write(self, gen: int, n_rows: int, idx: np.ndarray, columns: dict[str, tuple[list[torch.Tensor], ColumnSchema]]) -> None:
        refs = []
        for k, pos in enumerate(_split_by_unit(idx, self.n_units)):
            if len(pos) == 0:
                continue
            pl = pos.tolist()
            packed = {
                name: pack(vals if self.n_units == 1 else [vals[p] for p in pl], schema)
                for name, (vals, schema) in columns.items()
            }
            refs.append(self.units[k].put.remote(gen, n_rows, idx[pos], packed))
        try:
            self._ray.get(refs, timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure means the rows are not stored
            raise DockWriteError(f"put of {len(idx)} rows (columns {list(columns)}) was not stored: {e!r}") from e

    def read(self, gen: int, columns: Sequence[str], idx: np.ndarray, schemas: dict[str, ColumnSchema]) -> dict[str, list[torch.Tensor]]:
        parts = [(pos, self.units[k].get.remote(gen, list(columns), idx[pos])) for k, pos in enumerate(_split_by_unit(idx, self.n_units)) if len(pos)]
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
        self.units = []
