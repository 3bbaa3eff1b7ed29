import pytest
import torch

from relayrl.dock import Dock, DockConfig, PartitionClosedError

from . import scenarios


@pytest.fixture(params=[1, 3], ids=["1unit", "3units"])
def dock(request):
    d = Dock(units=request.param, backend="local", lease_s=30.0)
    yield d
    d.shutdown()


def test_round_trip(dock):
    scenarios.round_trip(dock)


def test_stage_readiness(dock):
    scenarios.stage_readiness(dock)


def test_whole_groups_and_token_budget(dock):
    scenarios.whole_groups_and_tokens(dock)


def test_dp_balance(dock):
    scenarios.dp_balance(dock)


def test_leases_and_release(dock):
    scenarios.leases_and_release(dock)


def test_expiry():
    scenarios.expiry(Dock(units=2, lease_s=0.05))


@pytest.mark.parametrize("seed", range(4))
def test_concurrent_exactly_once(seed):
    short = seed % 2 == 1
    scenarios.concurrent(Dock(units=1 + seed % 3, lease_s=0.05 if short else 30.0), seed, always_release=not short)


def test_config_and_from_config():
    cfg = DockConfig(units=2, lease_s=5.0)
    d = Dock.from_config(cfg)
    assert d.config == cfg and d.lease_s == 5.0
    with pytest.raises(ValueError, match="backend"):
        DockConfig(backend="redis")
    with pytest.raises(ValueError, match="units"):
        Dock(units=0)


def test_bad_input_errors():
    d = Dock()
    d.open_partition("p", rows=4, columns=["ids", "lp"])
    idx = d.put("p", {"ids": [torch.arange(2)] * 2})
    with pytest.raises(TypeError, match="column 'ids' gets torch.int32.*earlier rows hold torch.int64"):
        d.put("p", {"ids": [torch.arange(2, dtype=torch.int32)] * 2})
    with pytest.raises(KeyError, match="'nope' is not declared"):
        d.put("p", {"nope": [1.0, 2.0]}, indexes=idx)
    with pytest.raises(KeyError, match="does not declare"):
        d.stream("p", "s", ["ids", "nope"], batch_size=2)
    with pytest.raises(ValueError, match="exceeds partition 'p'"):
        d.stream("p", "s", ["ids"], batch_size=5)
    with pytest.raises(ValueError, match="exceed the declared 4 rows"):
        d.put("p", {"ids": [torch.arange(1)] * 3})
    with pytest.raises(IndexError, match="row 3 does not exist"):
        d.put("p", {"lp": [torch.zeros(1)]}, indexes=[3])
    with pytest.raises(KeyError, match="column 'lp' has not been written"):
        d.get("p", idx, ["lp"])
    with pytest.raises(ValueError, match="2 rows but the put has 1"):
        d.put("p", {"lp": [torch.zeros(1)] * 2}, indexes=[0])
    with pytest.raises(ValueError, match="already open"):
        d.open_partition("p", rows=1)
    with pytest.raises(ValueError, match="multiple of group_size"):
        d.open_partition("q", rows=5, group_size=2)
    d.stream("p", "s", ["ids", "lp"], batch_size=1)
    s = d.stream("p", "s", ["ids"], batch_size=1)  # nothing consumed yet: the spec may change
    next(s)
    with pytest.raises(ValueError, match="stage 's' is registered as .* has handed out rows"):
        d.stream("p", "s", ["ids", "lp"], batch_size=1)
    with pytest.raises(PartitionClosedError, match="'zzz' is not open"):
        d.put("zzz", {"ids": [torch.arange(1)]})


def test_close_and_reopen_does_not_leak():
    d = Dock(units=2)
    d.open_partition("p", rows=4)
    d.put("p", {"x": [torch.ones(1)] * 4})
    old = next(iter(d.stream("p", "s", ["x"], batch_size=2)))
    d.close_partition("p")
    d.open_partition("p", rows=4)
    with pytest.raises(PartitionClosedError, match="closed since it was handed out"):
        old.ack()
    with pytest.raises(KeyError, match="column 'x' has not been written"):
        d.get("p", [0], ["x"])
    assert d.progress("p", "s") == {"rows": 4, "acked": 0, "ready_units": 0, "leased_units": 0, "waiting_units": 4}


