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

``ProcessPlane`` (``backend="process"``) does the same with one local process
per unit (``unitproc.py``): same packing, same unit body, a Unix socket
instead of Ray calls. It is how rank processes of the local cluster backend
reach the units: the plane pickles into a few hundred bytes (socket paths,
unit pids, the authkey), and each process that unpickles it (inside ``Slots``
or a ``RowReader``) connects on first use, so a rollout rank writes its
samples and a trainer rank reads its micro-batches without the driver
touching the data. Chosen over Ray for one machine because it starts in a
second with no cluster, and over shared memory because the lifetime of every
buffer stays with one process (the unit), whoever dies.
"""

from __future__ import annotations

import os
import weakref
from typing import Sequence

import numpy as np
import torch

from . import traffic
from .columns import ColumnSchema, PackedColumn, Rows, pack, unpack
from .config import DockError, DockWriteError, PartitionClosedError, UnitLostError, UnitLostWriteError
from .payload import payload_bytes
from .units import LocalUnit, make_ray_unit_class
from .unitproc import UnitClient, fan_out, start_units, stop_units
from .wire import UnitWriter, put_many_args


def _split_by_unit(owner: np.ndarray, n_units: int) -> list[tuple[int, np.ndarray]]:
    """``(unit, positions)`` for each unit that holds some of the rows (``owner[i]``: unit of row i)."""
    first = int(owner[0]) if len(owner) else 0
    if n_units == 1 or (owner == first).all():
        return [(first, np.arange(len(owner)))]
    return [(k, pos) for k in range(n_units) if len(pos := np.flatnonzero(owner == k))]


def _pack_shares(owner: np.ndarray, n_units: int, columns: dict[str, Rows]) -> list[tuple[int, np.ndarray, dict[str, PackedColumn]]]:
    """``(unit, positions, {column: packed rows})`` for each unit that gets some of a write's rows."""
    parts = _split_by_unit(owner, n_units)
    return [(k, pos, {
        name: pack(vals, schema, lengths) if len(parts) == 1 else pack([vals[p] for p in pos.tolist()], schema, lengths[pos])
        for name, (vals, schema, lengths) in columns.items()
    }) for k, pos in parts]


def _raise_write_errors(errors: list[BaseException], n: int, columns: dict[str, Rows]) -> None:
    if not errors:
        return
    e = errors[0]
    if isinstance(e, PartitionClosedError):  # a unit refuses writes to a dropped generation
        raise PartitionClosedError(f"put of {n} rows: the partition was closed; nothing is stored") from e
    lost = next((x for x in errors if isinstance(x, UnitLostError)), None)
    if lost is not None:  # (recoverable by run.max_restarts, as a lost unit met by a read)
        raise UnitLostWriteError(f"put of {n} rows (columns {list(columns)}) was not stored: {lost}",
                                 node_id=lost.node_id) from lost
    raise DockWriteError(f"put of {n} rows (columns {list(columns)}) was not stored: {type(e).__name__}: {e}") from e


def _gather(columns: Sequence[str], n: int, parts: list[tuple[np.ndarray, dict[str, PackedColumn]]]) -> dict[str, list[torch.Tensor]]:
    """Rows in request order from each unit's reply (``parts``: positions in the request, packed columns)."""
    if len(parts) == 1:
        return {c: unpack(parts[0][1][c]) for c in columns}
    out: dict[str, list] = {c: [None] * n for c in columns}
    for pos, res in parts:
        pl = pos.tolist()
        for c in columns:
            col = out[c]
            for p, v in zip(pl, unpack(res[c])):
                col[p] = v
    return out


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
        raise TypeError("the local dock's storage units live in the driver process: Slots and RowReaders of a "
                        "backend='local' dock cannot be sent to another process (use dock.put/dock.get in the driver, "
                        "or Dock(backend='process') for rank processes on this machine, or backend='ray')")

    def shutdown(self) -> None:
        self.units = []


