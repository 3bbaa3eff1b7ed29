"""RewardEngine: verifier choice, format reward, error counting, threading, async path, config checks."""

import math
import threading

import pytest
from pydantic import ValidationError

from relayrl.data.tasks import make_task
from relayrl.engines.reward import RewardConfig, RewardEngine, RewardError


def test_task_verifier_scores_arith():
    eng = RewardEngine(RewardConfig(verifier="task"), task=make_task("arith"))
    rewards, metrics = eng.score(["123+456="] * 3, ["579", "579\nmore text", "578"], ["579"] * 3)
    assert rewards == [1.0, 1.0, 0.0]
    assert metrics["reward/verifier_mean"] == pytest.approx(2 / 3)
    assert metrics["reward/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/errors"] == 0.0
    assert "reward/format_mean" not in metrics


def test_task_verifier_needs_a_task():
    with pytest.raises(RewardError, match="needs a built-in task"):
        RewardEngine(RewardConfig(verifier="task"))


def test_exact_verifier():
    eng = RewardEngine(RewardConfig(verifier="exact"))
    assert eng.score(["p"] * 3, [" yes\n", "yes!", "no"], ["yes", "yes", "yes"])[0] == [1.0, 0.0, 0.0]


def test_format_reward_added_with_weight_and_zeroed_for_truncated_rows():
    cfg = RewardConfig(verifier="task", format_weight=0.5, format_regex=r"^\d+$")
    eng = RewardEngine(cfg, task=make_task("arith"))
    responses = ["579\nthat is it", "57a9", "578", "579"]
    rewards, metrics = eng.score(["123+456="] * 4, responses, ["579"] * 4, finish_reasons=["stop", "stop", "stop", "length"])
    # verifier: 1, 0, 0, 1; format (first line is digits): 1, 0, 1, 0 (row 3 truncated)
    assert rewards == [1.5, 0.0, 0.5, 1.0]
    assert metrics["reward/format_mean"] == pytest.approx(0.5)
    assert metrics["reward/verifier_mean"] == pytest.approx(0.5)
    assert metrics["reward/truncated_frac"] == pytest.approx(0.25)
    assert metrics["reward/std"] == pytest.approx(math.sqrt(sum((r - 0.75) ** 2 for r in rewards) / 4))


def test_math_verifier_with_boxed_format_on_whole_response():
    cfg = RewardConfig(verifier="math", format_weight=0.1, format_regex=r"\\boxed\{.+\}")
    eng = RewardEngine(cfg)
    rewards, metrics = eng.score(
        ["q"] * 3, [r"thus \boxed{\frac{1}{2}}", "it is 0.5", r"\boxed{2}"], ["0.5", r"\frac{1}{2}", "3"]
    )
    assert rewards == pytest.approx([1.1, 1.0, 0.1])
    assert metrics["reward/format_mean"] == pytest.approx(2 / 3)


class _FlakyTask:
    """A task whose verifier raises or returns NaN on odd inputs, like a fragile user verifier."""

    name = "flaky"

    def verify(self, response: str, answer: str) -> float:
        if response == "boom":
            raise ZeroDivisionError("bad row")
        if response == "nan":
            return math.nan
        return 1.0 if response == answer else 0.0


@pytest.mark.parametrize("workers", [1, 3])
def test_rows_whose_verifier_raises_score_zero_and_are_counted(workers, caplog):
    eng = RewardEngine(RewardConfig(verifier="task", workers=workers), task=_FlakyTask())
    responses = ["a", "boom", "a", "nan", "b", "a", "boom"]
    with caplog.at_level("WARNING"):
        rewards, metrics = eng.score(["p"] * 7, responses, ["a"] * 7)
    eng.close()
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert metrics["reward/errors"] == 3.0
    assert "3 of 7 rows raised" in caplog.text and "row 1: ZeroDivisionError: bad row" in caplog.text


def test_threaded_math_scoring_matches_inline_and_keeps_order():
    responses = [rf"\boxed{{{i}/2}}" if i % 3 else f"the answer is {i * 0.5}" for i in range(24)]
    answers = [str(i * 0.5) if i % 4 else "1000" for i in range(24)]
    inline = RewardEngine(RewardConfig(verifier="math")).score(["q"] * 24, responses, answers)[0]
    with RewardEngine(RewardConfig(verifier="math", workers=4)) as eng:
        threaded, metrics = eng.score(["q"] * 24, responses, answers)
    assert threaded == inline
    assert inline == [0.0 if i % 4 == 0 else 1.0 for i in range(24)]  # answer "1000" on every 4th row
    assert metrics["reward/errors"] == 0.0


def test_score_async_overlaps_and_preserves_submission_order():
    gate = threading.Event()

    class GatedTask:
        name = "gated"

        def verify(self, response, answer):
            gate.wait(5)
            return 1.0 if response == answer else 0.0

    eng = RewardEngine(RewardConfig(verifier="task"), task=GatedTask())
    responses = ["x", "y"]
    f1 = eng.score_async(["p", "p"], responses, ["x", "x"])
    f2 = eng.score_async(["p"], ["z"], ["z"])
    responses.append("mutated after submit")  # inputs were copied
    assert not f1.done()  # scoring waits on the gate: the caller was not blocked
    gate.set()
    assert f1.result(5)[0] == [1.0, 0.0]
    assert f2.result(5)[0] == [1.0]
    eng.close()
    with pytest.raises(RuntimeError, match="after close"):
        eng.score(["p"], ["x"], ["x"])


def test_score_async_propagates_contract_errors():
    eng = RewardEngine(RewardConfig(verifier="user", user_fn="relayrl.engines.reward.examples:contains_answer"))
    fut = eng.score_async(["p", "p"], ["a"], ["a", "b"])
    with pytest.raises(RewardError, match="differ in length"):
        fut.result(5)
    eng.close()


def test_input_checks():
    eng = RewardEngine(RewardConfig(verifier="math"))
    with pytest.raises(RewardError, match=r"'prompts': 1, 'responses': 2, 'answers': 2"):
        eng.score(["p"], ["a", "b"], ["1", "2"])
    with pytest.raises(RewardError, match=r"answers\[1\] is NoneType; verifier 'math' needs a ground-truth string"):
        eng.score(["p", "p"], ["a", "b"], ["1", None])
    with pytest.raises(RewardError, match=r"responses\[0\] is list"):
        eng.score(["p"], [[1, 2]], ["1"])
    with pytest.raises(RewardError, match=r"finish_reasons\[0\] is 'eos'"):
        eng.score(["p"], ["a"], ["1"], finish_reasons=["eos"])
    rewards, metrics = eng.score([], [], [])
    assert rewards == [] and metrics["reward/mean"] == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"verifier": "user"}, "needs reward.user_fn"),
        ({"verifier": "math", "user_fn": "a.b:c"}, "set reward.verifier='user'"),
        ({"format_regex": "(unclosed"}, "not a valid regex"),
        ({"format_weight": 0.2}, "needs reward.format_regex"),
        ({"workers": 0}, "greater than or equal to 1"),
        ({"verifier": "model"}, "verifier"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValidationError) as e:
        RewardConfig(**kwargs)
    assert message in str(e.value)


def test_bad_user_fn_fails_at_engine_construction():
    with pytest.raises(RewardError, match="no attribute 'nope'"):
        RewardEngine(RewardConfig(verifier="user", user_fn="relayrl.engines.reward.examples:nope"))
