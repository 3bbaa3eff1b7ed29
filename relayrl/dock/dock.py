"""The dock: a partitioned, columnar sample store with per-stage controllers.

Implements MindSpeed RL's distributed transfer dock (warehouses sharded along the
batch + one controller per worker state) and AsyncFlow's TransferQueue (data
plane of storage units, control plane of per-task controllers, streaming
loader), with the fixes listed in ``controller.py`` and these:

* **Write, then publish, or raise.** ``put`` stores the data in the units,
  waits for every unit to confirm, then marks the cells present and notifies
  the controllers. It returns only after that; a failed or timed-out write
  raises ``DockWriteError`` and nothing becomes visible.
* **Generations.** Every ``open_partition`` gets a fresh generation number;
  units, controllers and batches are keyed by it, so closing a partition and
  reopening the same name cannot leak readiness or rows (an ack from a batch
  of the old generation raises ``PartitionClosedError``).
* **Where the controllers live (Ray and process backends).** Units are
  actors or processes; the controllers live in the process that owns the
  ``Dock`` (the single-controller driver of HybridFlow). A readiness query is then a lock-protected
  function call (microseconds) instead of an actor round trip (~0.7 ms on this
  machine), the driver is where workers' results arrive anyway, and a waiting
  consumer waits on a ``Condition`` that releases the lock, so producers'
  notifications never queue behind it (the failure of controllers that sleep
  inside their only request thread). Workers in other processes write data
  straight to the units (``reserve``/``slots`` -> ``Slots.write`` there, see
  ``slots.py``) and the driver publishes their receipts, so only metadata
  passes through the driver; departure: a worker cannot query a controller
  itself, the driver does it for the stages it runs. Reads go the same way:
  ``reader`` checks readiness here and hands out a ``RowReader`` that a
  worker reads its rows with.
* **Units for rank processes on one machine (process backend).** The local
  cluster backend runs ranks as spawned processes, which cannot reach units
  that are objects in the driver. ``backend="process"`` serves each unit from
  its own process on a Unix socket (``unitproc.py``), storing the Ray unit's
  packed format with the Ray unit's code; ``Slots`` and ``RowReader`` pickle
  into a rank's call and connect from there. Chosen over starting Ray on one
  machine (seconds to start, a raylet and object store for a few processes)
  and over shared memory (buffer lifetimes across processes that may die).
  The local backend stays the default where no other process touches data:
  its puts store tensors by reference, which no transport can beat.

Row layout: a partition declares ``rows`` (and optionally ``group_size``, the
responses per prompt); new rows get consecutive indexes ``0..rows-1`` in put
order, so a put of whole groups keeps each group's indexes consecutive.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from .checkpoint import check_state, partition_state
from .columns import ColumnSchema
from .config import DockConfig, DockError, PartitionClosedError, StageSpec
from .controller import StageController
from .loader import Batch, StreamLoader, balance_shards
from .plane import LocalPlane, ProcessPlane, RayPlane
from .slots import Receipt, RowReader, Slots, normalize_columns


class _Partition:
    """Metadata of one open partition generation (data lives in the units)."""

    def __init__(self, name: str, gen: int, rows: int, group_size: int, columns: tuple[str, ...] | None) -> None:
        self.name, self.gen, self.rows, self.group_size = name, gen, rows, group_size
        self.declared = None if columns is None else set(columns)
        self.allocated = 0
        self.schemas: dict[str, ColumnSchema] = {}
        self.present: dict[str, np.ndarray] = {}
        self.lengths: dict[str, np.ndarray] = {}
        self.owner = np.zeros(rows, dtype=np.int64)  # storage unit of each row
        self.retired = np.zeros(rows, dtype=bool)  # rows no stage will consume (Dock.retire)
        self.unit_rows: list[int] = []  # rows placed on each unit
        self.lock = threading.Lock()
        self.open = True


class Dock:
    """Sample store: ``put`` rows and columns, ``stream`` them to stages, ``ack`` what was consumed.

    Args:
        units: number of storage units rows are spread over.
        backend: ``"local"`` (in-process), ``"process"`` (one local process per
            unit, reachable from rank processes) or ``"ray"`` (one actor per unit).
        lease_s: seconds a handed-out row stays leased before re-delivery.
        ray_address: passed to ``ray.init`` when Ray is not initialized yet.
        io_timeout_s: limit on one data-plane call (process and Ray backends).
    """

    def __init__(self, units: int = 1, backend: str = "local", lease_s: float = 60.0, *,
                 ray_address: str | None = None, io_timeout_s: float = 60.0, nodes: tuple[str, ...] = ()) -> None:
        cfg = DockConfig(units=units, backend=backend, lease_s=lease_s, nodes=tuple(nodes))  # validates
        if not io_timeout_s > 0:
            raise ValueError(f"Dock: io_timeout_s={io_timeout_s!r} must be > 0 seconds (default 60)")
        self.config = cfg
        self.lease_s = cfg.lease_s
        if cfg.backend == "local":
            self._plane = LocalPlane(cfg.units)
        elif cfg.backend == "process":
            self._plane = ProcessPlane(cfg.units, io_timeout_s)
        else:
            self._plane = RayPlane(cfg.units, ray_address, io_timeout_s, cfg.nodes)
        self._lock = threading.Lock()
        self._parts: dict[str, _Partition] = {}
        self._stages: dict[str, StageController] = {}
        self._next_gen = 1

    @classmethod
    def from_config(cls, cfg: DockConfig, **kwargs: Any) -> "Dock":
        """Build a dock from a ``DockConfig`` (extra keyword options as in ``__init__``)."""
        return cls(units=cfg.units, backend=cfg.backend, lease_s=cfg.lease_s, nodes=cfg.nodes, **kwargs)

    # --- partitions -------------------------------------------------------------------
    def open_partition(self, name: str, rows: int, *, group_size: int = 1, columns: Sequence[str] | None = None) -> None:
        """Open ``name`` for ``rows`` rows (its declared size); ``columns``, if given, are the only ones allowed."""
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"open_partition({name!r}): rows must be a positive int, got {rows!r}")
        if group_size < 1 or rows % group_size:
            raise ValueError(f"open_partition({name!r}): rows={rows} is not a multiple of group_size={group_size}")
        with self._lock:  # lock order: dock -> partition -> controller
            if name in self._parts:
                raise ValueError(f"partition {name!r} is already open; close it first")
            part = _Partition(name, self._next_gen, rows, group_size, None if columns is None else tuple(columns))
            self._next_gen += 1
            with part.lock:
                for ctl in self._stages.values():
                    self._attach(ctl, part)
            self._parts[name] = part

    def close_partition(self, name: str) -> None:
        """Drop a partition's rows from every unit and every controller."""
        with self._lock:
            part = self._parts.pop(name, None)
            stages = list(self._stages.values())
        if part is None:
            raise PartitionClosedError(f"partition {name!r} is not open")
        with part.lock:
            part.open = False
        for ctl in stages:
            ctl.detach(part.gen)
        self._plane.drop(part.gen)

    def partitions(self) -> list[str]:
        with self._lock:
            return list(self._parts)

    def _part(self, name: str) -> _Partition:
        part = self._parts.get(name)
        if part is None:
            raise PartitionClosedError(f"partition {name!r} is not open (open it with dock.open_partition({name!r}, rows=...))")
        return part

    # --- stages -----------------------------------------------------------------------
    def register_stage(self, stage: str, columns: Sequence[str], *, whole_groups: bool = False,
                       token_columns: Sequence[str] | None = None) -> StageSpec:
        """Declare what ``stage`` consumes; ``stream`` does this on first use.

        ``token_columns`` default to the requested columns named ``*_ids``.
        """
        columns = tuple(columns)
        if not columns:
            raise ValueError(f"stage {stage!r}: columns must name at least one column")
        if len(set(columns)) != len(columns):
            raise ValueError(f"stage {stage!r}: columns {list(columns)} contain duplicates")
        toks = tuple(c for c in columns if c.endswith("_ids")) if token_columns is None else tuple(token_columns)
        if not set(toks) <= set(columns):
            raise ValueError(f"stage {stage!r}: token_columns {list(toks)} must be among columns {list(columns)}")
        spec = StageSpec(stage, columns, whole_groups, toks)
        with self._lock:
            ctl = self._stages.get(stage)
            if ctl is not None:
                if ctl.spec == spec:
                    return spec
                if not ctl.idle():
                    raise ValueError(f"stage {stage!r} is registered as {ctl.spec} and has handed out rows of an open "
                                     f"partition; a consumer asked for {spec}")
                ctl.detach_all()  # nothing consumed yet: the new spec replaces the old one
            for part in self._parts.values():
                self._check_columns(part, stage, columns)
            # Writers see the stage at once (a notification before its attach is
            # ignored and the attach scan, under the partition lock, covers it);
            # consumers look stages up under the dock lock, so they see it attached.
            ctl = self._stages[stage] = StageController(spec, self.lease_s)
            for part in self._parts.values():
                with part.lock:
                    if part.open:
                        self._attach(ctl, part)
        return spec

    @staticmethod
    def _check_columns(part: _Partition, stage: str, columns: Sequence[str]) -> None:
        if part.declared is not None:
            unknown = [c for c in columns if c not in part.declared]
            if unknown:
                raise KeyError(f"stage {stage!r} reads columns {unknown} that partition {part.name!r} does not declare "
                               f"(declared: {sorted(part.declared)}); nobody can write them")

    def _attach(self, ctl: StageController, part: _Partition) -> None:
        self._check_columns(part, ctl.spec.stage, ctl.spec.columns)
        ctl.attach(part.gen, part.rows, part.group_size, part.present, part.lengths,
                   owner=part.owner if self._plane.n_units > 1 else None)
        if part.retired.any():
            ctl.retire(part.gen, np.flatnonzero(part.retired))

    def retire(self, partition: str, indexes: Sequence[int] | None = None) -> list[int]:
        """Rows no stage will ever consume: whole prompt groups that DAPO's dynamic sampling dropped, or
        (``indexes=None``) every row not reserved yet, which also closes the partition to new rows. Every stage,
        and every stage registered later, counts them as acknowledged, so neither its batches nor its end wait
        for them. The caller makes sure no stage holds them leased (a stage that reads a column the retired
        rows never get cannot lease them). Returns the retired indexes."""
        part = self._part(partition)
        with self._lock:  # lock order: dock -> partition -> controller
            stages = list(self._stages.values())
            with part.lock:
                self._check_open(part)
                if indexes is None:
                    idx = np.arange(part.allocated, part.rows, dtype=np.int64)
                    part.allocated = part.rows
                else:
                    idx = np.unique(np.asarray(indexes, dtype=np.int64).reshape(-1))
                    bad = idx[(idx < 0) | (idx >= part.rows)]
                    if len(bad):
                        raise IndexError(f"retire({partition!r}): row {int(bad[0])} is outside its {part.rows} rows")
                    g = part.group_size
                    if g > 1 and len(idx) and np.any(np.bincount(idx // g)[np.unique(idx // g)] != g):
                        raise ValueError(f"retire({partition!r}): rows {idx.tolist()[:8]} are not whole groups of {g}")
                for ctl in stages:
                    ctl.retire(part.gen, idx)
                part.retired[idx] = True
        return idx.tolist()

    # --- writes -----------------------------------------------------------------------
    def put(self, partition: str, data: Mapping[str, Any], indexes: Sequence[int] | None = None) -> list[int]:
        """Store columns for new rows (``indexes=None``) or for existing rows; returns the rows' indexes.

        ``data`` maps column -> list with one tensor (``[L_i, *tail]``) or scalar
        per row. Returns after the data is stored and published; raises
        otherwise. Re-writing a cell replaces its value (a re-delivered row may be
        recomputed) without publishing it twice.
        """
        part = self._part(partition)
        where = f"put({partition!r})"
        cols = normalize_columns(where, data, None if indexes is None else len(indexes))
        n = len(next(iter(cols.values())).values)
        with part.lock:  # reject bad input before any data moves
            self._check_open(part)
            schemas = {name: col.schema for name, col in cols.items()}
            self._check_schemas(part, schemas, where)
            slots = self._reserve(part, n, where) if indexes is None else self._existing(part, indexes, where)
            part.schemas.update(schemas)  # checked: each is new or equal to the earlier one
        receipt = slots.write_rows(cols)
        self._publish(part, receipt)
        return slots.indexes

    def reserve(self, partition: str, rows: int) -> Slots:
        """New rows for a writer in another process: ``slots.write(...)`` there, ``dock.publish(receipt)`` here.

        The rows are placed together on the least-filled storage unit; ``rows``
        must be a multiple of the partition's ``group_size``.
        """
        part = self._part(partition)
        with part.lock:
            self._check_open(part)
            return self._reserve(part, rows, f"reserve({partition!r})")

    def slots(self, partition: str, indexes: Sequence[int]) -> Slots:
        """Existing rows, for a writer in another process that fills more of their columns."""
        part = self._part(partition)
        with part.lock:
            self._check_open(part)
            return self._existing(part, indexes, f"slots({partition!r})")

    def publish(self, receipt: Receipt) -> list[int]:
        """Make the cells a ``Slots.write`` stored visible to the stages; returns the rows' indexes.

        Raises ``PartitionClosedError`` if the partition was closed since the slots
        were handed out (the written data is dropped), and ``TypeError``/``KeyError``
        if a column disagrees with earlier rows or the declared columns (the cells
        stay invisible).
        """
        part = self._parts.get(receipt.partition)
        if part is None or part.gen != receipt.gen:
            self._plane.drop(receipt.gen)
            raise PartitionClosedError(f"publish: partition {receipt.partition!r} was closed after its slots were "
                                       "handed out; the written rows are dropped")
        self._publish(part, receipt, check=True)
        return receipt.indexes.tolist()

    def _check_schemas(self, part: _Partition, schemas: Mapping[str, ColumnSchema], where: str) -> None:
        for name, schema in schemas.items():
            if part.declared is not None and name not in part.declared:
                raise KeyError(f"{where}: column {name!r} is not declared (declared: {sorted(part.declared)})")
            old = part.schemas.get(name)
            if old is not None and old != schema:
                raise TypeError(f"{where}: column {name!r} gets {schema.describe()} but earlier rows hold {old.describe()}")

    def _reserve(self, part: _Partition, n: int, where: str) -> Slots:
        """Allocate ``n`` new rows on the least-filled unit (caller holds the partition lock)."""
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{where}: the number of new rows must be a positive int, got {n!r}")
        if n % part.group_size:
            raise ValueError(f"{where}: {n} new rows is not a multiple of group_size={part.group_size}")
        if part.allocated + n > part.rows:
            raise ValueError(f"{where}: {n} new rows would exceed the declared {part.rows} rows "
                             f"({part.allocated} already written)")
        idx = np.arange(part.allocated, part.allocated + n, dtype=np.int64)
        part.allocated += n
        if not part.unit_rows:
            part.unit_rows = [0] * self._plane.n_units
        k = min(range(len(part.unit_rows)), key=part.unit_rows.__getitem__)  # least-filled unit
        part.unit_rows[k] += n
        part.owner[idx] = k
        return self._slots(part, idx)

    def _existing(self, part: _Partition, indexes: Sequence[int], where: str) -> Slots:
        idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
        bad = idx[(idx < 0) | (idx >= part.allocated)]
        if len(bad):
            raise IndexError(f"{where}: row {int(bad[0])} does not exist ({part.allocated} rows written; "
                             "new rows are put without indexes)")
        if len(np.unique(idx)) != len(idx):
            raise ValueError(f"{where}: indexes contain duplicates")
        return self._slots(part, idx)

    def _slots(self, part: _Partition, idx: np.ndarray) -> Slots:
        return Slots(part.name, part.gen, part.rows, idx, part.owner[idx], self._plane)

    def _publish(self, part: _Partition, receipt: Receipt, check: bool = False) -> None:
        idx = receipt.indexes
        with part.lock:
            if not part.open:
                self._plane.drop(part.gen)
                raise PartitionClosedError(f"partition {part.name!r} was closed while a put was in flight; the rows are dropped")
            if check:
                schemas = {name: schema for name, (schema, _) in receipt.columns.items()}
                self._check_schemas(part, schemas, f"publish({part.name!r})")
                part.schemas.update(schemas)
            news = []
            for name, (_, lengths) in receipt.columns.items():
                present = part.present.get(name)
                if present is None:
                    present = part.present[name] = np.zeros(part.rows, dtype=bool)
                    part.lengths[name] = np.zeros(part.rows, dtype=np.int64)
                part.lengths[name][idx] = lengths
                new = idx[~present[idx]]
                present[new] = True
                news.append((name, new))
            stages = list(self._stages.values())
            for ctl in stages:
                for name, new in news:
                    if len(new):
                        ctl.on_written(part.gen, name, new)

    @staticmethod
    def _check_open(part: _Partition) -> None:
        if not part.open:
            raise PartitionClosedError(f"partition {part.name!r} is closed")

    # --- reads ------------------------------------------------------------------------
    def get(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> Batch:
        """Read rows directly (no lease, no readiness check); missing cells raise ``KeyError``."""
        part = self._part(partition)
        idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
        self._check_readable(part, columns, idx)
        return Batch(self, partition, part.gen, None, idx.tolist(), self._plane.read(part.gen, columns, idx, part.owner[idx], part.schemas), None)

    def reader(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> RowReader:
        """A handle that reads ``columns`` of rows ``indexes`` from any process: ``reader.read()`` there.

        Checks now that every requested cell is written (``KeyError``/``IndexError``
        as ``get``). The reader holds the partition's generation: a read after
        ``close_partition`` raises ``PartitionClosedError``. Picklable with the
        process and Ray backends; with the local one it works in this process only.
        """
        part = self._part(partition)
        idx = np.asarray(indexes, dtype=np.int64).reshape(-1)
        columns = tuple(columns)
        if not len(idx) or not columns:
            raise ValueError(f"reader({partition!r}): give at least one row and one column")
        with part.lock:
            self._check_open(part)
            self._check_readable(part, columns, idx)
            schemas = {c: part.schemas[c] for c in columns}
        return RowReader(part.name, part.gen, idx, part.owner[idx], columns, schemas, self._plane)

    @staticmethod
    def _check_readable(part: _Partition, columns: Sequence[str], idx: np.ndarray) -> None:
        for c in columns:
            present = part.present.get(c)
            if present is None:
                raise KeyError(f"partition {part.name!r}: column {c!r} has not been written to any row "
                               f"(written columns: {sorted(part.present)})")
            if len(idx) and ((idx < 0) | (idx >= part.rows)).any():
                raise IndexError(f"partition {part.name!r}: indexes must lie in [0, {part.rows})")
            missing = idx[~present[idx]]
            if len(missing):
                raise KeyError(f"partition {part.name!r}: row {int(missing[0])} has no value for column {c!r}")

    def stream(self, partition: str, stage: str, columns: Sequence[str], batch_size: int | None = None, *,
               max_tokens: int | None = None, whole_groups: bool = False, dp_size: int = 1,
               token_columns: Sequence[str] | None = None, consumer_id: str | None = None,
               timeout_s: float | None = None, auto_ack: bool = False) -> StreamLoader:
        """Iterate ``stage``'s batches of ``partition`` as rows become ready; stops when all are acknowledged.

        Args:
            batch_size: rows per batch (per data-parallel shard when ``dp_size > 1``).
            max_tokens: token budget per batch instead of (or on top of) ``batch_size``.
            whole_groups: batches hold only complete groups of ``group_size`` rows.
            dp_size: split each batch into this many token-balanced ``batch.shards``.
            consumer_id: lease holder name (for ``release``); one per loader by default.
            timeout_s: raise ``TimeoutError`` if no batch arrives within this time.
            auto_ack: acknowledge the previous batch when the next one is requested.
        """
        part = self._part(partition)
        if batch_size is None and max_tokens is None:
            raise ValueError("stream: give batch_size, max_tokens, or both")
        if batch_size is not None:
            if batch_size < 1:
                raise ValueError(f"stream: batch_size must be >= 1, got {batch_size}")
            if batch_size * dp_size > part.rows:
                raise ValueError(f"stream: batch_size={batch_size} x dp_size={dp_size} exceeds partition {partition!r}'s "
                                 f"{part.rows} rows")
            if whole_groups and batch_size % part.group_size:
                raise ValueError(f"stream: whole_groups needs batch_size a multiple of group_size={part.group_size}, "
                                 f"got {batch_size}")
        if dp_size < 1:
            raise ValueError(f"stream: dp_size must be >= 1, got {dp_size}")
        spec = self.register_stage(stage, columns, whole_groups=whole_groups, token_columns=token_columns)
        if max_tokens is not None and not spec.token_columns:
            raise ValueError(f"stream: max_tokens needs token columns; stage {stage!r} reads {list(columns)} and none is "
                             "named *_ids (pass token_columns=...)")
        return StreamLoader(self, partition, stage, batch_size, max_tokens, dp_size, consumer_id, timeout_s, auto_ack)

    def acquire(self, partition: str, stage: str, *, batch_size: int | None, max_tokens: int | None = None,
                dp_size: int = 1, consumer_id: str = "default", timeout_s: float | None = None,
                eager: bool = False, read: bool = True) -> Batch | None:
        """Lease and read one batch for a registered stage; ``None`` when the partition is fully acknowledged.

        ``eager``: grant what is ready as soon as one scheduling unit is (up to ``batch_size``), instead of
        waiting for a full batch. ``read=False``: lease the rows without reading them (the batch holds
        indexes and no columns): the caller hands the indexes to a worker that reads the rows from the
        units itself, so no sample data passes through the caller."""
        part = self._part(partition)
        with self._lock:
            ctl = self._stages.get(stage)
        if ctl is None:
            raise KeyError(f"stage {stage!r} is not registered (call dock.stream or dock.register_stage first)")
        us = part.group_size if ctl.spec.whole_groups else 1
        n_units = None if batch_size is None else max(1, batch_size * dp_size // us)
        budget = None if max_tokens is None else max_tokens * dp_size
        grant = ctl.acquire(part.gen, consumer_id, n_units, budget, timeout_s, describe=f" on partition {partition!r}",
                            eager=eager)
        if grant is None:
            return None
        idx = np.asarray(grant.rows, dtype=np.int64)
        try:
            data = (self._plane.read(part.gen, ctl.spec.columns, idx, part.owner[idx], part.schemas) if read
                    else {})
        except Exception as e:
            ctl.release(consumer_id)
            raise DockError(f"stage {stage!r}: reading rows {grant.rows[:8]}... failed: {e!r}") from e
        tokens = None
        if ctl.spec.token_columns:
            tokens = sum(part.lengths[c][idx] for c in ctl.spec.token_columns).tolist()
        batch = Batch(self, partition, part.gen, stage, grant.rows, data, grant.lease_id, tokens)
        if dp_size > 1:
            batch.shards = self._shard(batch, grant.rows, us, dp_size)
        return batch

    @staticmethod
    def _shard(batch: Batch, rows: list[int], us: int, k: int) -> list[Batch]:
        # Items are scheduling units (rows, or groups): positions of consecutive rows sharing r // us.
        items: list[list[int]] = []
        for p, r in enumerate(rows):
            if items and rows[items[-1][0]] // us == r // us:
                items[-1].append(p)
            else:
                items.append([p])
        tok = batch.tokens() or [1] * len(rows)
        weights = [sum(tok[p] for p in it) for it in items]
        shards = balance_shards(weights, [len(it) for it in items], k)
        return [batch.select([p for i in sh for p in items[i]]) for sh in shards]

    # --- acknowledgements and failures ------------------------------------------------
    def ack(self, partition: str, gen: int, stage: str, lease_id: int, indexes: Sequence[int]) -> list[int]:
        """Acknowledge rows of a lease handed out earlier by its ``(gen, lease_id)`` (``Batch.generation``,
        ``Batch.lease_id``), for a consumer that holds no ``Batch`` object (the service API's remote
        consumers); returns the rows retired by this call, as ``Batch.ack``."""
        return self._ack(partition, gen, stage, lease_id, list(indexes))

    def _ack(self, partition: str, gen: int, stage: str | None, lease: int, indexes: list[int]) -> list[int]:
        part = self._parts.get(partition)
        if part is None:
            raise PartitionClosedError(f"ack: the batch's partition {partition!r} has been closed since it was handed out")
        if part.gen != gen:
            raise PartitionClosedError(f"ack: partition {partition!r} is open as generation {part.gen}, not the "
                                       f"batch's generation {gen}: it has been closed since it was handed out and "
                                       f"opened again, or generation {gen} is not one a lease gave")
        ctl = self._stages.get(stage) if stage is not None else None
        if ctl is None:
            raise KeyError(f"ack: stage {stage!r} is not registered")
        return ctl.ack(gen, lease, indexes)

    def release(self, consumer_id: str) -> int:
        """Declare ``consumer_id`` dead: its leased rows are re-delivered now. Returns rows re-queued."""
        with self._lock:
            stages = list(self._stages.values())
        return sum(ctl.release(consumer_id) for ctl in stages)

    def progress(self, partition: str, stage: str) -> dict[str, int]:
        """Counts for one stage: rows, acked, ready/leased/waiting scheduling units."""
        part = self._part(partition)
        if stage not in self._stages:
            raise KeyError(f"stage {stage!r} is not registered")
        return self._stages[stage].progress(part.gen)

    def shutdown(self) -> None:
        """Close every partition and stop the units (kills the unit actors or processes).

        The units stop even if dropping a partition fails; a unit already lost
        (``DockError``) is not reported again here.
        """
        try:
            for name in self.partitions():
                with contextlib.suppress(DockError):  # a unit already reported dead: stop the rest anyway
                    self.close_partition(name)
        finally:
            self._plane.shutdown()

    # --- checkpoints (see checkpoint.py) ----------------------------------------------
    def state_dict(self, partition: str) -> dict[str, Any]:
        part = self._part(partition)
        with self._lock:
            stages = dict(self._stages)
        return partition_state(partition, part, stages, lambda c, rows: self._plane.read(
            part.gen, [c], rows, part.owner[rows], part.schemas)[c])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Re-open the partition ``state`` describes (this dock must not have it open)."""
        check_state(state)
        name = state["name"]
        self.open_partition(name, state["rows"], group_size=state["group_size"], columns=state["columns"])
        for stage, spec in state["stages"].items():
            self.register_stage(stage, spec["columns"], whole_groups=spec["whole_groups"],
                                token_columns=spec["token_columns"])
        part = self._part(name)
        with part.lock:
            part.allocated = int(state["allocated"])
        for stage, spec in state["stages"].items():
            self._stages[stage].set_acked(part.gen, np.asarray(spec["acked"], dtype=np.int64))
        for column, cell in state["data"].items():
            self.put(name, {column: cell["values"]}, indexes=cell["indexes"])