class RayPlane:
    """One Ray actor per unit; packed numpy buffers on the wire."""

    START_S = 120.0  # how long the units may take to start (at least the I/O timeout)

    def __init__(self, n_units: int, address: str | None, timeout_s: float, nodes: Sequence[str] = ()) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self.n_units = n_units
        self.timeout_s = timeout_s
        actor = make_ray_unit_class()
        have = ray.cluster_resources()
        missing = [ip for ip in nodes if f"node:{ip}" not in have]
        if missing:
            from relayrl.cluster.ray_backend import node_ips

            raise DockError(f"dock.nodes names {', '.join(missing)}, not in the Ray cluster (its nodes: "
                            f"{', '.join(node_ips())})")
        self.units = [actor.options(resources={f"node:{nodes[i % len(nodes)]}": 1e-3}).remote() if nodes else
                      actor.options(scheduling_strategy="SPREAD").remote() for i in range(n_units)]
        # a unit's start (a worker process, its imports) is not I/O: on a busy machine it takes longer than a
        # write may, so it gets its own bound
        start_s = max(timeout_s, self.START_S)
        try:
            self.hosts = ray.get([u.where.remote() for u in self.units], timeout=start_s)
        except ray.exceptions.GetTimeoutError:
            for u in self.units:
                ray.kill(u)
            raise DockError(f"the dock's {n_units} Ray storage units did not start within {start_s:.0f} s (is the "
                            f"cluster short of CPUs? each unit is an actor)") from None
        self.writers = [UnitWriter(u, ray, timeout_s) for u in self.units]

    # Slots carry the plane to writers in other processes: the unit handles travel, each process
    # gets its own group-committing writers.
    def __getstate__(self) -> dict:
        return {"n_units": self.n_units, "timeout_s": self.timeout_s, "units": self.units, "hosts": self.hosts}

    def __setstate__(self, state: dict) -> None:
        import ray

        self._ray = ray
        self.n_units, self.timeout_s, self.units = state["n_units"], state["timeout_s"], state["units"]
        self.hosts = state["hosts"]
        self.writers = [UnitWriter(u, ray, self.timeout_s) for u in self.units]

    def write(self, gen: int, n_rows: int, idx: np.ndarray, owner: np.ndarray,
              columns: dict[str, Rows]) -> None:
        shares = _pack_shares(owner, self.n_units, columns)
        # Every submitted write is waited for, even after one failed: the first waiter back from a
        # call is what lets the writer send the next one.
        tickets = [(self.writers[k], self.writers[k].submit(gen, n_rows, idx[pos], packed)) for k, pos, packed in shares]
        traffic.add("units", payload_bytes(columns))
        errors = []
        for k, (writer, t) in zip((k for k, _, _ in shares), tickets):
            try:
                writer.wait(t)
            except Exception as e:  # noqa: BLE001 - any failure means the rows are not stored
                errors.append(self._lost(k, "put", e) or e)
        _raise_write_errors(errors, len(idx), columns)

    def _lost(self, unit: int | None, op: str, e: BaseException) -> UnitLostError | None:
        """A :class:`UnitLostError` naming the unit and its host when ``e`` says its actor died, else None.
        Its ``node_id`` lets a restart wait until Ray has marked a lost host dead."""
        if not isinstance(e, self._ray.exceptions.RayActorError):
            return None
        who = f"Ray storage unit {unit} (host {self.hosts[unit][0]})" if unit is not None else "a Ray storage unit"
        return UnitLostError(f"{who} died; its rows are lost [{op}: {type(e).__name__}: {str(e).splitlines()[0]}]",
                             node_id=self.hosts[unit][1] if unit is not None else None)

    def _get(self, refs: list, units: list[int], op: str) -> list:
        """``ray.get`` of one call per unit in ``units``; a dead unit's actor error becomes :class:`UnitLostError`."""
        try:
            return self._ray.get(refs, timeout=self.timeout_s)
        except self._ray.exceptions.RayActorError as e:
            dead = next((k for k, r in zip(units, refs) if _failed(self._ray, r)), None)
            raise self._lost(dead, op, e) from e

    def read(self, gen: int, columns: Sequence[str], idx: np.ndarray, owner: np.ndarray,
             schemas: dict[str, ColumnSchema]) -> dict[str, list[torch.Tensor]]:
        split = _split_by_unit(owner, self.n_units)
        parts = [(pos, self.units[k].get.remote(gen, list(columns), idx[pos])) for k, pos in split]
        got = self._get([ref for _, ref in parts], [k for k, _ in split], "get")
        out = _gather(columns, len(idx), [(pos, res) for (pos, _), res in zip(parts, got)])
        traffic.add("units", payload_bytes(out))
        return out

    def drop(self, gen: int) -> None:
        self._get([u.drop.remote(gen) for u in self.units], list(range(self.n_units)), "drop")

    def shutdown(self) -> None:
        for u in self.units:
            self._ray.kill(u)
        self.units, self.writers = [], []


