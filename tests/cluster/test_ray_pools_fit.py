"""On a Ray cluster of 3 CPUs: pools that each fit but not together (split placement, actor pool 2 + rollout
pool 2) are refused at once, naming both, instead of waiting ``cluster.start_timeout_s`` for a placement Ray
can never make; pools that fit together (colocated roles sharing one pool) start."""
import importlib.util
import time

import pytest

from cluster_workers import Echo
from ray_local import local_ray
from relayrl.cluster import PlacementError, ResourcePool, check_fit, make_group

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")]

WAIT_S = 12.0
"""The placement wait of the refused pools: the code before the joint check waited this long, then raised
"could not place them within 12.0 s"; the joint check refuses without waiting for it."""

NAMED = r"ResourcePools 'main' 2 \(cluster.devices\), 'gen' 2 \(placement.pools.gen\) need 4 CPU\(s\) together"


@pytest.fixture(scope="module")
def ray_cluster():
    yield from local_ray(3)


def test_a_second_pool_that_fits_alone_but_not_beside_the_first_is_refused_at_once(ray_cluster):
    from ray.util.placement_group import placement_group_table

    actor = make_group(ray_cluster, Echo, ResourcePool("main", devices=2), "actor", distributed=False)
    try:
        gen = ResourcePool("gen", devices=2)
        short = ray_cluster.model_copy(update={"start_timeout_s": WAIT_S})
        start = time.monotonic()
        with pytest.raises(PlacementError, match=NAMED + r".*but the Ray cluster has 3") as info:
            make_group(short, Echo, gen, "rollout", distributed=False)
        assert time.monotonic() - start < WAIT_S  # (it did not wait for the placement)
        assert "placement.rollout=main" in str(info.value) and "cluster.num_cpus" in str(info.value)
        assert gen.ray_placement is None and gen.groups == ()
        assert sum(t["state"] == "CREATED" for t in placement_group_table().values()) == 1  # the actor's alone
        assert actor.all("echo", 1) == [(0, 1), (1, 1)]  # the first pool's group is untouched
    finally:
        actor.shutdown()
    # once the first pool is given back, the second fits
    rollout = make_group(ray_cluster, Echo, gen, "rollout", distributed=False)
    try:
        assert rollout.all("echo", 2) == [(0, 2), (1, 2)]
    finally:
        rollout.shutdown()


def test_a_run_checks_all_its_pools_before_placing_any(ray_cluster):
    from ray.util.placement_group import placement_group_table

    before = set(placement_group_table())
    main, gen = ResourcePool("main", devices=2), ResourcePool("gen", devices=2)
    with pytest.raises(PlacementError, match=NAMED):
        check_fit(ray_cluster, [main, main, gen])  # (the actor and the reference on main, the rollout on gen)
    assert set(placement_group_table()) == before  # nothing was placed
    check_fit(ray_cluster, [main, main, ResourcePool("gen", devices=1)])  # 2 + 1 fit: no refusal


def test_colocated_roles_and_a_pool_of_the_rest_start_on_three_cpus(ray_cluster):
    """No false refusal: the actor and the reference share pool main (2 CPUs), the rollout has gen (1)."""
    main, gen = ResourcePool("main", devices=2), ResourcePool("gen", devices=1)
    check_fit(ray_cluster, [main, main, gen])
    groups = [make_group(ray_cluster, Echo, main, "actor", distributed=False),
              make_group(ray_cluster, Echo, main, "reference", distributed=False),
              make_group(ray_cluster, Echo, gen, "rollout", distributed=False)]
    try:
        assert [g.all("echo", 3) for g in groups] == [[(0, 3), (1, 3)], [(0, 3), (1, 3)], [(0, 3)]]
        assert main.ray_placement.refs == 2
    finally:
        for g in reversed(groups):
            g.shutdown()
    assert main.ray_placement is None and gen.ray_placement is None
