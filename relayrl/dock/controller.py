"""Stage controllers: the control plane of the dock (MindSpeed RL's TD controllers, AsyncFlow §3.3).

One ``StageController`` per consuming stage keeps, for each open partition,
which rows carry every column the stage needs and which it has handed out.
Consumers ask it for ready rows (metadata only), read the data from the units,
then acknowledge.

Where this departs from MindSpeed RL's transfer dock and AsyncFlow's TransferQueue (paper and code):

* **Incremental readiness.** TransferQueue scans a rows x columns status table on
  every request. Here a row keeps a count of the needed columns present; a
  write bumps the counts of the rows it touched and a row (or a whole group)
  enters a FIFO ready queue when its count reaches the need. A request pops
  from the queue: O(rows returned), independent of history.
* **Leases, not consumption marks.** TransferQueue marks rows consumed when it
  hands them out, so a consumer that dies loses them. Here a hand-out is a
  lease with an expiry; only ``ack`` retires rows (exactly once: an ack from a
  lease that expired and was re-leased is refused), expired leases and leases
  of consumers declared dead (``release``) go back to the front of the queue.
* **Event-driven waits.** A waiting request waits on a ``threading.Condition``
  with a deadline (the caller's timeout or the next lease expiry) and releases
  the lock while waiting, so writers' notifications are never blocked.
* **Declared size.** "All consumed" means every one of the partition's
  declared rows is acknowledged, not "everything registered so far".

Scheduling unit: a row, or with ``whole_groups`` a group of ``group_size``
consecutive indexes (all responses of one prompt), leased and re-delivered as
one; rows of a group already acknowledged are not re-delivered.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .config import PartitionClosedError, StageSpec

_lease_ids = itertools.count(1)


@dataclass
class Lease:
    """Units handed to one consumer until ``expiry`` (``time.monotonic`` seconds)."""

    lease_id: int
    consumer: str
    units: set[int]
    expiry: float


@dataclass
class Grant:
    """Answer to a request: the rows leased (``rows``), in unit order."""

    lease_id: int
    rows: list[int]
    units: list[int]


@dataclass
class _PartState:
    """One stage's view of one partition generation."""

    rows: int
    unit_size: int
    need: int
    lengths: dict[str, np.ndarray]  # shared with the partition: row lengths per column
    token_columns: tuple[str, ...]
    owner: np.ndarray | None = None  # row -> storage unit, shared with the partition (None: one unit)
    count: np.ndarray = field(init=False)
    unit_ready: np.ndarray = field(init=False)
    unit_unacked: np.ndarray = field(init=False)
    lease_of: np.ndarray = field(init=False)
    acked: np.ndarray = field(init=False)
    ready: deque = field(default_factory=deque)
    ready_tokens: int = 0
    unit_tokens: dict = field(default_factory=dict)
    leases: dict = field(default_factory=dict)
    heap: list = field(default_factory=list)
    n_leased: int = 0
    n_done: int = 0
    closed: bool = False

    def __post_init__(self) -> None:
        n_units = self.rows // self.unit_size
        self.count = np.zeros(self.rows, dtype=np.int32)
        self.unit_ready = np.zeros(n_units, dtype=np.int32)
        self.unit_unacked = np.full(n_units, self.unit_size, dtype=np.int32)
        self.lease_of = np.zeros(n_units, dtype=np.int64)
        self.acked = np.zeros(self.rows, dtype=bool)

    @property
    def n_units(self) -> int:
        return len(self.unit_unacked)

    def unit_rows(self, u: int) -> list[int]:
        lo = u * self.unit_size
        return [r for r in range(lo, lo + self.unit_size) if not self.acked[r]]

    def tokens_of(self, rows: list[int]) -> int:
        return int(sum(int(self.lengths[c][rows].sum()) for c in self.token_columns if c in self.lengths))

    def enqueue(self, u: int, front: bool = False) -> None:
        t = self.tokens_of(self.unit_rows(u)) if self.token_columns else 0
        self.unit_tokens[u] = t
        self.ready_tokens += t
        if front:
            self.ready.appendleft(u)
        else:
            self.ready.append(u)

    def pending(self) -> int:
        """Units neither done, leased nor ready: they still wait for columns."""
        return self.n_units - self.n_done - self.n_leased - len(self.ready)


