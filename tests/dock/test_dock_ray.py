"""The same scenarios with units as Ray actors (one session-scoped Ray cluster)."""

import os
import sys

import pytest
import torch

from relayrl.dock import Dock, DockWriteError, PartitionClosedError, UnitLostError

from . import scenarios

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_dock(ray_cluster):
    """One 2-unit Ray dock for the module (starting unit actors takes seconds on 2 cores)."""
    d = Dock(units=2, backend="ray", lease_s=30.0)
    yield d
    d.shutdown()


def test_round_trip_ray(ray_dock):
    scenarios.round_trip(ray_dock)


def test_readiness_and_groups_ray(ray_dock):
    scenarios.stage_readiness(ray_dock)
    scenarios.whole_groups_and_tokens(ray_dock)


def test_dp_balance_ray(ray_dock):
    scenarios.dp_balance(ray_dock)


def test_leases_and_release_ray(ray_dock):
    scenarios.leases_and_release(ray_dock)


def test_concurrent_exactly_once_ray(ray_dock):
    scenarios.concurrent(ray_dock, seed=1, rows=64, always_release=True)


def test_bfloat16_and_2d_rows_survive_the_wire(ray_dock):
    ray_dock.open_partition("w", rows=3)
    rows = [torch.randn(n, 4).bfloat16() for n in (1, 0, 5)]
    idx = ray_dock.put("w", {"hidden": rows})
    got = ray_dock.get("w", idx[::-1], ["hidden"])
    assert all(torch.equal(a, rows[i]) for a, i in zip(got["hidden"], got.indexes))
    ray_dock.close_partition("w")
    # the units stored and returned them without importing torch (a unit starts in ~0.5 s, not ~5 s)
    import ray

    holds = ray.get([u.__ray_call__.remote(lambda _: sorted({"torch", "relayrl.dock.dock"} & set(sys.modules)))
                     for u in ray_dock._plane.units])
    assert holds == [[], []]


def test_put_to_dead_unit_raises(ray_cluster):
    d = Dock(units=2, backend="ray", io_timeout_s=10.0)
    d.open_partition("p", rows=4)
    dead = d._plane.units[0]  # the first put goes to unit 0 (least filled)
    ray_cluster.kill(dead)
    with pytest.raises(ray_cluster.exceptions.RayActorError):  # kill is asynchronous: wait until it took effect
        for _ in range(100):
            ray_cluster.get(dead.ping.remote(), timeout=10)
    with pytest.raises(DockWriteError, match=r"not stored: Ray storage unit 0 \(host [0-9.]+\) died") as err:
        d.put("p", {"x": [torch.ones(1)] * 4})
    assert err.value.indexes == [0, 1, 2, 3]  # the caller can retry these rows with indexes=
    assert isinstance(err.value, UnitLostError)  # and run.max_restarts recovers it (a ProcessLost)
    assert err.value.node_id == ray_cluster.get_runtime_context().get_node_id()  # (one node: the driver's)
    with pytest.raises(KeyError, match="not been written"):
        d.get("p", [0], ["x"])  # nothing was published
    with pytest.raises(UnitLostError, match=r"Ray storage unit 0 \(host [0-9.]+\) died"):  # a call to every unit names the dead one
        d._plane.drop(0)
    d._plane.units = d._plane.units[1:]


def test_units_that_do_not_start_in_time_are_a_clear_error(ray_cluster, monkeypatch):
    from relayrl.dock import DockError
    from relayrl.dock.plane import RayPlane

    monkeypatch.setattr(RayPlane, "START_S", 0.001)
    with pytest.raises(DockError, match="did not start within"):
        Dock(units=1, backend="ray", io_timeout_s=0.001)


def test_concurrent_puts_to_one_unit_keep_their_rows(ray_cluster):
    import threading

    d = Dock(units=1, backend="ray")
    d.open_partition("g", rows=64)
    out: dict[int, list[int]] = {}

    def producer(p):
        out[p] = d.put("g", {"x": [torch.full((p + 1,), float(p))] * 8})

    for _ in range(2):  # new rows, then the same threads again
        threads = [threading.Thread(target=producer, args=(p,)) for p in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = d.get("g", [i for p in range(4) for i in out[p]], ["x"])
        vals = got["x"]
        assert [int(v[0]) for v in vals] == [p for p in range(4) for _ in range(8)]
        assert [len(v) for v in vals] == [p + 1 for p in range(4) for _ in range(8)]
    d.shutdown()


def test_a_worker_in_another_process_writes_straight_to_the_units(ray_cluster):
    """Slots travel to a Ray task, which stores rows in the unit actors; the driver publishes the receipts."""
    d = Dock(units=2, backend="ray", lease_s=30.0)
    d.open_partition("w", rows=8, group_size=4)

    @ray_cluster.remote(num_cpus=0)
    def produce(slots, fill):
        import os

        import torch

        if fill is None:
            return os.getpid(), slots.write({"response_ids": [torch.arange(k + 1) for k in slots.indexes]})
        return os.getpid(), slots.write({"rewards": [float(k) for k in slots.indexes]})

    first, second = d.reserve("w", 4), d.reserve("w", 4)
    assert {int(first._owner[0]), int(second._owner[0])} == {0, 1}  # spread over both units
    results = ray_cluster.get([produce.remote(s, None) for s in (first, second)])
    assert all(pid != os.getpid() for pid, _ in results)
    for _, receipt in results:
        d.publish(receipt)
    _, fill = ray_cluster.get(produce.remote(d.slots("w", [7, 0, 5]), True))
    d.publish(fill)
    got = d.get("w", list(range(8)), ["response_ids"])
    assert [len(t) for t in got["response_ids"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [float(x) for x in d.get("w", [0, 5, 7], ["rewards"])["rewards"]] == [0.0, 5.0, 7.0]
    # A write that reaches the units after the partition closed is refused, and nothing leaks into a reopened one.
    late = d.slots("w", [1])
    d.close_partition("w")
    d.open_partition("w", rows=8, group_size=4)
    with pytest.raises(PartitionClosedError):
        ray_cluster.get(produce.remote(late, True))
    with pytest.raises(KeyError, match="not been written"):
        d.get("w", [1], ["rewards"])
    d.shutdown()


def test_a_reader_reads_in_another_process_and_refuses_after_close(ray_dock, ray_cluster):
    ray_dock.open_partition("rr", rows=4)
    ray_dock.put("rr", {"response_ids": [torch.arange(k + 1) for k in range(4)]})
    reader = ray_dock.reader("rr", [3, 1], ["response_ids"])

    @ray_cluster.remote(num_cpus=0)
    def read(r):
        return [t.tolist() for t in r.read()["response_ids"]]

    assert ray_cluster.get(read.remote(reader)) == [[0, 1, 2, 3], [0, 1]]
    ray_dock.close_partition("rr")
    with pytest.raises(PartitionClosedError, match="closed after this reader was made"):
        reader.read()
