"""Ray backend: rank actors on a placement group, gloo group across actors."""
import importlib.util
import os

import pytest

from cluster_workers import Echo
from ray_local import local_ray
from relayrl.cluster import ResourcePool, WorkerError, make_group

# (ray is imported by the fixture, not at collection: the fast set deselects these tests and need not pay for it)
pytestmark = [pytest.mark.ray, pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")]


class Locked:
    """An object that does not pickle (it holds a lock)."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()


@pytest.fixture(scope="module")
def ray_cluster():
    yield from local_ray(2)


def test_ray_group_dispatch_collectives_errors_and_colocation(ray_cluster):
    pool = ResourcePool("rpool", devices=2)
    g = make_group(ray_cluster, Echo, pool, "ractor", init_kwargs={"tag": "r"})
    try:
        who = g.all("whoami")
        assert [w["rank"] for w in who] == [0, 1] and {w["world_size"] for w in who} == {2}
        assert [w["local_rank"] for w in who] == [0, 1] and [w["env_rank"] for w in who] == ["0", "1"]
        assert len(set(g.pids())) == 2 and os.getpid() not in g.pids()
        assert g.split("tag_items", [1, 2, 3]) == [(0, 1), (0, 2), (1, 3)]
        assert g.split(Echo.tag_items, [1, 2, 3]) == [(0, 1), (0, 2), (1, 3)]  # a reference travels as its name
        assert g.one(Echo.echo, 7, rank=1) == (1, 7)
        assert g.all("all_reduce_rank") == [3.0, 3.0]
        assert g.one_async("echo", 5, rank=1).result(timeout=60) == (1, 5)
        # an argument that does not pickle: one line with Ray's cause and where, not Ray's page of it
        for call in (lambda: g.one("echo", {"state": Locked()}, rank=1), lambda: g.all("echo", Locked())):
            with pytest.raises(TypeError, match=r"^group 'ractor': the arguments of 'echo' cannot be pickled for the "
                                                r"Ray workers: cannot pickle '_thread.lock' object") as bad:
                call()
            assert len(str(bad.value)) < 300 and "=====" not in str(bad.value)
        assert g.one("echo", 2, rank=0) == (0, 2)  # the group is still usable
        with pytest.raises(TypeError, match=r"^group 'rbad': the arguments of '__init__' cannot be pickled for the "
                                            r"Ray workers: cannot pickle '_thread.lock' object"):
            make_group(ray_cluster, Echo, pool, "rbad", distributed=False, init_kwargs={"tag": Locked()})
        with pytest.raises(WorkerError) as info:
            g.all("boom", on_rank=1)
        assert (info.value.group, info.value.rank, info.value.method) == ("ractor", 1, "boom")
        assert "ValueError: boom on rank 1" in info.value.remote_traceback
        # a second group colocated on the same pool shares its placement group (fractional bundles)
        ref = make_group(ray_cluster, Echo, pool, "rref", distributed=False)
        try:
            assert ref.all("echo", 1) == [(0, 1), (1, 1)]
            assert pool.groups == ("ractor", "rref")
        finally:
            ref.shutdown()
    finally:
        g.shutdown()
    assert pool.ray_placement is None  # the placement group went with the last group


def test_ray_dead_actor_raises_worker_error(ray_cluster):
    g = make_group(ray_cluster, Echo, ResourcePool("rdie", devices=1), "rdie", distributed=False, num_ranks=1)
    try:
        with pytest.raises(WorkerError, match="died") as info:
            g.one("exit_or_reduce", dying_rank=0)
        assert (info.value.rank, info.value.method) == (0, "exit_or_reduce")
    finally:
        g.shutdown()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_pool_on_a_cpu_cluster_is_refused_at_once_naming_model_device(ray_cluster):
    from relayrl.cluster import PlacementError
    from relayrl.errors import is_user_error

    with pytest.raises(PlacementError, match=r"needs 1 GPU\(s\) but the Ray cluster has 0; set model.device=cpu") as info:
        make_group(ray_cluster, Echo, ResourcePool("gpu", devices=1, device_kind="cuda"), "gpu-actor")
    assert is_user_error(info.value)


def test_rays_page_on_an_argument_that_does_not_pickle_reads_as_its_cause():
    from relayrl.cluster.ray_backend import unsendable

    page = ("Could not serialize the argument <H object> for a task or actor A.f:\n" + "=" * 70 + "\n"
            "Checking Serializability of <H object>\n" + "=" * 70 + "\n"
            "!!! FAIL serialization: cannot pickle '_thread.lock' object\n"
            "    Serializing 'lock' <unlocked _thread.lock object>...\n"
            "Variable: \n\n\tFailTuple(lock [path=lock, obj=<unlocked _thread.lock object>, parent=<H object>])\n")
    assert unsendable(page) == "cannot pickle '_thread.lock' object (at .lock)"
    assert unsendable("Could not serialize the argument x:", payloads=(Locked(),)) == \
        "cannot pickle '_thread.lock' object"
