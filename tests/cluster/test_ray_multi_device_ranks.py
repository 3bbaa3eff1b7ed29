"""Ranks of several devices on the Ray backend (``devices_per_rank``, a vLLM engine with tensor parallelism): a
pool made with ``pack`` N is placed in runs of N bundles, one STRICT_PACK placement group each (one node), the
rank's actor sits on its run's first bundle and, on CUDA, sees the run's GPUs; what is refused, and that the
vLLM worker processes a rank's engine starts go with the rank."""
import importlib.util
import time

import pytest

from cluster_workers import Echo
from ray_local import local_ray
from relayrl.cluster import ClusterConfig, PlacementError, ResourcePool, WorkerGroup
from tests.procs import left_after

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")


# -- placement, without a cluster ------------------------------------------------------------------------
@needs_ray
def test_a_pool_is_placed_in_runs_of_its_pack():
    from relayrl.cluster.ray_backend import runs

    assert runs(4, 1) == [4]  # one placement group of every bundle, the pool's own strategy
    assert runs(4, 2) == [2, 2] and runs(8, 4) == [4, 4] and runs(2, 2) == [2]
    with pytest.raises(PlacementError, match="4 devices cannot be cut into runs of 3"):
        runs(4, 3)


@needs_ray
def test_a_rank_of_several_gpus_sees_its_runs_gpus_first_bundle_first():
    from relayrl.cluster.ray_backend import Placement, rank_devices, rank_env

    # two runs of two bundles: node a holds GPUs 3 and 1 (bundle order), node b GPUs 0 and 2
    pl = Placement(groups=["pg0", "pg1"], run=2, nodes=("a", "a", "b", "b"), gpus=("3", "1", "0", "2"))
    assert [pl.bundle(d) for d in range(4)] == [("pg0", 0), ("pg0", 1), ("pg1", 0), ("pg1", 1)]
    assert rank_env(pl, 0, 2) == {"CUDA_VISIBLE_DEVICES": "3,1"}
    assert rank_env(pl, 1, 2) == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert rank_env(pl, 3, 1) == {}  # a one-device rank: Ray's own setting (its bundle's GPU)
    assert rank_devices(ResourcePool("g", devices=4, device_kind="cuda", pack=2), 2) == ("cuda:0", ("cuda:0", "cuda:1"))
    assert rank_devices(ResourcePool("c", devices=4, pack=2), 2) == ("cpu", ("cpu", "cpu"))
    assert rank_devices(ResourcePool("c1", devices=4), 1) == ("cpu", ())
    split = Placement(groups=["pg"], run=2, nodes=("a", "b"), gpus=("0", "0"))
    with pytest.raises(PlacementError, match="rank 0's 2 devices are on different nodes"):
        rank_env(split, 0, 2)


@needs_ray
def test_a_run_larger_than_every_node_is_refused_naming_the_key():
    from relayrl.cluster.ray_backend import _check_run_fits

    nodes = [{"CPU": 16.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}]
    _check_run_fits(ResourcePool("ok", devices=4, device_kind="cuda", pack=4), nodes)
    with pytest.raises(PlacementError, match=r"a rank owns 8 devices \(rollout.vllm.tensor_parallel_size\), which "
                                             r"must sit on one node, but the Ray cluster's largest node has 4 GPU"):
        _check_run_fits(ResourcePool("big", devices=8, device_kind="cuda", pack=8), nodes)
    with pytest.raises(PlacementError, match="largest node has 16 CPU"):
        _check_run_fits(ResourcePool("cpu", devices=32, pack=32), nodes)


def test_pack_must_divide_the_pools_devices():
    with pytest.raises(ValueError, match=r"pack=3 must divide devices=4"):
        ResourcePool("p", devices=4, pack=3)
    with pytest.raises(ValueError, match=r"pack=0 must be an integer >= 1"):
        ResourcePool("p", devices=4, pack=0)


@needs_ray
def test_ranks_of_more_devices_than_the_pools_pack_are_refused_before_ray_starts():
    pool = ResourcePool("flat", devices=4)  # pack 1: its bundles may land on any node
    with pytest.raises(PlacementError, match=r"devices_per_rank=2 on the Ray backend needs a pool .* make it with "
                                             r"pack=2"):
        WorkerGroup(Echo, pool, name="flat", backend=ClusterConfig(backend="ray"), devices_per_rank=2)
    assert pool.groups == () and pool.ray_placement is None


