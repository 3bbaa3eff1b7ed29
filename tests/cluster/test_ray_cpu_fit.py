"""A Ray pool of more devices than the cluster (or its pinned node) has CPUs is refused at once, not after
cluster.start_timeout_s of waiting for a placement Ray can never make (no Ray cluster: Ray's tables are
replaced)."""

from __future__ import annotations

import pytest

from relayrl.cluster import ClusterConfig, ResourcePool
from relayrl.cluster import ray_backend
from relayrl.cluster.errors import PlacementError
from relayrl.errors import is_user_error


@pytest.fixture
def two_nodes(monkeypatch):
    """A cluster of a 2-CPU node and a 4-CPU node (4 GPUs each); placing a group fails the test."""
    nodes = [{"Alive": True, "NodeID": "a", "NodeManagerAddress": "10.0.0.1",
              "Resources": {"CPU": 2.0, "GPU": 4.0, "node:10.0.0.1": 1.0}},
             {"Alive": True, "NodeID": "b", "NodeManagerAddress": "10.0.0.2",
              "Resources": {"CPU": 4.0, "GPU": 4.0, "node:10.0.0.2": 1.0}}]
    monkeypatch.setattr(ray_backend.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray_backend.ray, "cluster_resources",
                        lambda: {"CPU": 6.0, "GPU": 8.0, "node:10.0.0.1": 1.0, "node:10.0.0.2": 1.0})

    def placed(*args, **kwargs):
        raise AssertionError("a pool that cannot fit was sent to Ray to place")

    monkeypatch.setattr(ray_backend, "placement_group", placed)


def _place(pool: ResourcePool):
    return ray_backend._acquire_placement(pool, ClusterConfig(backend="ray", start_timeout_s=300.0))


def test_a_cpu_pool_larger_than_the_cluster_is_refused_at_once(two_nodes):
    with pytest.raises(PlacementError, match=r"ResourcePool 'main' needs 8 CPU\(s\), one per CPU slot, but the Ray "
                                             r"cluster has 6; lower cluster.devices") as info:
        _place(ResourcePool("main", devices=8))
    assert is_user_error(info.value) and "cluster.num_cpus" in str(info.value)


def test_a_pool_pinned_to_a_node_is_measured_against_that_node(two_nodes):
    with pytest.raises(PlacementError, match=r"ResourcePool 'gen' needs 3 CPU\(s\), one per CPU slot, but node "
                                             r"'10.0.0.1' has 2"):
        _place(ResourcePool("gen", devices=3, node="10.0.0.1"))


def test_a_gpu_pool_needs_a_cpu_per_gpu_too(two_nodes):
    with pytest.raises(PlacementError, match=r"needs 8 CPU\(s\), one per GPU \(each GPU's bundle holds a CPU too\), "
                                             r"but the Ray cluster has 6"):
        _place(ResourcePool("main", devices=8, device_kind="cuda"))


def test_a_pool_that_fits_goes_on_to_ray(two_nodes):
    with pytest.raises(AssertionError, match="sent to Ray to place"):  # (the fixture's stand-in for placing it)
        _place(ResourcePool("gen", devices=4, node="10.0.0.2"))
    with pytest.raises(AssertionError, match="sent to Ray to place"):
        _place(ResourcePool("main", devices=6))
