"""The relay across processes: a 2-rank local worker group (spawned ranks, gloo)."""
import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from weights_workers import RolloutWorker, ShardedSender, tiny_model

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


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 100, 36])
def test_gather_full_state_in_buckets_matches_every_shape(group, bucket_bytes):
    """Row-sharded tensors are gathered in flat buckets (one bucket, or a few at 100 or 36 bytes): uneven
    splits (5 rows on 2 ranks), a rank with no rows (1 row), 1-D and 3-D shapes, two dtypes (two buckets), with
    a replicated DTensor and a plain tensor between them; every rank gets every tensor back exactly. At 36
    bytes rank 0's shard of ``a`` fills a bucket and rank 1's (2 rows of 3) does not: the ranks must still cut
    the buckets alike (else their collectives would not match)."""
    g = torch.Generator().manual_seed(0)
    fulls = {"a": torch.randn(5, 3, generator=g), "b.plain": torch.randn(2), "c": torch.randn(1, 4, generator=g),
             "d": torch.randn(7, generator=g).to(torch.bfloat16), "e.replicated": torch.randn(3, 2, generator=g),
             "f": torch.randn(4, 2, 3, generator=g), "g": torch.randn(6, generator=g).to(torch.bfloat16)}
    want = {n: True for n in fulls}
    assert group.all("gather_many", fulls, bucket_bytes) == [want, want]
    # keep=False on rank 1: it joins every collective (rank 0 still gets every tensor) and keeps nothing
    assert group.all("gather_many", fulls, bucket_bytes, rank0_only=True) == [want, None]


def test_push_from_a_sharded_group_skips_the_driver_and_every_rank_matches(group):
    """The sender group's rank 0 packs into the relay's shared memory: the first push learns the layout (two
    pack calls, the second one writing), the next one packs once; every receiving rank holds the sender's
    full weights each time. A relay that may not share memory (transport='pickle') says None and packs nothing."""
    from relayrl.weights import WeightRelay

    sender = WorkerGroup(ShardedSender, ResourcePool("relay-send", devices=2), name="relay-send", distributed=True)
    try:
        group.all("forget_layouts")
        base = group.one("version")
        relay = WeightRelay(bucket_mb=0.02)
        m1 = relay.push_from_group(sender, "pack_weights_into", group, version=base + 1)
        assert sender.all("pack_calls") == [2, 2] and m1["relay/layout_sent"] == 2.0 and m1["relay/buckets"] > 1
        for got in group.all("weights"):
            for n, p in tiny_model(0).named_parameters():
                assert torch.equal(got[n], p.detach()), n
        sender.all("set_seed", 7)
        m2 = relay.push_from_group(sender, "pack_weights_into", group, version=base + 2)
        assert sender.all("pack_calls") == [3, 3] and m2["relay/layout_sent"] == 0.0
        assert group.all("version") == [base + 2, base + 2]
        for got in group.all("weights"):
            for n, p in tiny_model(7).named_parameters():
                assert torch.equal(got[n], p.detach()), n
        assert WeightRelay(transport="pickle").push_from_group(sender, "pack_weights_into", group,
                                                                 version=base + 3) is None
        assert sender.all("pack_calls") == [3, 3] and group.all("version") == [base + 2, base + 2]
        relay.close()
    finally:
        sender.shutdown()


def test_stage_from_a_sharded_group_skips_the_driver_and_applies_without_a_copy(group):
    """Off-policy packing from a multi-process actor: its rank 0 packs into a shared-memory host slot,
    `apply_to_group` sends that slot's files as they are, and an applied slot serves the next pack while a
    version packed but not applied keeps its own. `close` removes every slot's files."""
    import os

    from relayrl.weights import WeightRelay

    sender = WorkerGroup(ShardedSender, ResourcePool("relay-pack", devices=2), name="relay-pack", distributed=True)
    try:
        group.all("forget_layouts")
        base = group.one("version")
        relay = WeightRelay(bucket_mb=0.02)
        first = relay.pack_from_group(sender, "pack_weights_into", version=base + 1)
        assert sender.all("pack_calls") == [2, 2]  # learnt the layout, then packed
        slot = relay._live[first.ticket]
        paths = [h.path for h in slot.handles]
        assert all(os.path.exists(p) for p in paths) and len(paths) == len(first.layout.buckets) > 1
        sender.all("set_seed", 7)  # the trainer moves on; the packed copy keeps version base+1
        m = relay.apply_to_group(first, group)
        assert m["relay/layout_sent"] == 2.0 and group.all("version") == [base + 1, base + 1]
        for got in group.all("weights"):
            for n, p in tiny_model(0).named_parameters():
                assert torch.equal(got[n], p.detach()), n
        second = relay.pack_from_group(sender, "pack_weights_into", version=base + 2)
        assert [h.path for h in relay._live[second.ticket].handles] == paths  # the applied slot, reused
        third = relay.pack_from_group(sender, "pack_weights_into", version=base + 3)
        assert relay._live[third.ticket].handles[0].path not in paths  # `second` is not applied yet
        relay.discard(second)
        relay.apply_to_group(third, group)
        assert group.all("version") == [base + 3, base + 3]
        for got in group.all("weights"):
            for n, p in tiny_model(7).named_parameters():
                assert torch.equal(got[n], p.detach()), n
        assert sender.all("pack_calls") == [4, 4]
        slots = [h.path for s in relay._free_shm for h in s.handles]
        assert len(slots) == 2 * len(paths) and all(os.path.exists(p) for p in slots)
        relay.close()
        assert not any(os.path.exists(p) for p in slots)
        assert WeightRelay(transport="pickle").pack_from_group(sender, "pack_weights_into", version=1) is None
    finally:
        sender.shutdown()


def test_a_full_dev_shm_is_said_once_and_the_weights_still_arrive(group, monkeypatch):
    """No room in /dev/shm: the relay warns once that the weights go through the driver, and they arrive;
    the paths that pack in the sender say None (the caller falls back) after the same warning."""
    import warnings

    from relayrl.weights import WeightRelay
    from relayrl.weights import relay as relay_mod

    monkeypatch.setattr(relay_mod, "shm_available", lambda nbytes: False)
    trainer = tiny_model(seed=3)
    base = group.one("version")
    relay = WeightRelay(bucket_mb=0.02)
    with pytest.warns(RuntimeWarning, match=r"/dev/shm is missing or has less than \d+ MiB free.*--shm-size"):
        relay.push_to_group(trainer.named_parameters(), group, version=base + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per relay
        relay.push_to_group(trainer.named_parameters(), group, version=base + 2)
    assert relay._shm is None and group.all("version") == [base + 2, base + 2]
    for got in group.all("weights"):
        for n, p in trainer.named_parameters():
            assert torch.equal(got[n], p.detach()), n
    sender = WorkerGroup(ShardedSender, ResourcePool("relay-full", devices=2), name="relay-full", distributed=True)
    try:
        other = WeightRelay(bucket_mb=0.02)
        with pytest.warns(RuntimeWarning, match="pass through the driver"):
            assert other.push_from_group(sender, "pack_weights_into", group, version=base + 3) is None
        assert other.pack_from_group(sender, "pack_weights_into", version=base + 3) is None
        assert group.all("version") == [base + 2, base + 2]
    finally:
        sender.shutdown()