# -- on a Ray cluster --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    yield from local_ray(4)


@pytest.mark.ray
@needs_ray
def test_colocated_ranks_of_one_and_two_devices_share_runs_of_two(ray_cluster):
    from ray.util.placement_group import placement_group_table

    pool = ResourcePool("tp", devices=4, pack=2)
    actor = WorkerGroup(Echo, pool, name="actor", backend=ray_cluster)
    rollout = WorkerGroup(Echo, pool, name="rollout", backend=ray_cluster, devices_per_rank=2)
    try:
        placement = pool.ray_placement
        assert placement.refs == 2 and placement.run == 2 and len(placement.groups) == 2
        tables = [placement_group_table(pg) for pg in placement.groups]
        assert [(t["strategy"], len(t["bundles"])) for t in tables] == [("STRICT_PACK", 2)] * 2
        assert len(placement.nodes) == 4 and placement.gpus is None
        # four one-device ranks (one per bundle) and two ranks of two devices, each a process group of its own
        assert [o["devices"] for o in actor.all(Echo.owned)] == [["cpu"]] * 4
        owned = rollout.all(Echo.owned)
        assert [o["devices"] for o in owned] == [["cpu", "cpu"]] * 2
        assert [o["threads"] for o in owned] == [2, 2]  # one torch thread per CPU device it owns
        assert [w["world_size"] for w in rollout.all(Echo.whoami)] == [2, 2]
        assert rollout.all(Echo.all_reduce_rank) == [3.0, 3.0]  # (rank + 1 summed over its 2 ranks)
    finally:
        rollout.shutdown()
        actor.shutdown()
    assert pool.ray_placement is None  # every run's placement group went with the last group


@pytest.mark.ray
@needs_ray
def test_a_run_no_node_can_hold_is_refused_at_once(ray_cluster):
    pool = ResourcePool("huge", devices=8, pack=8)  # the cluster's one node has 4 CPUs
    start = time.monotonic()
    with pytest.raises(PlacementError,
                       match=r"largest node has 4 CPU\(s\): set rollout.vllm.tensor_parallel_size <= 4"):
        WorkerGroup(Echo, pool, name="huge", backend=ray_cluster, devices_per_rank=8)
    assert time.monotonic() - start < 30 and pool.ray_placement is None and pool.groups == ()


# -- vLLM's worker processes inside a rank actor -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.ray
@needs_ray
def test_a_ranks_vllm_workers_live_and_die_with_its_actor(ray_cluster, tiny_tokenizer):
    """A rank of two devices starts a vLLM engine of two worker processes (vLLM's mp executor spawns them
    from inside the actor); they are gone after the group shuts down, and after the actor is killed outright."""
    from relayrl.engines.generation.vllm_engine import vllm_available
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    if not vllm_available():
        pytest.skip("needs vLLM")
    import ray
    from cluster_workers import TPEngine

    model = str(build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256, num_heads=2), verbose=False))
    prompt = tiny_tokenizer("1+2=")["input_ids"]
    for how in ("shutdown", "killed"):
        pool = ResourcePool(f"vllm-{how}", devices=2, pack=2)
        g = WorkerGroup(TPEngine, pool, name=how, backend=ray_cluster, devices_per_rank=2, distributed=False,
                        init_kwargs={"model_dir": model})
        try:
            children = g.one(TPEngine.children)
            assert len(children) >= 2, children  # a worker process per device
            # vLLM 0.32 spawns its workers, fresh interpreters, never a fork of the Ray worker process (its CPU
            # platform always does; on CUDA it forces spawn inside a Ray actor)
            assert g.one(TPEngine.env, "VLLM_WORKER_MULTIPROC_METHOD") == "spawn"
            assert len(g.one(TPEngine.sample, prompt)) == 4
            if how == "killed":  # no stop(): the actor process dies under its engine
                ray.kill(g._ranks.actors[0], no_restart=True)
        finally:
            g.shutdown()
        assert not left_after(children, 30.0, every_s=0.5), f"vLLM worker processes outlived the rank actor ({how})"
