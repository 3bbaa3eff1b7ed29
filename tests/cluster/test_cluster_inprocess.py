"""Fast unit tests of the local backend with one rank in the driver process."""
import os
import threading

import pytest
import torch.distributed as dist

from cluster_workers import Bars, Echo, LoudEcho, Probe, Rows
from relayrl.cluster import ClusterConfig, ResourcePool, Worker, WorkerError, WorkerGroup, make_group


@pytest.fixture
def group():
    g = WorkerGroup(Echo, ResourcePool("solo"), name="echo", init_kwargs={"tag": "t"}, distributed=False)
    yield g
    g.shutdown()


def test_rank_attributes_are_set_before_init_and_rank_runs_in_driver(group):
    me = group.one("whoami")
    assert me == {"rank": 0, "world_size": 1, "local_rank": 0, "device": "cpu", "group": "echo",
                  "pid": os.getpid(), "tag": "t", "distributed": False, "env_rank": me["env_rank"]}
    assert group.pids() == [os.getpid()]


def test_call_kinds(group):
    assert group.all("echo", 3, scale=2) == [(0, 6)]
    assert group.split("tag_items", [1, 2, 3], offset=10) == [(0, 11), (0, 12), (0, 13)]
    assert group.split("rows_plus_rank", Rows([1, 2])) == Rows([1, 2])
    assert group.one("echo", "a", rank=0) == (0, "a")


def test_call_kinds_take_a_method_reference(group):
    """A method taken from the worker class (or a base) names the call; go-to-definition follows it."""
    assert group.all(Echo.echo, 3, scale=2) == [(0, 6)]
    assert group.split(Echo.tag_items, [1, 2, 3], offset=10) == [(0, 11), (0, 12), (0, 13)]
    assert group.split(Echo.rows_plus_rank, Rows([1, 2])) == Rows([1, 2])
    assert group.one(Echo.echo, "a", rank=0) == (0, "a")
    assert group.all_async(Echo.echo, 1).result(timeout=5) == [(0, 1)]
    assert group.split_async(Echo.tag_items, [5]).result(timeout=5) == [(0, 5)]
    assert group.one_async(Echo.echo, 9).result(timeout=5) == (0, 9)
    assert group.one(Echo.add, 1, 2) == 3 and group.one(Echo.kind) == "Echo"  # a static and a class method
    with pytest.raises(WorkerError) as info:
        group.one(Echo.boom)
    assert info.value.method == "boom"  # errors and byte counts name the method as before


def test_a_method_name_still_works_and_counts_with_its_reference(group):
    import torch

    group.reset_bytes()
    assert group.all("echo", 3, scale=2) == group.all(Echo.echo, 3, scale=2) == [(0, 6)]
    assert group.one("tag_items", [1]) == group.one(Echo.tag_items, [1]) == [(0, 1)]
    group.all("double", torch.ones(2))
    group.all(Echo.double, torch.ones(2))
    assert group.bytes_by_method == {"echo": 0, "tag_items": 0, "double": 2 * (8 + 8)}


def test_a_reference_reaches_methods_of_the_class_and_its_bases_only():
    g = WorkerGroup(LoudEcho, ResourcePool("loud"), name="loud", distributed=False)
    try:
        assert g.one(LoudEcho.echo, 2) == ("loud", 0, 2)
        assert g.one(Echo.identity, 5) == 5 and g.one(LoudEcho.identity, 5) == 5  # inherited: the same function
        with pytest.raises(ValueError, match=r"group 'loud' runs LoudEcho, whose 'echo' is LoudEcho\.echo, "
                                             r"not Echo\.echo"):
            g.one(Echo.echo, 2)  # the base's method, which this class overrides
    finally:
        g.shutdown()


