"""Backend-independent dock scenarios; test_dock_local.py and test_dock_ray.py run them."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
import torch

from relayrl.dock import Dock


def ragged(n: int, seed: int, lo: int = 0, hi: int = 9, dtype=torch.int64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 1000, (k,), generator=g).to(dtype) for k in lens]


def round_trip(dock: Dock) -> None:
    """Ragged and scalar columns come back unpadded, equal, in index order."""
    dock.open_partition("p", rows=20)
    prompts, resp = ragged(20, 1), ragged(20, 2, lo=1)
    idx = dock.put("p", {"prompt_ids": prompts[:12], "response_ids": resp[:12]})
    idx += dock.put("p", {"prompt_ids": prompts[12:], "response_ids": resp[12:]})
    assert idx == list(range(20))
    rewards = [float(i) / 2 for i in range(20)]
    dock.put("p", {"rewards": rewards, "ref_logprobs": [torch.randn(len(r)) for r in resp]}, indexes=idx)
    got = dock.get("p", [7, 3, 19, 0], ["prompt_ids", "response_ids", "rewards"])
    assert got.indexes == [7, 3, 19, 0]
    for pos, i in enumerate(got.indexes):
        assert torch.equal(got["prompt_ids"][pos], prompts[i])
        assert torch.equal(got["response_ids"][pos], resp[i])
        assert got["rewards"][pos].item() == rewards[i] and got["rewards"][pos].dim() == 0
    flat, lengths = got.flat("response_ids")
    assert flat.numel() == sum(len(resp[i]) for i in got.indexes)  # no padding
    assert lengths.tolist() == [len(resp[i]) for i in got.indexes]
    seen = []
    for batch in dock.stream("p", "update", ["response_ids", "ref_logprobs"], batch_size=8):
        assert len(batch) <= 8
        for pos, i in enumerate(batch.indexes):
            assert batch["ref_logprobs"][pos].shape == resp[i].shape
        seen += batch.ack()
    assert sorted(seen) == list(range(20))
    dock.close_partition("p")


def stage_readiness(dock: Dock) -> None:
    """A stage receives only rows whose needed columns are all written; others keep streaming."""
    dock.open_partition("p", rows=8)
    idx = dock.put("p", {"response_ids": ragged(8, 3, lo=1)})
    ref = dock.stream("p", "update", ["response_ids", "ref_logprobs"], batch_size=4, timeout_s=0.05)
    with pytest.raises(TimeoutError, match="ref_logprobs"):
        next(ref)
    first = next(iter(dock.stream("p", "reference", ["response_ids"], batch_size=8)))
    assert sorted(first.indexes) == idx
    dock.put("p", {"ref_logprobs": [torch.zeros(2)] * 3}, indexes=[5, 1, 6])
    with pytest.raises(TimeoutError, match="3 units ready"):
        next(ref)  # 3 ready rows are not a batch of 4 while 5 rows may still arrive
    dock.put("p", {"ref_logprobs": [torch.zeros(2)]}, indexes=[0])
    assert sorted(next(ref).indexes) == [0, 1, 5, 6]
    dock.put("p", {"ref_logprobs": [torch.zeros(2)] * 4}, indexes=[2, 3, 4, 7])
    assert sorted(next(ref).indexes) == [2, 3, 4, 7]
    dock.close_partition("p")


def whole_groups_and_tokens(dock: Dock) -> None:
    """Whole-group batches never split a prompt's responses; token budgets bound batches."""
    g = 4
    dock.open_partition("p", rows=32, group_size=g)
    resp = ragged(32, 4, lo=1, hi=30)
    idx = dock.put("p", {"response_ids": resp})
    # groups become ready only when all their rows have rewards: fill rows in a shuffled order
    order = idx[:]
    random.Random(0).shuffle(order)
    dock.put("p", {"rewards": [1.0] * 16}, indexes=order[:16])
    seen = []
    loader = dock.stream("p", "adv", ["response_ids", "rewards"], batch_size=8, whole_groups=True, timeout_s=5)
    complete = {q for q in range(8) if all(r in order[:16] for r in range(q * g, q * g + g))}
    if len(complete) >= 2:  # a batch of 8 rows is two complete groups
        b = next(loader)
        assert {i // g for i in b.indexes} <= complete
        seen += b.ack()
    dock.put("p", {"rewards": [1.0] * 16}, indexes=order[16:])
    for b in loader:
        groups = Counter(i // g for i in b.indexes)
        assert all(c == g for c in groups.values()), groups
        seen += b.ack()
    assert sorted(seen) == idx
    budget = 60
    seen = []
    for b in dock.stream("p", "tok", ["response_ids"], max_tokens=budget):
        toks = b.tokens()
        assert toks == [len(resp[i]) for i in b.indexes]
        assert sum(toks) <= budget or len(b) == 1
        seen += b.ack()
    assert sorted(seen) == idx
    dock.close_partition("p")


def dp_balance(dock: Dock) -> None:
    """dp_size=2 splits each batch into two shards of equal rows and balanced tokens."""
    dock.open_partition("p", rows=16)
    lens = [100, 1, 1, 1, 100, 1, 1, 1, 90, 2, 2, 2, 90, 2, 2, 2]
    dock.put("p", {"response_ids": [torch.zeros(n, dtype=torch.int64) for n in lens]})
    for b in dock.stream("p", "update", ["response_ids"], batch_size=4, dp_size=2):
        assert len(b) == 8 and [len(s) for s in b.shards] == [4, 4]
        assert sorted(i for s in b.shards for i in s.indexes) == sorted(b.indexes)
        t = [sum(s.tokens()) for s in b.shards]
        assert abs(t[0] - t[1]) <= 10, t  # the index-order split would put both long rows together
        assert sum(len(s.ack()) for s in b.shards) == 8
    dock.close_partition("p")


def leases_and_release(dock: Dock) -> None:
    """Unacked rows come back after the lease expires or at once after release; stale acks are refused."""
    dock.open_partition("p", rows=6)
    dock.put("p", {"x": [torch.ones(1)] * 6})
    dead = dock.stream("p", "s", ["x"], batch_size=3, consumer_id="dead", timeout_s=5)
    lost = next(dead)
    live = dock.stream("p", "s", ["x"], batch_size=3, consumer_id="live", timeout_s=5)
    b = next(live)
    assert set(b.indexes).isdisjoint(lost.indexes)
    assert b.ack() == b.indexes
    assert dock.release("dead") == 3
    again = next(live)
    assert sorted(again.indexes) == sorted(lost.indexes)
    assert lost.ack() == []  # the dead consumer's late ack is refused: exactly-once
    assert sorted(again.ack()) == sorted(lost.indexes)
    with pytest.raises(StopIteration):
        next(live)
    dock.close_partition("p")


def expiry(dock: Dock) -> None:
    """With a short lease, a row never acked is handed out again to the next request."""
    dock.open_partition("p", rows=2)
    dock.put("p", {"x": [torch.ones(1), torch.ones(2)]})
    s = dock.stream("p", "s", ["x"], batch_size=2, timeout_s=5)
    first = next(s)
    second = next(s)  # waits (on an event with a deadline) until the first lease expires
    assert sorted(second.indexes) == sorted(first.indexes)
    assert first.ack() == [] and sorted(second.ack()) == [0, 1]
    dock.close_partition("p")


def concurrent(dock: Dock, seed: int, rows: int = 96, always_release: bool = False) -> None:
    """Random producers/fillers/consumers, some dying mid-lease: every row acked exactly once per stage.

    A dead consumer is declared with ``release`` (always, or by coin flip when the
    lease is short enough for expiry to recover its rows within the test).
    """
    rng = random.Random(seed)
    dock.open_partition("p", rows=rows, group_size=2)
    values: dict[int, torch.Tensor] = {}
    acked = {"fill": [], "update": []}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def producer(n_rows: int, pseed: int) -> None:
        r = random.Random(pseed)
        left = n_rows
        while left:
            k = min(left, 2 * r.randint(1, 4))
            vals = [torch.full((r.randint(1, 6),), float(r.randint(0, 99))) for _ in range(k)]
            idx = dock.put("p", {"a_ids": vals})
            with lock:
                values.update(zip(idx, vals))
            left -= k

    def consumer(stage: str, columns: list[str], cseed: int) -> None:
        r = random.Random(cseed)
        deaths = 0
        while True:
            cid = f"{stage}-{cseed}-{deaths}"
            loader = dock.stream("p", stage, columns, batch_size=2 * r.randint(1, 5), consumer_id=cid, timeout_s=20)
            died = False
            for b in loader:
                if stage == "fill":
                    dock.put("p", {"b": [a * 2 for a in b["a_ids"]]}, indexes=b.indexes)
                else:
                    for a, v in zip(b["a_ids"], b["b"]):
                        assert torch.equal(v, a * 2)
                if deaths < 2 and r.random() < 0.15:
                    died = True  # crash mid-lease: no ack
                    if always_release or r.random() < 0.5:
                        dock.release(cid)
                    break
                got = b.ack()
                with lock:
                    acked[stage].extend(got)
            if not died:
                return
            deaths += 1

    def guard(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    share = [rows // 4] * 4
    threads = [threading.Thread(target=guard, args=(producer, n, seed * 10 + i)) for i, n in enumerate(share)]
    threads += [threading.Thread(target=guard, args=(consumer, "fill", ["a_ids"], seed * 10 + 5 + i)) for i in range(2)]
    threads += [threading.Thread(target=guard, args=(consumer, "update", ["a_ids", "b"], seed * 10 + 7 + i)) for i in range(3)]
    rng.shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for stage, got in acked.items():
        assert len(got) == len(set(got)), f"{stage}: duplicate acks"
        assert sorted(got) == list(range(rows)), f"{stage}: lost rows"
    assert sorted(values) == list(range(rows))
    dock.close_partition("p")
