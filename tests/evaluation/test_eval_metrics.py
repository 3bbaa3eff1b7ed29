"""Hand-checked values for pass@k / avg@k (Chen et al. 2021 estimator)."""

import math

import pytest

from relayrl.evaluation.metrics import avg_at_k, budgets, pass_at_k, summarize


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 1, 0.3),  # pass@1 = c/n
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (10, 0, 5, 0.0),
        (10, 10, 1, 1.0),
        (5, 4, 2, 1.0),  # n - c < k: any 2 samples include a correct one
        (20, 5, 10, 1 - math.comb(15, 10) / math.comb(20, 10)),
    ],
)
def test_pass_at_k_hand_checked(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_large_n_stays_in_range():
    value = pass_at_k(1000, 1, 100)
    assert value == pytest.approx(0.1)  # 1 - (999 choose 100)/(1000 choose 100) = 100/1000


@pytest.mark.parametrize(
    ("args", "fragment"),
    [((4, 5, 1), "num_correct"), ((4, 1, 5), "k must be in"), ((0, 0, 1), "num_samples"), ((4, 1, 0), "k must be in")],
)
def test_pass_at_k_rejects_bad_input(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        pass_at_k(*args)


def test_avg_at_k_ragged_and_errors():
    assert avg_at_k([[1.0, 0.0], [0.5, 0.5, 1.0, 0.0]]) == pytest.approx((0.5 + 0.5) / 2)
    assert avg_at_k([[0.2], [0.4, 0.8]]) == pytest.approx((0.2 + 0.6) / 2)
    with pytest.raises(ValueError, match=r"rewards_per_prompt\[1\]"):
        avg_at_k([[1.0], []])
    with pytest.raises(ValueError, match="empty"):
        avg_at_k([])


def test_summarize_hand_checked():
    correct = [
        [True, False, False, False],  # c=1
        [True, True, False, False],  # c=2
        [False, False, False, False],  # c=0
    ]
    out = summarize(correct, ks=[2, 4])
    assert set(out) == {"pass@1", "pass@2", "pass@4", "avg@4"}
    assert out["pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    # pass@2: 1 - C(3,2)/C(4,2) = 0.5 ; 1 - C(2,2)/C(4,2) = 5/6 ; 0
    assert out["pass@2"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert out["avg@4"] == pytest.approx(out["pass@1"])


def test_summarize_errors_name_the_row():
    with pytest.raises(ValueError, match=r"per_prompt_correct\[1\] has 1 samples"):
        summarize([[1, 0], [1]], ks=[1])
    with pytest.raises(ValueError, match=r"per_prompt_correct\[0\]\[1\] = 0.5"):
        summarize([[1, 0.5]], ks=[1])
    with pytest.raises(ValueError, match="ks contains 3"):
        summarize([[1, 0]], ks=[3])


def test_budgets_are_one_the_powers_of_two_below_n_and_n():
    assert budgets(1) == [1] and budgets(2) == [1, 2] and budgets(5) == [1, 2, 4, 5]
    assert budgets(16) == [1, 2, 4, 8, 16] and budgets(17) == [1, 2, 4, 8, 16, 17]
    with pytest.raises(ValueError, match="n=0"):
        budgets(0)