def test_a_method_of_another_class_is_refused_before_dispatch(group):
    group.reset_bytes()
    with pytest.raises(AttributeError, match=r"group 'echo': Echo has no method 'ping' \(Bars\.ping is a method "
                                             r"of another class\)"):
        group.all(Bars.ping)
    with pytest.raises(ValueError, match=r"runs Echo, whose 'echo' is Echo\.echo, not LoudEcho\.echo"):
        group.split(LoudEcho.echo, [1])
    with pytest.raises(ValueError, match=r"Worker\._relayrl_bind is private; the ranks run public methods of Echo"):
        group.one(Echo._relayrl_bind)
    with pytest.raises(TypeError, match="taken from the class"):
        group.one(_bound_echo())  # a bound method of an instance, not the class's function
    with pytest.raises(AttributeError, match="has no method '<lambda>'"):
        group.one(lambda: None)
    assert group.bytes_by_method == {}  # nothing was sent


def test_a_method_patched_with_a_function_of_another_name_is_found_by_identity(group, monkeypatch):
    monkeypatch.setattr(Echo, "echo", lambda self, x: ("patched", x))
    assert group.one(Echo.echo, 1) == ("patched", 1)  # (named '<lambda>': called as 'echo', where it sits)


def _bound_echo():
    obj = Echo.__new__(Echo)
    return obj.echo


def test_single_rank_call_passes_objects_without_pickling(group):
    lock = threading.Lock()  # not picklable
    assert group.one("identity", lock) is lock and group.in_driver


def test_error_names_group_rank_method_with_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.all("boom")
    err = info.value
    assert (err.group, err.rank, err.method) == ("echo", 0, "boom")
    assert "ValueError: boom on rank 0" in err.remote_traceback and "cluster_workers.py" in err.remote_traceback
    assert "'echo' rank 0 failed in 'boom'" in str(err) and "boom on rank 0" in str(err)
    assert group.one("echo", 1) == (0, 1)  # still usable


def test_a_lost_dock_unit_in_a_rank_counts_as_lost(group):
    """run.max_restarts restarts a run whose rank lost a dock storage unit, as for a lost rank (fails before:
    a rank's UnitLostError was an ordinary error)."""
    with pytest.raises(WorkerError) as info:
        group.all("lose_a_unit")
    assert info.value.lost and "storage unit 0 (pid 4242) died" in info.value.brief()
    assert info.value.node_id == "node-of-the-unit"  # the unit's node reaches the driver
    with pytest.raises(WorkerError) as info:
        group.all("boom")
    assert not info.value.lost


def test_construction_error_is_a_worker_error():
    pool = ResourcePool("bad")
    with pytest.raises(WorkerError, match="init failed on rank 0") as info:
        WorkerGroup(Echo, pool, name="bad", init_kwargs={"fail_init": True}, distributed=False)
    assert info.value.method == "__init__"
    assert pool.groups == ()  # the slot was given back


def test_bad_calls_are_rejected_before_dispatch(group):
    with pytest.raises(AttributeError, match="Echo has no method 'nope'"):
        group.all("nope")
    with pytest.raises(ValueError, match="public method"):
        group.all("_relayrl_bind")
    with pytest.raises(ValueError, match="rank=1 must be in 0..0"):
        group.one("echo", 1, rank=1)
    with pytest.raises(TypeError, match="subclass of relayrl.cluster.Worker"):
        WorkerGroup(object, ResourcePool("x"))
    with pytest.raises(ValueError, match="num_ranks=3"):
        WorkerGroup(Echo, ResourcePool("x"), num_ranks=3)


def test_async_returns_futures_and_errors_surface_on_result(group):
    futs = [group.all_async("echo", i) for i in range(3)]
    assert [f.result(timeout=5) for f in futs] == [[(0, 0)], [(0, 1)], [(0, 2)]]
    assert group.split_async("tag_items", [5]).result(timeout=5) == [(0, 5)]
    assert group.one_async("echo", 9).result(timeout=5) == (0, 9)
    with pytest.raises(WorkerError, match="boom"):
        group.one_async("boom").result(timeout=5)


