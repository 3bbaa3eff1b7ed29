"""Writes to one Ray storage unit: group commit and inline-sized arguments.

Two costs dominate a put to a unit actor (measured with ``benchmarks/dock_flow.py``
on a 2-core machine): Ray's fixed cost per call (about 1.3 ms round trip and
3 ms of CPU across driver, raylet and actor), and, for arguments above Ray's
inline limit (``max_direct_call_object_size``, 100 KiB by default), a trip
through the shared-memory object store (create and seal requests to the
raylet, about 1.5 ms more per object). ``UnitWriter`` cuts both:

* **Group commit.** While a write to the unit is in flight, later puts queue;
  when it completes, everything queued leaves in one call. Each put still
  returns only after the call carrying its rows has confirmed, and raises if
  that call fails.
* **Inline pieces.** A call whose buffers total at most ``inline_bytes`` sends
  each buffer in pieces below the inline limit, as separate arguments: Ray
  copies them into the call's RPC and the object store is never touched. Larger
  calls send all buffers as one argument, i.e. one object-store object (more
  pieces cost more than the object store beyond about four of them).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from .packed import PackedColumn
from .config import DockWriteError, PartitionClosedError

#: Ray inlines an argument whose serialized size is below this (its
#: ``max_direct_call_object_size``, settable through the environment variable).
RAY_INLINE_LIMIT = int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024))
PIECE_BYTES = RAY_INLINE_LIMIT * 9 // 10  # room for the pickle header of each piece
INLINE_BYTES = 4 * PIECE_BYTES


def encode(entries: Sequence[tuple[int, int, np.ndarray, dict[str, PackedColumn]]],
           inline_bytes: int = INLINE_BYTES) -> tuple[list, list[np.ndarray], bool]:
    """Split writes into a small header and the flat buffers to ship.

    Returns ``(head, buffers, inline)``: ``head`` holds, per write, ``(gen,
    n_rows, rows, {column: (pieces, lengths, schema)})``; ``buffers`` the
    pieces in header order; ``inline`` whether they go as separate (inlined)
    arguments rather than one list.
    """
    total = sum(pc.flat.nbytes for *_, cols in entries for pc in cols.values())
    inline = total <= inline_bytes
    head, buffers = [], []
    for gen, n_rows, rows, cols in entries:
        meta = {}
        for name, pc in cols.items():
            n = max(1, -(-pc.flat.nbytes // PIECE_BYTES)) if inline else 1
            parts = np.array_split(pc.flat, n) if n > 1 and len(pc.flat) >= n else [pc.flat]
            buffers += parts
            meta[name] = (len(parts), pc.lengths, pc.schema)
        head.append((gen, n_rows, rows, meta))
    return head, buffers, inline


def decode(head: list, buffers: Sequence[np.ndarray]) -> list[tuple[int, int, np.ndarray, dict[str, PackedColumn]]]:
    """Inverse of :func:`encode` (run in the unit): one ``PackedColumn`` per column of each write."""
    it = iter(buffers)
    out = []
    for gen, n_rows, rows, meta in head:
        cols = {}
        for name, (n, lengths, schema) in meta.items():
            parts = [next(it) for _ in range(n)]
            cols[name] = PackedColumn(flat=parts[0] if n == 1 else np.concatenate(parts), lengths=lengths, schema=schema)
        out.append((gen, n_rows, rows, cols))
    return out


def put_many_args(entries: Sequence[tuple[int, int, np.ndarray, dict[str, PackedColumn]]],
                  inline_bytes: int = INLINE_BYTES) -> tuple:
    """Arguments of one ``PackedUnit.put_many`` call storing ``entries``: ``(head, inline, *pieces)``
    when inline, else ``(head, inline, buffers)`` (the unit process sends with ``inline_bytes=0``:
    its transport moves each buffer out of band, so splitting into pieces would only add copies)."""
    head, buffers, inline = encode(entries, inline_bytes)
    return (head, inline, *buffers) if inline else (head, inline, buffers)


class _Ticket:
    __slots__ = ("entry", "ref", "pos")

    def __init__(self, entry: tuple) -> None:
        self.entry = entry
        self.ref: Any = None  # the call carrying this write, once sent
        self.pos = 0  # this write's place in that call


class UnitWriter:
    """Group-committing writer for one unit actor (thread-safe).

    ``submit`` queues a write and sends it at once when no call to the unit is
    in flight; ``wait`` blocks until the call carrying it has confirmed, and
    raises if that call failed or the unit refused this write (its partition
    generation was closed). Any thread that finishes waiting on the in-flight
    call sends what queued meanwhile, so there is no writer thread to manage;
    hence every submitted write must be waited for.
    """

    def __init__(self, actor: Any, ray: Any, timeout_s: float) -> None:
        self._actor, self._ray, self._timeout = actor, ray, timeout_s
        self._cond = threading.Condition()
        self._queue: list[_Ticket] = []
        self._inflight: Any = None
        self.calls = 0  # calls sent (for telemetry and tests)

    def submit(self, gen: int, n_rows: int, rows: np.ndarray, columns: dict[str, PackedColumn]) -> _Ticket:
        t = _Ticket((gen, n_rows, rows, columns))
        with self._cond:
            self._queue.append(t)
            if self._inflight is None:
                self._send_locked()
        return t

    def _send_locked(self) -> None:
        batch, self._queue = self._queue, []
        ref = self._actor.put_many.remote(*put_many_args([t.entry for t in batch]))
        self.calls += 1
        for pos, t in enumerate(batch):
            t.ref, t.pos = ref, pos
            t.entry = None  # the call holds the data now
        self._inflight = ref

    def wait(self, t: _Ticket) -> None:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while t.ref is None:  # queued behind the call in flight
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise DockWriteError(f"no call to the storage unit completed within {self._timeout:.0f} s")
            ref = t.ref
        error = None
        try:
            refused = self._ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))[t.pos]
            if refused is not None:
                error = PartitionClosedError(refused)
        except Exception as e:  # noqa: BLE001 - any failure means the rows are not stored
            error = e
        with self._cond:
            if self._inflight is ref:  # the first waiter back sends what queued meanwhile
                self._inflight = None
                if self._queue:
                    self._send_locked()
                self._cond.notify_all()
        if error is not None:
            raise error