def _failed(ray, ref) -> bool:
    """Whether the finished call ``ref`` raised (a call still running has not)."""
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - any failure of this call
        return True
    return False


# This process's clients of each unit set, shared by every copy of a ProcessPlane (each call that
# carries Slots or a RowReader unpickles a new copy): connections are opened once per process.
_CLIENTS: dict[tuple, list[UnitClient]] = {}


class ProcessPlane:
    """One local process per unit (``unitproc.py``); packed numpy buffers on a Unix socket.

    Picklable: a copy in another process (inside ``Slots`` or a ``RowReader``)
    connects to the units on first use; a process made by ``fork`` opens its
    own connections too. Only the plane that started the units stops them.
    """

    def __init__(self, n_units: int, timeout_s: float, start_timeout_s: float = 120.0) -> None:
        self.n_units, self.timeout_s = n_units, timeout_s
        root, self._authkey, self._addresses, procs = start_units(n_units, start_timeout_s)
        self.pids = [p.pid for p in procs]
        self._procs: list | None = procs
        self._owner_pid = os.getpid()
        self._finalizer = weakref.finalize(self, stop_units, self._owner_pid, procs, root)

    def __getstate__(self) -> dict:
        return {"n_units": self.n_units, "timeout_s": self.timeout_s, "authkey": self._authkey,
                "addresses": self._addresses, "pids": self.pids}

    def __setstate__(self, state: dict) -> None:
        self.n_units, self.timeout_s, self.pids = state["n_units"], state["timeout_s"], state["pids"]
        self._authkey, self._addresses = state["authkey"], state["addresses"]
        self._procs, self._owner_pid, self._finalizer = None, -1, None

    def _units(self) -> list[UnitClient]:
        if not self._addresses:
            raise DockError("the dock's storage units were shut down")
        key = (os.getpid(), *self._addresses)
        clients = _CLIENTS.get(key)
        if clients is None:
            procs = self._procs if self._owner_pid == os.getpid() else [None] * self.n_units
            clients = _CLIENTS.setdefault(key, [UnitClient(k, a, self._authkey, pid, self.timeout_s, proc)
                                                for k, (a, pid, proc) in enumerate(zip(self._addresses, self.pids, procs))])
        return clients

    def write(self, gen: int, n_rows: int, idx: np.ndarray, owner: np.ndarray,
              columns: dict[str, Rows]) -> None:
        units = self._units()
        shares = _pack_shares(owner, self.n_units, columns)
        got = fan_out([(units[k], "put_many", put_many_args([(gen, n_rows, idx[pos], packed)], inline_bytes=0))
                       for k, pos, packed in shares])
        traffic.add("units", payload_bytes(columns))
        errors = []
        for r in got:  # an exception, or put_many's list: None per stored write, else why it was refused
            if isinstance(r, BaseException):
                errors.append(r)
            elif r[0] is not None:
                errors.append(PartitionClosedError(r[0]))
        _raise_write_errors(errors, len(idx), columns)

    def read(self, gen: int, columns: Sequence[str], idx: np.ndarray, owner: np.ndarray,
             schemas: dict[str, ColumnSchema]) -> dict[str, list[torch.Tensor]]:
        units = self._units()
        parts = _split_by_unit(owner, self.n_units)
        got = fan_out([(units[k], "get", (gen, list(columns), idx[pos])) for k, pos in parts])
        for r in got:
            if isinstance(r, BaseException):
                raise r
        out = _gather(columns, len(idx), [(pos, res) for (_, pos), res in zip(parts, got)])
        traffic.add("units", payload_bytes(out))
        return out

    def drop(self, gen: int) -> None:
        units = self._units()
        for r in fan_out([(u, "drop", (gen,)) for u in units]):
            if isinstance(r, BaseException):
                raise r

    def shutdown(self) -> None:
        """Stop the unit processes and remove their sockets (in the process that started them; else a no-op)."""
        if self._finalizer is None or self._owner_pid != os.getpid():
            return
        for c in _CLIENTS.pop((os.getpid(), *self._addresses), []):
            c.close()
        self._finalizer()
        self._addresses = []