def test_colocated_groups_never_run_at_once_and_keep_call_order():
    pool, probe = ResourcePool("shared"), Probe()
    a = WorkerGroup(Echo, pool, name="a", init_kwargs={"probe": probe}, distributed=False)
    b = WorkerGroup(Echo, pool, name="b", init_kwargs={"probe": probe}, distributed=False)
    try:
        assert pool.groups == ("a", "b")
        futs = [a.one_async("timed", "a1"), b.one_async("timed", "b1"), a.one_async("timed", "a2")]
        last = b.one("timed", "b2")  # blocking call queues behind the three async ones
        assert [f.result(timeout=5) for f in futs] + [last] == ["a1", "b1", "a2", "b2"]
        assert probe.order == ["a1", "b1", "a2", "b2"]
        assert probe.max_active == 1
    finally:
        a.shutdown(), b.shutdown()


def test_groups_on_different_pools_overlap():
    a = WorkerGroup(Echo, ResourcePool("left"), name="a", distributed=False)
    b = WorkerGroup(Echo, ResourcePool("right"), name="b", distributed=False)
    barrier = threading.Barrier(2, timeout=10)  # passes only if both methods run at the same time
    try:
        fa, fb = a.one_async("meet", barrier), b.one_async("meet", barrier)
        assert sorted([fa.result(timeout=15), fb.result(timeout=15)]) == [0, 1]
    finally:
        a.shutdown(), b.shutdown()


def test_nested_call_on_the_same_pool_raises_instead_of_deadlocking():
    pool = ResourcePool("nest")

    class Caller(Worker):
        def __init__(self, other):
            self.other = other

        def call_other(self):
            return self.other.one("echo", 1)

    inner = WorkerGroup(Echo, pool, name="inner", distributed=False)
    outer = WorkerGroup(Caller, pool, name="outer", init_kwargs={"other": inner}, distributed=False)
    try:
        with pytest.raises(WorkerError, match="would deadlock"):
            outer.one("call_other")
        assert inner.one("echo", 2) == (0, 2)
    finally:
        outer.shutdown(), inner.shutdown()


def test_shutdown_frees_the_pool_and_refuses_calls():
    pool = ResourcePool("p")
    with WorkerGroup(Echo, pool, name="g", distributed=False) as g:
        assert pool.groups == ("g",)
    assert pool.groups == ()
    with pytest.raises(RuntimeError, match="shut down"):
        g.all("echo", 1)


def test_make_group_follows_config_and_world_of_one_process_group():
    created = not dist.is_initialized()
    g = make_group(ClusterConfig(backend="local"), Echo, ResourcePool("d"), "dist", distributed=True)
    try:
        assert g.backend == "local"
        assert g.one("all_reduce_rank") == 1.0
        assert g.one("all_gather_rank") == [0]
    finally:
        g.shutdown()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def test_cancelled_queued_call_does_not_stall_the_pool():
    g = WorkerGroup(Echo, ResourcePool("cancel"), name="c", distributed=False)
    release = threading.Event()
    try:
        running = g.one_async("hold", release)
        queued = g.one_async("echo", 1)
        assert queued.cancel()  # still waiting behind `running` on the group's executor
        release.set()
        assert g.one("echo", 2) == (0, 2)  # would hang if the cancelled turn were never given up
        assert running.result(timeout=5) == "held"
    finally:
        g.shutdown()


def test_group_counts_payload_bytes_of_arguments_and_results_by_method(group):
    import numpy as np
    import torch

    group.reset_bytes()
    x = torch.ones(10)  # 40 bytes
    assert group.one("identity", {"x": x, "ids": np.zeros(3, dtype=np.int64), "name": "step-0"})["x"] is x
    group.all("echo", [x, x], scale=2)  # x reached twice (or four times in the result) counts once each way
    group.split("tag_items", [1, 2, 3])  # no tensors: counted as 0
    with pytest.raises(WorkerError):
        group.one("echo", x, scale="a")  # a failed call still counts its arguments
    assert group.bytes_by_method == {"identity": 2 * (40 + 24), "echo": 40 + 40 + 40, "tag_items": 0}
    assert group.reset_bytes()["echo"] == 120 and group.bytes_by_method == {}
    group.one_async("double", torch.zeros(4, dtype=torch.float64)).result(timeout=10)
    assert group.bytes_by_method == {"double": 32 + 32}
