"""The rollout stream's writer thread (StreamingGeneration._write_finished): what finished since its last write
goes into the dock in one write, a failed request becomes a record with no rows, and after a failure the
writer drains without writing so that the generation loop never blocks on it."""

from __future__ import annotations

import queue
import threading

from relayrl.engines.generation.base import RequestFailed
from relayrl.workflows.rollout_stream import GroupRecord, StreamingGeneration


class _Writer(StreamingGeneration):
    def __init__(self) -> None:
        self._out: queue.Queue = queue.Queue()
        self.written: list[list[tuple]] = []

    def _write_all(self, writes):  # (a dock write: its receipt, and the records of what it wrote)
        self.written.append(writes)
        return f"receipt-{len(self.written)}", [w[2] for w in writes]


def _out(w: _Writer) -> list:
    got = []
    while not w._out.empty():
        got.append(w._out.get_nowait())
    return got


def test_what_finished_since_the_last_write_is_one_write_and_a_failed_request_a_record_without_rows():
    w, ended = _Writer(), queue.SimpleQueue()
    for item in ("a", RequestFailed(1, "server said 500"), "b", None):
        ended.put(item)
    w._write_finished(ended, lambda item: [(f"slots-{item}", {"x": [item]}, item)], groups=[7, 9])
    assert w.written == [[("slots-a", {"x": ["a"]}, "a"), ("slots-b", {"x": ["b"]}, "b")]]
    assert _out(w) == [("receipt-1", ["a", "b"]), (None, [GroupRecord(group=9, failed="server said 500")])]


def test_after_a_failure_the_writer_drains_without_writing():
    w, ended = _Writer(), queue.SimpleQueue()

    def due(item):
        if item == "bad":
            raise ValueError("no room in the unit")
        return [("slots", {"x": [item]}, item)]

    t = threading.Thread(target=w._write_finished, args=(ended, due, [0]), daemon=True)
    t.start()
    ended.put("bad")
    error = w._out.get(timeout=10)
    assert isinstance(error, ValueError)
    for item in ("late", RequestFailed(0, "gone"), None):  # (the generation loop goes on putting)
        ended.put(item)
    t.join(10)
    assert not t.is_alive() and w.written == [] and _out(w) == []
