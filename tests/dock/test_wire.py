"""Writes to a Ray unit: inline pieces and group commit (transport logic, no Ray needed)."""

import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from relayrl.dock import PartitionClosedError
from relayrl.dock.columns import normalize_column, pack, unpack
from relayrl.dock.wire import PIECE_BYTES, UnitWriter, decode, encode


def _packed(lengths, tail=(), dtype=torch.float32):
    rows = [torch.randn(n, *tail).to(dtype) for n in lengths]
    r, schema, ln = normalize_column("c", rows, None)
    return rows, pack(r, schema, ln)


def _entry(gen, n):
    rows_a, a = _packed([n] * 4)
    rows_b, b = _packed([3, 0, 2, 1], tail=(2,), dtype=torch.bfloat16)
    return (gen, 8, np.arange(4), {"a": a, "b": b}), {"a": rows_a, "b": rows_b}


@pytest.mark.parametrize("big", [False, True])
def test_encode_decode_round_trip(big):
    # 4 rows of 10k floats = 160 kB for "a": pieces when inline, whole otherwise.
    entries, originals = zip(*[_entry(1, 10_000 if big else 100), _entry(2, 7)])
    head, buffers, inline = encode(list(entries), inline_bytes=100_000)
    assert inline == (not big)
    if inline:
        assert all(b.nbytes <= PIECE_BYTES for b in buffers)  # each piece is below Ray's inline limit
    else:
        assert len(buffers) == 4  # one buffer per column and write
    back = decode(head, buffers)
    for (gen, n_rows, rows, cols), orig, (g0, *_) in zip(back, originals, entries):
        assert gen == g0 and n_rows == 8 and rows.tolist() == [0, 1, 2, 3]
        for name, pc in cols.items():
            got = unpack(pc)
            assert all(torch.equal(x, y) for x, y in zip(got, orig[name]))


def test_large_writes_split_into_inline_pieces_below_the_limit():
    _, pc = _packed([PIECE_BYTES // 4 * 3])  # one row of 3 pieces' worth of float32
    head, buffers, inline = encode([(1, 1, np.arange(1), {"x": pc})])
    assert inline and len(buffers) == 3
    assert head[0][3]["x"][0] == 3
    assert np.array_equal(decode(head, buffers)[0][3]["x"].flat, pc.flat)


class _Ref:
    def __init__(self):
        self.fut = Future()


class _FakeUnit:
    """Stands in for a unit actor: each call blocks until the test releases it."""

    def __init__(self):
        self.calls: list[tuple[list, threading.Event, _Ref]] = []
        self.sent = threading.Condition()
        outer = self

        class _Method:
            @staticmethod
            def remote(head, inline, *args):
                ref, gate = _Ref(), threading.Event()
                with outer.sent:
                    outer.calls.append((head, gate, ref))
                    outer.sent.notify_all()

                def run():
                    gate.wait(10)
                    if any(h[0] < 0 for h in head):
                        ref.fut.set_exception(RuntimeError("unit died"))
                    else:  # gen 0 stands for a closed partition: that write alone is refused
                        ref.fut.set_result([None if h[0] else "generation 0 is closed" for h in head])

                threading.Thread(target=run, daemon=True).start()
                return ref

        self.put_many = _Method()

    def wait_calls(self, n):
        with self.sent:
            assert self.sent.wait_for(lambda: len(self.calls) >= n, timeout=10)


class _FakeRay:
    @staticmethod
    def get(ref, timeout=None):
        return ref.fut.result(timeout)


def _put(writer, gen, errors):
    (_, _, rows, cols), _ = _entry(gen, 5)
    try:
        writer.wait(writer.submit(gen, 8, rows, cols))
    except Exception as e:  # noqa: BLE001
        errors.append(e)


def _first_in_flight(timeout_s=10.0):
    """A writer on a fake unit with one put in flight (its call blocked until the test releases it)."""
    unit = _FakeUnit()
    w = UnitWriter(unit, _FakeRay, timeout_s=timeout_s)
    errors: list = []
    first = threading.Thread(target=_put, args=(w, 1, errors))
    first.start()
    unit.wait_calls(1)
    return unit, w, errors, first


def _first_in_flight_then_queued(gens):
    """One put in flight on a fake unit, then one put per ``gens`` queued behind it."""
    unit, w, errors, first = _first_in_flight()
    later = [threading.Thread(target=_put, args=(w, g, errors)) for g in gens]
    for t in later:
        t.start()
    for _ in range(500):
        if len(w._queue) == len(gens):
            break
        threading.Event().wait(0.01)
    assert len(w._queue) == len(gens) and len(unit.calls) == 1
    return unit, w, errors, first, later


def test_puts_arriving_during_a_call_share_the_next_call():
    unit, w, errors, first, later = _first_in_flight_then_queued((2, 3, 4))
    unit.calls[0][1].set()  # the first call completes: the queued puts leave together
    unit.wait_calls(2)
    assert sorted(h[0] for h in unit.calls[1][0]) == [2, 3, 4]
    first.join(10)
    assert not first.is_alive() and all(t.is_alive() for t in later)  # later puts wait for their own call
    unit.calls[1][1].set()
    for t in later:
        t.join(10)
    assert not errors and w.calls == 2


def test_a_failed_call_fails_every_put_it_carried():
    unit, w, errors, first, later = _first_in_flight_then_queued((-2, 3))  # gen -2 makes the fake unit fail
    unit.calls[0][1].set()
    unit.wait_calls(2)
    unit.calls[1][1].set()
    for t in [first, *later]:
        t.join(10)
    assert len(errors) == 2 and all("unit died" in str(e) for e in errors)


def test_a_refused_write_fails_alone():
    unit, w, errors, first, later = _first_in_flight_then_queued((0, 3))
    unit.calls[0][1].set()
    unit.wait_calls(2)
    unit.calls[1][1].set()
    for t in [first, *later]:
        t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], PartitionClosedError) and "closed" in str(errors[0])


def test_waiting_behind_a_stuck_call_times_out():
    unit, w, errors, first = _first_in_flight(timeout_s=0.3)
    _put(w, 2, errors)  # queued behind the first call, which never completes
    first.join(5)
    assert len(errors) == 2  # both puts fail; neither hangs
