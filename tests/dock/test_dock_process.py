"""The dock with one local process per unit (``backend="process"``): the data plane of rank processes.

Rank processes come from ``relayrl.cluster`` (``ClusterConfig(in_process=False)``):
rollout ranks write straight into the units, the driver publishes receipts
and hands out readers, trainer ranks read and write back; no sample tensor
passes through the driver.
"""

import contextlib
import gc
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from relayrl.cluster import ClusterConfig, ResourcePool, WorkerError, make_group
from relayrl.dock import Dock, DockError, DockWriteError, PartitionClosedError, UnitLostError
from relayrl.dock.unitproc import UnitClient
from tests.procs import alive, left_after, running

from . import scenarios
from .dock_workers import DockWorker, response

pytestmark = pytest.mark.multiproc


def stop_all_threads(pid: int, within_s: float = 20.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped.

    ``kill`` returns once the signal is queued: the kernel wakes one thread to
    start the group stop, and until that thread runs, the unit's serving
    thread can still answer a request (seen once on a loaded CI machine).
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(s in "Tt" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop within {within_s} s")


@pytest.fixture(scope="module")
def dock():
    d = Dock(units=2, backend="process", lease_s=30.0)
    yield d
    d.shutdown()


@pytest.fixture(scope="module")
def ranks():
    """Two rank processes (no process group: they only talk to the units)."""
    g = make_group(ClusterConfig(in_process=False), DockWorker, ResourcePool("dock-mp", devices=2), "dock-mp",
                   distributed=False)
    yield g
    g.shutdown()


def test_scenarios_in_the_driver(dock):
    scenarios.round_trip(dock)
    scenarios.stage_readiness(dock)
    scenarios.concurrent(dock, seed=3, rows=64, always_release=True)


def test_unit_processes_store_bfloat16_rows_without_importing_torch(dock):
    dock.open_partition("bf", rows=4)
    rows = [torch.randn(n, 3).bfloat16() for n in (2, 0, 1, 4)]
    got = dock.get("bf", dock.put("bf", {"h": rows}), ["h"])
    assert all(torch.equal(a, rows[i]) for a, i in zip(got["h"], got.indexes))
    dock.close_partition("bf")
    for pid in dock._plane.pids:  # a unit holds packed numpy buffers: no torch (~5 s and ~200 MB a process)
        maps = open(f"/proc/{pid}/maps").read()
        assert "libtorch" not in maps and "numpy" in maps, pid


def test_ranks_write_the_driver_publishes_another_rank_reads(dock, ranks):
    dock.open_partition("w", rows=16, group_size=4)
    slots = [dock.reserve("w", 8), dock.reserve("w", 8)]
    assert {int(s._owner[0]) for s in slots} == {0, 1}  # one on each unit
    ranks.reset_bytes()
    written = ranks.split("write", slots)  # rank r fills slots[r] in its own process
    writers = [pid for pid, _ in written]
    assert sorted(writers) == sorted(ranks.pids()) and os.getpid() not in writers
    for _, receipt in written:
        dock.publish(receipt)
    got = dock.get("w", [15, 0, 9, 4], ["response_ids", "rewards"])  # read back in the driver
    assert all(torch.equal(t, response(i)) for t, i in zip(got["response_ids"], got.indexes))
    assert [float(r) for r in got["rewards"]] == [15.0, 0.0, 9.0, 4.0]
    # Rank 1 reads rows rank 0 wrote (and the reverse), in request order.
    rows = [3, 12, 7, 0, 8]
    pid, sums = ranks.one("read_sums", dock.reader("w", rows, ["response_ids"]), rank=1)
    assert pid == ranks.pids()[1] and sums == [int(response(i).sum()) for i in rows]
    # A trainer rank reads its micro-batch and writes outputs for the same rows back.
    receipt = ranks.one("score", dock.reader("w", rows, ["response_ids"]), dock.slots("w", rows), rank=0)
    dock.publish(receipt)
    vals = dock.get("w", rows, ["values"])["values"]
    assert all(torch.equal(v, response(i).float() * 0.5) for v, i in zip(vals, rows))
    # Only handles and receipts crossed the driver: row indexes and lengths, no samples.
    sent = ranks.bytes_by_method
    assert set(sent) == {"write", "read_sums", "score"} and sum(sent.values()) < 1000, sent
    dock.close_partition("w")


def test_concurrent_writers_in_ranks_and_driver_threads(dock, ranks):
    dock.open_partition("c", rows=96)
    slots = [dock.reserve("c", 4) for _ in range(16)]  # alternate between the two units
    fut = ranks.split_async("write", slots)  # two rank processes write 8 slots each ...
    driver_rows: list[int] = []

    def driver_put(k: int) -> None:  # ... while two driver threads put rows too
        for _ in range(4):
            driver_rows.extend(dock.put("c", {"response_ids": [torch.full((k + 1,), -1)] * 4, "rewards": [0.0] * 4}))

    threads = [threading.Thread(target=driver_put, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, receipt in fut.result(timeout=60):
        dock.publish(receipt)
    rank_rows = [i for s in slots for i in s.indexes]
    assert sorted(rank_rows + driver_rows) == list(range(96))
    got = dock.get("c", rank_rows, ["response_ids"])["response_ids"]
    assert all(torch.equal(t, response(i)) for t, i in zip(got, rank_rows))
    assert all(bool((t == -1).all()) for t in dock.get("c", driver_rows, ["response_ids"])["response_ids"])
    dock.close_partition("c")


def test_reading_after_close_raises_in_the_driver_and_in_a_rank(dock, ranks):
    dock.open_partition("r", rows=4)
    dock.put("r", {"response_ids": [torch.arange(3)] * 4})
    reader = dock.reader("r", [2, 0], ["response_ids"])
    copy = pickle.loads(pickle.dumps(reader))
    assert len(pickle.dumps(reader)) < 2000
    assert [t.tolist() for t in copy.read()["response_ids"]] == [[0, 1, 2]] * 2
    with pytest.raises(KeyError, match="'rewards' has not been written"):
        dock.reader("r", [0], ["rewards"])  # readiness is checked at creation, in the driver
    dock.close_partition("r")
    with pytest.raises(PartitionClosedError, match="'r' was closed after this reader was made"):
        copy.read()
    with pytest.raises(WorkerError, match="was closed after this reader was made"):
        ranks.one("read_sums", reader)
    dock.open_partition("r", rows=4)  # the name reopened is a new generation: the old reader stays closed
    dock.put("r", {"response_ids": [torch.arange(5)] * 4})
    with pytest.raises(PartitionClosedError):
        copy.read()
    dock.close_partition("r")


def test_a_forked_process_opens_its_own_connections(dock):
    dock.open_partition("f", rows=4)
    dock.put("f", {"response_ids": [torch.arange(k + 1) for k in range(4)]})
    reader = dock.reader("f", [3, 1], ["response_ids"])
    reader.read()  # the driver's connections exist before the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not use the parent's sockets
        try:
            os.write(w, pickle.dumps([t.tolist() for t in reader.read()["response_ids"]]))
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 30)
        got = pickle.loads(os.read(r, 1 << 16)) if ready else None
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got == [[0, 1, 2, 3], [0, 1]]
    assert [t.tolist() for t in reader.read()["response_ids"]] == got  # the parent's connections still work
    dock.close_partition("f")


def test_a_killed_or_stuck_unit_gives_a_clear_error_quickly():
    d = Dock(units=2, backend="process", io_timeout_s=1.0)
    pids = list(d._plane.pids)
    d.open_partition("k", rows=8)
    d.put("k", {"x": [torch.ones(2)] * 4})  # unit 0
    d.put("k", {"x": [torch.ones(2)] * 4})  # unit 1
    reader = pickle.loads(pickle.dumps(d.reader("k", [0, 5], ["x"])))  # a copy that does not own the units
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(DockWriteError, match=rf"storage unit 0 \(pid {pids[0]}\) died \(killed by signal SIGKILL\)"):
        d.put("k", {"x": [torch.ones(2)] * 4}, indexes=[0, 1, 2, 3])
    with pytest.raises(UnitLostError, match=rf"storage unit 0 \(pid {pids[0]}\) died"):
        d.get("k", [1], ["x"])
    with pytest.raises(UnitLostError, match=rf"storage unit 0 \(pid {pids[0]}\) died"):
        reader.read()
    stranger = UnitClient(0, d._plane._addresses[0], d._plane._authkey, pids[0], 1.0)  # as a rank process sees it
    with pytest.raises(UnitLostError, match=rf"storage unit 0 \(pid {pids[0]}\) died"):
        stranger.call("ping")
    assert time.monotonic() - t0 < 20.0  # (bounds wide enough for a loaded machine; a hang would never end)
    assert d.get("k", [4, 7], ["x"])["x"][0].tolist() == [1.0, 1.0]  # the other unit still serves
    try:
        stop_all_threads(pids[1])  # alive but not answering: the call times out
        t0 = time.monotonic()
        with pytest.raises(DockError, match=rf"storage unit 1 \(pid {pids[1]}\) did not answer within 1 s"):
            d.get("k", [5], ["x"])
        assert time.monotonic() - t0 < 20.0
    finally:
        os.kill(pids[1], signal.SIGCONT)
    d.shutdown()
    assert not left_after(pids, 20.0, every_s=0.05)


def test_shutdown_or_garbage_collection_leaves_no_unit_process():
    d = Dock(units=1, backend="process")
    pids, sockets = list(d._plane.pids), d._plane._addresses
    d.open_partition("s", rows=2)
    d.put("s", {"x": [1.0, 2.0]})
    reader = d.reader("s", [1], ["x"])
    d.shutdown()
    assert not running(pids) and not any(os.path.exists(s) for s in sockets)
    with pytest.raises(DockError, match="shut down"):
        reader.read()
    d = Dock(units=1, backend="process")  # forgotten: the finalizer stops its unit
    pids = list(d._plane.pids)
    del d
    gc.collect()
    assert not running(pids)


def test_units_exit_when_their_parent_dies():
    code = ("from relayrl.dock import Dock; import time\n"
            "d = Dock(units=1, backend='process'); print(*d._plane.pids, flush=True); time.sleep(60)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 1 and alive(pids[0])
    finally:
        owner.kill()  # SIGKILL: no finalizer, no atexit
        owner.wait()
    assert not left_after(pids, 5.0, every_s=0.05)


def test_backend_is_validated_with_the_choices():
    with pytest.raises(ValueError, match="'local', 'process' or 'ray'"):
        Dock(backend="threads")
