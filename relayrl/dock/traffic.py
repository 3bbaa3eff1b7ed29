"""Bytes that cross this process's boundary, by kind, counted where they are sent or received.

* ``calls``: worker-group calls to ranks in other processes, the pickled request and reply messages whole
  (arguments and results, metadata included);
* ``units``: sample data this process reads from or writes to the dock's storage units in other processes.

The pipeline reads the driver's counts every step (``dock/driver_call_bytes``, ``dock/driver_unit_bytes``):
what the driver's process really moves, besides ``dock/driver_bytes`` (the sample tensors inside call
arguments and results, which the dock keeps at 0). A count is process-wide: concurrent steps (off-policy)
share it.
"""

from __future__ import annotations

import threading

__all__ = ["add", "take"]

_lock = threading.Lock()
_counts: dict[str, int] = {}


def add(kind: str, n: int) -> None:
    with _lock:
        _counts[kind] = _counts.get(kind, 0) + int(n)


def take() -> dict[str, int]:
    """The counts since the last ``take``, and a fresh start."""
    global _counts
    with _lock:
        counts, _counts = _counts, {}
    return counts
