"""Fast unit tests: dispatch/gather, config, pools and the per-pool turn queue."""
import threading

import numpy as np
import pytest
import torch

from cluster_workers import Rows
from relayrl.cluster import ClusterConfig, ResourcePool, chunk_sizes, gather_split, split_items
from relayrl.cluster.config import as_config
from relayrl.cluster.pool import _TurnQueue


def test_chunk_sizes_contiguous_and_balanced():
    assert chunk_sizes(7, 3) == [3, 2, 2]
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="n=0"):
        chunk_sizes(3, 0)


def test_split_list_tensor_array_and_custom():
    assert split_items(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    t = torch.arange(10).reshape(5, 2)
    parts = split_items(t, 2)
    assert [p.shape[0] for p in parts] == [3, 2] and torch.equal(torch.cat(parts), t)
    a = np.arange(5)
    assert [p.tolist() for p in split_items(a, 2)] == [[0, 1, 2], [3, 4]]
    assert [r.values for r in split_items(Rows([1, 2, 3, 4]), 2)] == [[1, 2], [3, 4]]


def test_split_rejects_bad_items():
    with pytest.raises(TypeError, match="int cannot be split"):
        split_items(5, 2)

    class Bad:
        def split(self, n):
            return [self]

    with pytest.raises(ValueError, match=r"Bad.split\(3\) returned 1 chunks"):
        split_items(Bad(), 3)
    with pytest.raises(ValueError, match="0-d tensor"):
        split_items(torch.tensor(1.0), 2)


def test_gather_split_kinds():
    assert gather_split([[1, 2], [3]]) == [1, 2, 3]
    assert torch.equal(gather_split([torch.ones(2), torch.zeros(1)]), torch.tensor([1.0, 1.0, 0.0]))
    assert gather_split([np.ones(1), np.zeros(2)]).tolist() == [1.0, 0.0, 0.0]
    assert gather_split([Rows([1]), Rows([2, 3])]) == Rows([1, 2, 3])
    assert gather_split([None, None]) == [None, None]
    assert gather_split([{"a": 1}, {"a": 2}]) == [{"a": 1}, {"a": 2}]


def test_cluster_config_validation():
    assert ClusterConfig().backend == "local"
    assert as_config("ray").backend == "ray"
    with pytest.raises(ValueError, match="backend='slurm'"):
        as_config("slurm")
    with pytest.raises(ValueError, match="ray_address"):
        ClusterConfig(backend="ray", ray_address=" ")
    with pytest.raises(ValueError):
        ClusterConfig(num_cpus=0)


def test_pool_validation_and_devices():
    pool = ResourcePool("p", devices=2)
    assert pool.world_size == 2 and pool.local_devices() == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="devices=0"):
        ResourcePool("p", devices=0)
    with pytest.raises(ValueError, match="device_kind='tpu'"):
        ResourcePool("p", device_kind="tpu")
    with pytest.raises(ValueError, match="device_ids"):
        ResourcePool("p", devices=2, device_ids=[0])
    with pytest.raises(ValueError, match="backend='ray'"):
        ResourcePool("multi", nodes=2).local_devices()


def test_pool_attach_rejects_duplicates_and_overcolocation():
    pool = ResourcePool("p", max_colocated=2)
    pool.attach("a")
    with pytest.raises(ValueError, match="already hosts a group named 'a'"):
        pool.attach("a")
    pool.attach("b")
    with pytest.raises(ValueError, match="max_colocated"):
        pool.attach("c")
    pool.detach("a")
    assert pool.groups == ("b",)


def test_turn_queue_serves_in_ticket_order_and_skips_abandoned():
    q = _TurnQueue("p")
    tickets = [q.take() for _ in range(4)]
    served = []

    def run(t):
        q.wait(t)
        served.append(t)
        q.done(t)

    q.abandon(tickets[1])
    threads = [threading.Thread(target=run, args=(t,)) for t in (tickets[3], tickets[2], tickets[0])]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=5)
    assert served == [tickets[0], tickets[2], tickets[3]]


def test_turn_queue_refuses_nested_wait_instead_of_deadlocking():
    q = _TurnQueue("p")
    t0 = q.take()
    q.wait(t0)
    t1 = q.take()
    with pytest.raises(RuntimeError, match="would deadlock"):
        q.wait(t1)
    q.done(t0)
    t2 = q.take()
    q.wait(t2)  # t1 was given up, so t2 is served at once
    q.done(t2)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_a_local_gpu_pool_without_gpus_is_a_user_error():
    from relayrl.cluster import PlacementError
    from relayrl.errors import is_user_error

    with pytest.raises(PlacementError, match="needs GPUs .* but this machine has 0; lower cluster.devices, or set "
                                             "model.device=cpu") as info:
        ResourcePool("gpu", devices=1, device_kind="cuda").local_devices()
    assert is_user_error(info.value)


@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_a_dropped_cuda_pool_gives_its_gpu_back(monkeypatch):
    """A second run in one process gets GPU 0 again once the first run's pool is gone (it asked for GPU 1
    on a one-GPU machine before)."""
    import gc

    import torch

    from relayrl.cluster import ResourcePool

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    gc.collect()  # pools of earlier tests that are already unreachable
    first = ResourcePool(name="main", devices=1, device_kind="cuda")
    (gpu,) = first.local_devices()  # the lowest GPU no live pool holds (other tests' pools may hold some)
    held = ResourcePool(name="other", devices=1, device_kind="cuda")
    assert held.local_devices() != [gpu]  # still held by the live pool
    del first
    gc.collect()
    again = ResourcePool(name="main", devices=1, device_kind="cuda")
    assert again.local_devices() == [gpu]
