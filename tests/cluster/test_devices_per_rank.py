"""A group whose ranks own several devices each (``devices_per_rank``: a rollout rank whose vLLM engine spans N
devices with tensor parallelism): how a pool is cut into ranks, and what it refuses."""
import os

import pytest

from cluster_workers import Echo
from relayrl.cluster import PlacementError, ResourcePool, WorkerGroup
from relayrl.cluster.group import rank_devices


def test_a_pool_is_cut_into_consecutive_runs_of_devices():
    gpus = [f"cuda:{i}" for i in range(4)]
    assert rank_devices(gpus, 2) == [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]
    assert rank_devices(gpus, 4) == [tuple(gpus)]
    assert rank_devices(gpus, 1) == [(g,) for g in gpus]
    with pytest.raises(PlacementError, match="4 devices cannot be cut into ranks of 3"):
        rank_devices(gpus, 3)


def test_one_rank_owning_the_whole_pool_runs_in_the_driver():
    g = WorkerGroup(Echo, ResourcePool("tp", devices=2), name="tp", distributed=False, devices_per_rank=2)
    try:
        assert g.world_size == 1 and g.pids() == [os.getpid()]
        assert g.one(Echo.owned)["devices"] == ["cpu", "cpu"]
    finally:
        g.shutdown()


@pytest.mark.multiproc
def test_ranks_of_two_devices_are_processes_with_two_shares_of_the_cores():
    g = WorkerGroup(Echo, ResourcePool("tp4", devices=4), name="tp4", devices_per_rank=2)
    try:
        assert g.world_size == 2 and len(set(g.pids())) == 2
        owned = g.all(Echo.owned)
        assert [o["devices"] for o in owned] == [["cpu", "cpu"]] * 2
        # (4 devices' worth of cores over 2 ranks: each rank gets half, as 2 one-device ranks of 2 would)
        assert {o["threads"] for o in owned} == {max(1, (os.cpu_count() or 1) // 2)}
        assert [w["world_size"] for w in g.all(Echo.whoami)] == [2, 2]
    finally:
        g.shutdown()


@pytest.mark.parametrize("per_rank", [3, 0, True])
def test_a_count_that_does_not_divide_the_pool_is_refused_before_anything_starts(per_rank):
    pool = ResourcePool("odd", devices=4)
    with pytest.raises(PlacementError, match=r"devices_per_rank=.* whole divisor of the 4 devices per node"):
        WorkerGroup(Echo, pool, name="odd", devices_per_rank=per_rank)
    assert pool.groups == ()


def test_more_ranks_than_the_pool_holds_at_that_size_is_refused():
    with pytest.raises(ValueError, match=r"num_ranks=2 must be between 1 and the pool's 2 devices / 2 devices per rank"):
        WorkerGroup(Echo, ResourcePool("small", devices=2), name="small", num_ranks=2, devices_per_rank=2)