def test_rewrite_after_redelivery_publishes_once():
    d = Dock(lease_s=30.0)
    d.open_partition("p", rows=2)
    idx = d.put("p", {"x": [torch.ones(1)] * 2})
    d.put("p", {"y": [torch.zeros(1)] * 2}, indexes=idx)
    d.put("p", {"y": [torch.full((1,), 3.0)] * 2}, indexes=idx)  # recomputed after a re-delivery
    batches = list(d.stream("p", "s", ["y"], batch_size=2, auto_ack=True))
    assert len(batches) == 1 and batches[0]["y"][0].item() == 3.0


def test_state_dict_round_trip():
    d = Dock(units=2)
    d.open_partition("p", rows=6)
    resp = scenarios.ragged(6, 9, lo=1)
    d.put("p", {"response_ids": resp})
    s = d.stream("p", "update", ["response_ids"], batch_size=2)
    first = next(s)
    first.ack()
    next(s)  # leased, never acked: must come back after restore
    state = d.state_dict("p")
    assert sorted(state["data"]["response_ids"]["indexes"]) == sorted(set(range(6)) - set(first.indexes))
    d2 = Dock(units=3)
    d2.load_state_dict(state)
    rest = []
    for b in d2.stream("p", "update", ["response_ids"], batch_size=2):
        for pos, i in enumerate(b.indexes):
            assert torch.equal(b["response_ids"][pos], resp[i])
        rest += b.ack()
    assert sorted(rest + first.indexes) == list(range(6))


def test_puts_are_spread_over_units():
    d = Dock(units=3)
    d.open_partition("p", rows=9)
    for _ in range(3):
        d.put("p", {"x": [torch.ones(2)] * 3})
    assert [len(u._data[1]["x"]) for u in d._plane.units] == [3, 3, 3]
    got = d.get("p", [8, 0, 4], ["x"])  # one read spanning all units, in request order
    assert got.indexes == [8, 0, 4] and all(torch.equal(v, torch.ones(2)) for v in got["x"])


def test_batches_read_from_one_storage_unit_when_readiness_allows():
    d = Dock(units=2)
    d.open_partition("p", rows=16)
    for _ in range(4):  # puts of 4 rows alternate between the two units: rows 0-3 u0, 4-7 u1, 8-11 u0, 12-15 u1
        d.put("p", {"x": [torch.ones(1)] * 4})
    batches = [b.indexes for b in d.stream("p", stage="s", columns=["x"], batch_size=8, auto_ack=True)]
    assert [sorted(b) for b in batches] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert batches[0][0] == 0  # the oldest ready row still goes first


def test_reserve_write_publish_is_put_in_three_steps(dock):
    dock.open_partition("r", rows=8, group_size=2)
    slots = dock.reserve("r", 4)
    assert slots.indexes == [0, 1, 2, 3]
    receipt = slots.write({"response_ids": [torch.arange(n) for n in (1, 2, 3, 4)]})
    loader = dock.stream("r", "s", ["response_ids"], batch_size=2, timeout_s=0.2)
    with pytest.raises(TimeoutError):  # stored but not published: invisible
        next(loader)
    assert dock.publish(receipt) == [0, 1, 2, 3]
    b = next(loader)
    assert [len(t) for t in b["response_ids"]] == [1, 2]
    fill = dock.slots("r", [3, 1]).write({"rewards": [3.0, 1.0]})
    dock.publish(fill)
    got = dock.get("r", [1, 3], ["rewards"])
    assert [float(x) for x in got["rewards"]] == [1.0, 3.0]


def test_joined_slots_of_several_groups_are_one_write_and_one_receipt(dock):
    from relayrl.dock import Slots

    dock.open_partition("j", rows=8, group_size=2)
    a, b = dock.reserve("j", 2), dock.reserve("j", 2)
    both = Slots.join([b.select([1]), a, b.select([0])])
    assert both.indexes == [3, 0, 1, 2]
    receipt = both.write({"x": [torch.full((1,), float(i)) for i in (3, 0, 1, 2)]})
    assert dock.publish(receipt) == [3, 0, 1, 2]
    assert [float(t) for t in dock.get("j", [0, 1, 2, 3], ["x"])["x"]] == [0.0, 1.0, 2.0, 3.0]
    dock.open_partition("k", rows=2)
    with pytest.raises(ValueError, match="different partitions"):
        Slots.join([dock.reserve("j", 2), dock.reserve("k", 2)])


