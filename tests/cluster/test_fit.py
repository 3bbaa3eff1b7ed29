"""``relayrl.cluster.fit.fit_error``: pools and a cluster's node resources in, the reason Ray could never place
the pools together (or None) out. Pure: no Ray."""

from __future__ import annotations

from relayrl.cluster import ResourcePool
from relayrl.cluster.fit import fit_error, pool_key

A, B = "10.0.0.1", "10.0.0.2"


def node(ip: str, cpus: float, gpus: float = 0) -> dict[str, float]:
    return {"CPU": cpus, "node:" + ip: 1.0, "memory": 1e9, **({"GPU": gpus} if gpus else {})}


THREE = [{**node(A, 3), "node:__internal_head__": 1.0}]  # one node of 3 CPUs (what `ray.init(num_cpus=3)` gives)


def test_split_pools_that_each_fit_but_not_together_are_refused_naming_each():
    main, gen = ResourcePool("main", devices=2), ResourcePool("gen", devices=2)
    assert fit_error([main], THREE) is None and fit_error([gen], THREE) is None  # each alone fits
    err = fit_error([main, gen], THREE)
    assert err is not None
    assert err.startswith("ResourcePools 'main' 2 (cluster.devices), 'gen' 2 (placement.pools.gen) need 4 CPU(s) "
                          "together")
    assert "but the Ray cluster has 3:" in err
    assert "lower cluster.devices or placement.pools.gen" in err and "placement.rollout=main" in err
    assert "cluster.num_cpus" in err


def test_colocated_roles_share_their_pools_devices():
    main, gen = ResourcePool("main", devices=2), ResourcePool("gen", devices=1)
    # actor and reference on main, the rollout on gen: the pool object is given once per group, counted once
    assert fit_error([main, main, gen], THREE) is None
    assert fit_error([main, ResourcePool("main", devices=2)], THREE) is not None  # two pools of 2: 4 > 3


def test_pools_that_fit_exactly_are_not_refused():
    assert fit_error([ResourcePool("main", devices=1), ResourcePool("gen", devices=1), ResourcePool("rm", devices=1)],
                     THREE) is None
    assert fit_error([], THREE) is None


def test_a_single_pool_too_large_reads_as_before():
    err = fit_error([ResourcePool("main", devices=4)], THREE)
    assert err == ("ResourcePool 'main' needs 4 CPU(s), one per CPU slot, but the Ray cluster has 3; lower "
                   "cluster.devices (the main pool) or that pool's placement.pools entry, or give Ray more CPUs "
                   "(cluster.num_cpus for a Ray the driver starts, `ray start --num-cpus` or more nodes for a "
                   "cluster)")


def test_pools_pinned_to_one_node_are_summed_against_that_node():
    nodes = [node(A, 2), node(B, 4)]
    one, two = ResourcePool("main", devices=1, node=A), ResourcePool("gen", devices=2, node=A)
    err = fit_error([one, two], nodes)
    assert err is not None and "'main' 1 (cluster.devices), 'gen' 2 (placement.pools.gen) need 3 CPU(s)" in err
    assert f"but node '{A}' has 2:" in err
    # the same pools pinned to different nodes fit (1 on A, 2 on B)
    assert fit_error([one, ResourcePool("gen", devices=2, node=B)], nodes) is None
    # a pinned pool and an unpinned one: the unpinned pool may use the pinned node's room too (6 CPUs in all)
    assert fit_error([ResourcePool("main", devices=2, node=A), ResourcePool("gen", devices=4)], nodes) is None
    err = fit_error([ResourcePool("main", devices=2, node=A), ResourcePool("gen", devices=5)], nodes)
    assert err is not None and "need 7 CPU(s) together" in err and "the Ray cluster has 6" in err


def test_a_pool_pinned_to_a_node_not_in_the_cluster_is_left_to_the_pin_check():
    nodes = [node(A, 2)]
    assert fit_error([ResourcePool("gen", devices=8, node=B), ResourcePool("main", devices=2)], nodes) is None


def test_while_the_cluster_may_grow_back_only_pinned_nodes_are_measured():
    nodes = [node(A, 2)]
    apart = [ResourcePool("main", devices=2), ResourcePool("gen", devices=2)]
    assert fit_error(apart, nodes) is not None and fit_error(apart, nodes, whole=False) is None
    pinned = [ResourcePool("main", devices=2, node=A), ResourcePool("gen", devices=1, node=A)]
    assert f"node '{A}' has 2" in fit_error(pinned, nodes, whole=False)


def test_gpu_pools_are_summed_over_gpus_and_cpus_alike():
    nodes = [node(A, 16, gpus=4), node(B, 16, gpus=2)]
    actor, rollout = (ResourcePool("main", devices=4, device_kind="cuda"),
                      ResourcePool("gen", devices=4, device_kind="cuda"))
    err = fit_error([actor, rollout], nodes)
    assert err is not None and err.startswith("ResourcePools 'main' 4 (cluster.devices), 'gen' 4 "
                                              "(placement.pools.gen) need 8 GPU(s) together, but the Ray cluster "
                                              "has 6:")
    assert "add GPU nodes, or set model.device=cpu" in err
    assert fit_error([actor, ResourcePool("gen", devices=2, device_kind="cuda")], nodes) is None
    # a CPU pool beside them takes no GPU, but every bundle a CPU: 4 + 2 + 26 fit 32 CPUs, 27 more do not
    assert fit_error([actor, ResourcePool("gen", devices=2, device_kind="cuda"), ResourcePool("rm", devices=26)],
                     nodes) is None
    err = fit_error([actor, ResourcePool("gen", devices=2, device_kind="cuda"), ResourcePool("rm", devices=27)],
                    nodes)
    assert err is not None and "need 33 CPU(s) together" in err and "the Ray cluster has 32" in err
    # GPUs are measured first, and per pinned node too
    pinned = [ResourcePool("main", devices=2, device_kind="cuda", node=B),
              ResourcePool("gen", devices=1, device_kind="cuda", node=B)]
    assert f"need 3 GPU(s) together, but node '{B}' has 2" in fit_error(pinned, nodes)
    alone = fit_error([ResourcePool("main", devices=1, device_kind="cuda")], THREE)
    assert alone.startswith("ResourcePool 'main' needs 1 GPU(s) but the Ray cluster has 0; set model.device=cpu")
    assert fit_error(pinned, nodes, kinds=("CPU",)) is None  # (the CPUs alone: 3 of node B's 16)


def test_the_key_of_a_pool_names_what_sizes_it():
    assert pool_key(ResourcePool("main", devices=2)) == "cluster.devices"
    assert pool_key(ResourcePool("main", devices=2, nodes=2)) == "cluster.devices x cluster.nodes"
    assert pool_key(ResourcePool("gen")) == "placement.pools.gen"
