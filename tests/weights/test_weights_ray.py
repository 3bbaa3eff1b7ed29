"""The relay to Ray actors: buckets go once into the object store as refs, each rank reads them."""
import os

import pytest
import torch

from weights_workers import RolloutWorker, tiny_model

pytestmark = pytest.mark.ray


def test_push_to_a_ray_group_loads_every_rank():
    ray = pytest.importorskip("ray")
    from relayrl.cluster import ClusterConfig, ResourcePool, WorkerGroup
    from relayrl.weights import WeightRelay

    # Our workers live in this test folder, so Ray's workers need it on their path: always start our own
    # Ray (one left running by another test module would not have it).
    if ray.is_initialized():
        ray.shutdown()
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([root, here])}})
    try:
        trainer = tiny_model(seed=0)
        pool = ResourcePool("relay-ray", devices=2)
        with WorkerGroup(RolloutWorker, pool, name="relay-ray", backend=ClusterConfig(backend="ray"),
                         distributed=False) as group:
            relay = WeightRelay(bucket_mb=0.02)
            m1 = relay.push_to_group(trainer.named_parameters(), group, version=1)
            m2 = relay.push_to_group(trainer.named_parameters(), group, version=2)
            assert (m1["relay/layout_sent"], m2["relay/layout_sent"]) == (2.0, 0.0)
            assert group.all("version") == [2, 2]
            for got in group.all("weights"):
                for n, p in trainer.named_parameters():
                    assert torch.equal(got[n], p.detach()), n
    finally:
        ray.shutdown()