def test_publish_rejects_a_mismatched_column_and_a_closed_partition(dock):
    import pickle

    dock.open_partition("m", rows=4)
    dock.put("m", {"x": [torch.ones(2)] * 2})
    bad = dock.slots("m", [0]).write({"x": [torch.ones(2, dtype=torch.int64)]})
    with pytest.raises(TypeError, match="column 'x' gets torch.int64"):
        dock.publish(bad)
    late = dock.reserve("m", 2).write({"x": [torch.ones(1)] * 2})
    dock.close_partition("m")
    with pytest.raises(PartitionClosedError, match="closed after its slots were handed out"):
        dock.publish(late)
    dock.open_partition("m", rows=4)
    with pytest.raises(ValueError, match="positive int"):
        dock.reserve("m", 0)
    with pytest.raises(TypeError, match="live in the driver process"):
        pickle.dumps(dock.reserve("m", 1))


def test_reader_works_in_process_and_refuses_pickling(dock):
    import pickle

    dock.open_partition("r", rows=4)
    rows = [torch.arange(k) for k in (3, 1, 4, 2)]
    dock.put("r", {"response_ids": rows})
    reader = dock.reader("r", [3, 0], ["response_ids"])
    assert reader.indexes == [3, 0] and len(reader) == 2
    assert [t.tolist() for t in reader.read()["response_ids"]] == [[0, 1], [0, 1, 2]]
    with pytest.raises(TypeError, match="backend='process'"):
        pickle.dumps(reader)
    with pytest.raises(KeyError, match="has not been written"):
        dock.reader("r", [0], ["rewards"])
    with pytest.raises(IndexError):
        dock.reader("r", [9], ["response_ids"])
    dock.close_partition("r")
    with pytest.raises(PartitionClosedError, match="closed after this reader was made"):
        reader.read()


def test_retired_rows_are_never_handed_out_and_do_not_hold_a_stage_back(dock):
    """DAPO's dynamic sampling drops a scored group and leaves capacity unused: retired rows leave the ready
    queue of a stage that already saw them, a stage registered later never sees them, and the partition ends
    (acquire returns None) once the kept rows are acknowledged."""
    dock.open_partition("p", rows=8, group_size=2)
    dock.register_stage("score", ["ids"], whole_groups=True)
    dock.put("p", {"ids": [torch.tensor([i]) for i in range(6)]})  # groups 0, 1, 2; group 3 never written
    dock.retire("p", [2, 3])  # group 1 dropped after it became ready for "score"
    with pytest.raises(ValueError, match="not whole groups"):
        dock.retire("p", [4])
    assert sorted(dock.retire("p")) == [6, 7]  # unused capacity; the partition takes no new rows
    with pytest.raises(ValueError, match="exceed"):
        dock.reserve("p", 2)
    seen = []
    while (b := dock.acquire("p", "score", batch_size=8, timeout_s=5.0)) is not None:
        seen += b.indexes
        b.ack()
    assert sorted(seen) == [0, 1, 4, 5]
    dock.register_stage("late", ["ids"], whole_groups=True)
    b = dock.acquire("p", "late", batch_size=None, timeout_s=5.0)
    assert sorted(b.indexes) == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="leased"):
        dock.retire("p", [0, 1])
    b.ack()
    assert dock.acquire("p", "late", batch_size=None, timeout_s=5.0) is None


def test_an_ack_by_lease_names_each_row_once_and_refuses_rows_outside_the_partition(dock):
    """The service API's ack (remote consumers send indexes): a duplicate index is one row retired, once; an index
    outside the partition is refused (a negative one used to wrap around and retire the last row instead)."""
    dock.open_partition("p", rows=4)
    dock.register_stage("s", ["ids"])
    dock.put("p", {"ids": [torch.tensor([i]) for i in range(4)]})
    b = dock.acquire("p", "s", batch_size=4, timeout_s=5.0)
    for bad in ([-1], [4], [0, 7]):
        with pytest.raises(ValueError, match="outside"):
            dock.ack("p", b.generation, "s", b.lease_id, bad)
    assert dock.progress("p", "s")["acked"] == 0
    assert dock.ack("p", b.generation, "s", b.lease_id, [3, 3, 0]) == [3, 0]
    assert sorted(b.ack()) == [1, 2]
