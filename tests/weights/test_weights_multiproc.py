"""The relay across processes: a 2-rank local worker group (spawned ranks, gloo)."""
import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from weights_workers import RolloutWorker, tiny_model

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def group():
    g = WorkerGroup(RolloutWorker, ResourcePool("relay-mp", devices=2), name="relay-mp", distributed=True)
    yield g
    g.shutdown()


@pytest.mark.parametrize("transport", ["shm", "pickle"])
def test_push_to_two_ranks_sends_layout_once_and_every_rank_matches(group, transport):
    import os

    from relayrl.weights import WeightRelay

    trainer = tiny_model(seed=0)
    want = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    before = group.all("weights")
    assert not torch.equal(before[0]["lm_head.weight"], want["lm_head.weight"])
    group.all("forget_layouts")
    base = group.one("version")
    relay = WeightRelay(bucket_mb=0.02, transport=transport)
    m1 = relay.push_to_group(trainer.named_parameters(), group, version=base + 1)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-0.5)
    m2 = relay.push_to_group(trainer.named_parameters(), group, version=base + 2)
    assert (m1["relay/layout_sent"], m2["relay/layout_sent"]) == (2.0, 0.0) and m1["relay/buckets"] > 1
    assert [f[-2:] for f in group.all("flags")] == [[True, False], [True, False]]
    assert group.all("version") == [base + 2, base + 2]
    for got in group.all("weights"):
        for n, p in trainer.named_parameters():
            assert torch.equal(got[n], p.detach()), n
    paths = [h.path for h in relay._shm.handles] if transport == "shm" else []
    assert len(paths) == m1["relay/buckets"] * (transport == "shm") and all(os.path.exists(p) for p in paths)
    relay.close()
    assert not any(os.path.exists(p) for p in paths)


def test_gather_full_state_gathers_dtensor_shards(group):
    full = torch.arange(24.0).reshape(6, 4)
    assert group.all("gather_sharded", full) == [(True, True), (True, True)]