class StageController:
    """Readiness, leases and acknowledgements of one stage over all open partitions."""

    def __init__(self, spec: StageSpec, lease_s: float) -> None:
        self.spec = spec
        self.lease_s = lease_s
        self._need = set(spec.columns)
        self._cond = threading.Condition()
        self._parts: dict[int, _PartState] = {}

    # --- partitions -------------------------------------------------------------------
    def attach(self, gen: int, rows: int, group_size: int, present: dict[str, np.ndarray], lengths: dict[str, np.ndarray],
               owner: np.ndarray | None = None) -> None:
        """Start tracking a partition generation; ``present`` seeds readiness from rows already written.

        ``owner`` (row -> storage unit) lets a grant prefer rows of one storage
        unit, so that reading a batch is one request. The caller holds the
        partition's lock, so no write is published meanwhile.
        """
        st = _PartState(
            rows=rows,
            unit_size=group_size if self.spec.whole_groups else 1,
            need=len(self._need),
            lengths=lengths,
            token_columns=self.spec.token_columns,
            owner=owner,
        )
        with self._cond:
            self._parts[gen] = st
            have = [present[c] for c in self.spec.columns if c in present]
            if have:
                self._mark(st, np.flatnonzero(np.sum(have, axis=0) >= 1), bump=np.sum(have, axis=0))

    def detach(self, gen: int) -> None:
        with self._cond:
            st = self._parts.pop(gen, None)
            if st is not None:
                st.closed = True
            self._cond.notify_all()

    def detach_all(self) -> None:
        with self._cond:
            gens = list(self._parts)
        for gen in gens:
            self.detach(gen)

    def idle(self) -> bool:
        """True if no open partition has rows leased or acknowledged by this stage."""
        with self._cond:
            return all(st.n_leased == 0 and not st.leases and not st.acked.any() for st in self._parts.values())

    def set_acked(self, gen: int, rows: np.ndarray) -> None:
        """Mark rows acknowledged without a lease (restoring a checkpoint)."""
        with self._cond:
            st = self._part(gen)
            rows = np.asarray(rows, dtype=np.int64)
            self._ack_rows(st, rows[~st.acked[rows]])

    def retire(self, gen: int, rows: np.ndarray) -> None:
        """Rows no consumer will take (``Dock.retire``): acknowledged without a lease and out of the ready
        queue; a waiting ``acquire`` sees the partition end without them. Leased rows are refused."""
        with self._cond:
            st = self._part(gen)
            rows = np.asarray(rows, dtype=np.int64)
            rows = rows[~st.acked[rows]]
            units = np.unique(rows // st.unit_size)
            leased = units[st.lease_of[units] != 0]
            if len(leased):
                raise ValueError(f"stage {self.spec.stage!r} holds rows {rows.tolist()[:8]} leased; they cannot be "
                                 f"retired")
            gone = set(units.tolist())
            if gone and st.ready:
                for u in st.ready:
                    if u in gone:
                        st.ready_tokens -= st.unit_tokens.pop(u, 0)
                st.ready = deque(u for u in st.ready if u not in gone)
            self._ack_rows(st, rows)
            self._cond.notify_all()

    # --- notifications (writers) -------------------------------------------------------
    def on_written(self, gen: int, column: str, rows: np.ndarray) -> None:
        """Rows that just received ``column`` for the first time (after the data is stored)."""
        if column not in self._need:
            return
        with self._cond:
            st = self._parts.get(gen)
            if st is not None and self._mark(st, rows, bump=None):
                self._cond.notify_all()

    def _mark(self, st: _PartState, rows: np.ndarray, bump) -> bool:
        if bump is None:
            st.count[rows] += 1
        else:
            st.count[:] = bump
        full = rows[st.count[rows] >= st.need]
        if len(full) == 0:
            return False
        if st.unit_size == 1:
            units = full
        else:
            u = full // st.unit_size
            np.add.at(st.unit_ready, u, 1)
            units = np.unique(u)
            units = units[st.unit_ready[units] == st.unit_size]
        units = units[(st.unit_unacked[units] > 0) & (st.lease_of[units] == 0)]
        if len(units) == 0:
            return False
        if st.unit_size == 1 and not st.acked[units].any():
            # First readiness of single rows: tokens in one vectorized pass.
            toks = [st.lengths[c][units] for c in st.token_columns if c in st.lengths]
            tok = np.sum(toks, axis=0).tolist() if toks else [0] * len(units)
            ul = units.tolist()
            st.unit_tokens.update(zip(ul, tok))
            st.ready_tokens += sum(tok)
            st.ready.extend(ul)
        else:
            for u in units.tolist():
                st.enqueue(u)
        return True

    # --- requests (consumers) ----------------------------------------------------------
    def acquire(
        self,
        gen: int,
        consumer: str,
        n_units: int | None,
        max_tokens: int | None,
        timeout_s: float | None,
        describe: str = "",
        eager: bool = False,
    ) -> Grant | None:
        """Lease the next ready units; ``None`` once every row of the partition is acknowledged.

        Returns as soon as ``n_units`` units (or ``max_tokens`` tokens) are ready,
        or fewer when no more rows can become ready except through lease expiry;
        ``eager``: as soon as one unit is ready (up to ``n_units`` of those ready then:
        a streaming stage takes what has arrived instead of waiting for a full batch).
        Raises ``TimeoutError`` after ``timeout_s`` without a grant.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                st = self._part(gen)
                now = time.monotonic()
                self._expire(st, now)
                if st.n_done == st.n_units:
                    return None
                if st.ready:
                    enough = eager or (n_units is not None and len(st.ready) >= n_units) or (
                        max_tokens is not None and st.ready_tokens >= max_tokens
                    )
                    if enough or st.pending() == 0:
                        return self._grant(st, consumer, n_units, max_tokens, now)
                wake = [t for t in (deadline, st.heap[0][0] if st.heap else None) if t is not None]
                if deadline is not None and now >= deadline:
                    raise TimeoutError(
                        f"stage {self.spec.stage!r}{describe}: no batch within {timeout_s:.3g}s "
                        f"({len(st.ready)} units ready, {st.n_leased} leased, {st.pending()} waiting for columns "
                        f"{list(self.spec.columns)}, {st.n_done}/{st.n_units} done)"
                    )
                self._cond.wait(None if not wake else max(0.0, min(wake) - now))

    @staticmethod
    def _home_first(st: _PartState) -> None:
        """Reorder the ready queue: units stored where the oldest one is come first, the rest keep FIFO order.

        The head stays the oldest ready unit, so no unit waits forever; a batch
        then reads from as few storage units as readiness allows.
        """
        if st.owner is None or len(st.ready) < 2:
            return
        queued = np.fromiter(st.ready, dtype=np.int64, count=len(st.ready))
        where = st.owner[queued * st.unit_size]
        away = where != where[0]
        if away.any():
            st.ready = deque(queued[np.argsort(away, kind="stable")].tolist())

    def _grant(self, st: _PartState, consumer: str, n_units: int | None, max_tokens: int | None, now: float) -> Grant:
        self._home_first(st)
        units: list[int] = []
        rows: list[int] = []
        tokens = 0
        if max_tokens is None and n_units is not None and st.unit_size == 1:  # a row count only: no budget check
            pop, drop = st.ready.popleft, st.unit_tokens.pop
            units = [pop() for _ in range(min(n_units, len(st.ready)))]
            rows = list(units)  # a queued single row is never acknowledged
            st.ready_tokens -= sum(drop(u, 0) for u in units)
        while st.ready and (n_units is None or len(units) < n_units):
            u = st.ready[0]
            t = st.unit_tokens.pop(u, 0)
            if max_tokens is not None and units and tokens + t > max_tokens:
                st.unit_tokens[u] = t
                break
            st.ready.popleft()
            st.ready_tokens -= t
            tokens += t
            units.append(u)
            if st.unit_size == 1:
                rows.append(u)  # a queued single row is never acknowledged
            else:
                rows.extend(st.unit_rows(u))
        lease = Lease(next(_lease_ids), consumer, set(units), now + self.lease_s)
        st.leases[lease.lease_id] = lease
        st.lease_of[units] = lease.lease_id
        st.n_leased += len(units)
        heapq.heappush(st.heap, (lease.expiry, lease.lease_id))
        return Grant(lease.lease_id, rows, units)

    def _expire(self, st: _PartState, now: float) -> None:
        back: list[int] = []
        while st.heap and st.heap[0][0] <= now:
            _, lid = heapq.heappop(st.heap)
            lease = st.leases.pop(lid, None)
            if lease is not None:
                back.extend(self._revoke(st, lease))
        for u in reversed(back):
            st.enqueue(u, front=True)

    def _revoke(self, st: _PartState, lease: Lease) -> list[int]:
        units = sorted(u for u in lease.units if st.lease_of[u] == lease.lease_id)
        st.lease_of[units] = 0
        st.n_leased -= len(units)
        return units

    # --- acknowledgements --------------------------------------------------------------
    def ack(self, gen: int, lease_id: int, rows: list[int]) -> list[int]:
        """Retire ``rows`` of a lease; returns the rows acknowledged by this call.

        Rows already acknowledged, or no longer held by this lease (it expired
        and was re-queued, or its consumer was released), are refused, so each
        row is acknowledged exactly once.
        """
        with self._cond:
            st = self._part(gen)
            r = _unique_rows(rows, len(st.acked))
            mine = r[~st.acked[r] & (st.lease_of[r // st.unit_size] == lease_id)]
            self._ack_rows(st, mine)
            lease = st.leases.get(lease_id)
            if lease is not None:
                lease.units = {u for u in lease.units if st.lease_of[u] == lease_id}
                if not lease.units:
                    del st.leases[lease_id]
            self._cond.notify_all()
            return mine.tolist()

    def _ack_rows(self, st: _PartState, rows: np.ndarray) -> None:
        """Retire rows (unique, not yet acknowledged); vectorized, O(len(rows))."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if len(rows) == 0:
            return
        st.acked[rows] = True
        u = rows // st.unit_size
        np.subtract.at(st.unit_unacked, u, 1)
        units = np.unique(u)
        done = units[st.unit_unacked[units] == 0]
        st.n_done += len(done)
        held = done[st.lease_of[done] != 0]
        st.lease_of[held] = 0
        st.n_leased -= len(held)

    def release(self, consumer: str) -> int:
        """Re-queue every lease held by ``consumer`` (declared dead); returns rows re-queued."""
        n = 0
        with self._cond:
            for st in self._parts.values():
                dead = [lid for lid, lease in st.leases.items() if lease.consumer == consumer]
                back: list[int] = []
                for lid in dead:
                    back.extend(self._revoke(st, st.leases.pop(lid)))
                for u in reversed(back):
                    n += len(st.unit_rows(u))
                    st.enqueue(u, front=True)
            self._cond.notify_all()
        return n

    # --- inspection --------------------------------------------------------------------
    def progress(self, gen: int) -> dict[str, int]:
        with self._cond:
            st = self._part(gen)
            return {
                "rows": st.rows,
                "acked": int(st.acked.sum()),
                "ready_units": len(st.ready),
                "leased_units": st.n_leased,
                "waiting_units": st.pending(),
            }

    def acked_rows(self, gen: int) -> np.ndarray:
        with self._cond:
            return self._part(gen).acked.copy()

    def _part(self, gen: int) -> _PartState:
        st = self._parts.get(gen)
        if st is None:
            raise PartitionClosedError(f"stage {self.spec.stage!r}: partition generation {gen} is closed or unknown")
        return st


def _unique_rows(rows: list[int], n: int) -> np.ndarray:
    """``rows`` as indexes of a partition of ``n`` rows, each once, in their order; ValueError for one outside
    it (numpy would wrap a negative index around to another row)."""
    r = np.asarray(rows, dtype=np.int64).reshape(-1)
    bad = r[(r < 0) | (r >= n)]
    if len(bad):
        raise ValueError(f"ack: row {int(bad[0])} is outside the partition's rows 0..{n - 1}")
    _, first = np.unique(r, return_index=True)
    return r[np.sort(first)]
