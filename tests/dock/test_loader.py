import pytest

from relayrl.dock import balance_shards


def test_balance_shards_equal_counts_and_close_tokens():
    weights = [500, 480, 90, 70, 60, 400, 30, 20]
    shards = balance_shards(weights, [1] * 8, 2)
    assert sorted(len(s) for s in shards) == [4, 4]
    assert sorted(i for s in shards for i in s) == list(range(8))
    totals = [sum(weights[i] for i in s) for s in shards]
    # best possible 4/4 split differs by 210 (720 vs 930); the naive [0:4]/[4:8] split differs by 630
    assert abs(totals[0] - totals[1]) == 210


def test_balance_shards_with_groups():
    shards = balance_shards([10, 9, 1, 1], [4, 4, 4, 4], 2)
    assert [sum(4 for _ in s) for s in shards] == [8, 8]
    assert {frozenset(s) for s in shards} == {frozenset({0, 3}), frozenset({1, 2})}  # 11 vs 10 tokens


def test_balance_shards_rejects_bad_args():
    with pytest.raises(ValueError, match="k must be"):
        balance_shards([1], [1], 0)
    with pytest.raises(ValueError, match="differ in length"):
        balance_shards([1, 2], [1], 2)
