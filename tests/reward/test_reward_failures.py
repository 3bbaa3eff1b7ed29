"""A reward source that fails for one prompt (issue 35 item 1): a reward model or an LLM judge that raises or
returns garbage (NaN, a wrong count, a malformed verdict with ``reward.judge.malformed_score: null``), and a
reward function that runs past ``reward.timeout_s``. By default the call fails naming the prompt and the cause;
``reward.on_error=drop_group`` leaves that prompt's rows NaN (the step drops its group) and counts them in
``reward/errors``; no failure becomes a reward."""

from __future__ import annotations

import math
import sys
import threading
import time
import types

import pytest

from relayrl.engines.reward import RewardConfig, RewardEngine, RewardError

PROMPTS, RESPONSES = ["a", "a", "b", "b", "c"], ["x", "xx", "y", "yy", "zzz"]


class _Task:
    name = "t"

    @staticmethod
    def verify(response: str, answer: str) -> float:
        return 1.0


class _Scorer:
    """A reward model's scorer that breaks on prompt 'b' in the way asked."""

    def __init__(self, how: str) -> None:
        self.how = how

    def score(self, prompts, responses):
        if "b" in prompts:
            if self.how == "raise":
                raise RuntimeError("CUDA error: device-side assert")
            if self.how == "nan":
                return [math.nan if p == "b" else 1.0 for p in prompts]
            return [1.0] * (len(prompts) - 1)  # a wrong count
        return [float(len(r)) for r in responses]


def _rm_engine(tiny_dir, how: str, **cfg) -> RewardEngine:
    eng = RewardEngine(RewardConfig(model=str(tiny_dir), verifier_weight=0.0, **cfg), task=_Task())
    eng._rm = _Scorer(how)  # (the loaded scorer: the engine loads a model only when it has none)
    return eng


@pytest.mark.parametrize("how, cause", [("raise", "raised RuntimeError: CUDA error: device-side assert"),
                                        ("nan", "returned nan at index 0; rewards must be finite"),
                                        ("count", "returned 1 values for 2 responses; expected 2")])
def test_a_reward_model_failing_on_one_prompt_is_named_or_its_group_dropped(tiny_dir, how, cause):
    with pytest.raises(RewardError) as e:
        _rm_engine(tiny_dir, how).score(PROMPTS, RESPONSES, ["1"] * 5)
    assert f"reward model {tiny_dir} {cause}, scoring the responses to prompt 'b'; fix the reward model" in str(e.value)
    assert "reward.on_error=drop_group" in str(e.value)
    rewards, m = _rm_engine(tiny_dir, how, on_error="drop_group").score(PROMPTS, RESPONSES, ["1"] * 5)
    assert rewards[:2] == [1.0, 2.0] and math.isnan(rewards[2]) and math.isnan(rewards[3]) and rewards[4] == 3.0
    assert m["reward/errors"] == 2.0 and m["reward/mean"] == 2.0 and m["reward/model_mean"] == 2.0


def _judge(how: str):
    def ask(questions):
        if any("Question: b\n" in q for q in questions):
            if how == "raise":
                raise ConnectionError("judge server went away")
            if how == "count":
                return ["Score: 5"]
            return ["no idea" if "Question: b\n" in q else "Score: 5" for q in questions]
        return ["Score: 10"] * len(questions)
    return ask


@pytest.mark.parametrize("how, cause", [
    ("raise", " raised ConnectionError: judge server went away"),
    ("count", ": 1 verdicts for 2 questions"),
    ("malformed", ": malformed verdict 'no idea' (no score in [0, 10] matching reward.judge.score_regex; "
                  "reward.judge.malformed_score is null)")])
def test_a_judge_failing_on_one_prompt_is_named_or_its_group_dropped(tiny_dir, how, cause):
    judge = {"path": str(tiny_dir), "malformed_score": None}
    eng = RewardEngine(RewardConfig(verifier_weight=0.0, judge=judge), task=_Task(), judge_ask=_judge(how))
    with pytest.raises(RewardError) as e:
        eng.score(PROMPTS, RESPONSES, ["1"] * 5)
    assert f"LLM judge {tiny_dir}{cause}, scoring the responses to prompt 'b'; fix the judge" in str(e.value)
    eng = RewardEngine(RewardConfig(verifier_weight=0.0, judge=judge, on_error="drop_group"), task=_Task(),
                       judge_ask=_judge(how))
    rewards, m = eng.score(PROMPTS, RESPONSES, ["1"] * 5)
    assert rewards[:2] == [1.0, 1.0] and math.isnan(rewards[2]) and math.isnan(rewards[3]) and rewards[4] == 1.0
    assert m["reward/errors"] == 2.0 and m["reward/judge_malformed"] == 0.0


class _HangsOnB:
    """A reward function that hangs on prompt 'b' until the test releases it (no sleep of a set length that a
    loaded machine could outlast or cut short: a hung call is still running whenever the test looks), counting
    the hung calls that ended."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ended = 0
        self._lock = threading.Lock()

    def score(self, prompts, responses, answers):
        if "b" in prompts:
            self.release.wait(120)  # (a guard: the test releases it)
            with self._lock:
                self.ended += 1
        return [float(len(r)) for r in responses]


@pytest.fixture
def hangs_on_b(monkeypatch):
    """``hanging_rewards:score`` hangs on prompt 'b' until released (at the latest when the test ends)."""
    fn = _HangsOnB()
    monkeypatch.setitem(sys.modules, "hanging_rewards", types.SimpleNamespace(score=fn.score))
    yield fn
    fn.release.set()


@pytest.mark.slow  # (calls waited out to reward.timeout_s, and their threads' end: over 2 s)
def test_a_reward_function_that_hangs_on_one_prompt_is_an_error_under_the_same_policy(hangs_on_b):
    cfg = dict(verifier="user", user_fn="hanging_rewards:score", timeout_s=0.3)
    threads = threading.active_count()
    with pytest.raises(RewardError) as e:
        RewardEngine(RewardConfig(**cfg)).score(PROMPTS, RESPONSES, [None] * 5)
    assert hangs_on_b.ended == 0  # the hung calls (the batch, then prompt 'b' alone) were not waited for
    assert ("reward function hanging_rewards:score ran past reward.timeout_s=0.3 (0.3 s for the 1 "
            "prompt(s) of the call), scoring the responses to prompt 'b'; fix the function") in str(e.value)
    rewards, m = RewardEngine(RewardConfig(**cfg, on_error="drop_group")).score(PROMPTS, RESPONSES, [None] * 5)
    assert rewards[:2] == [1.0, 2.0] and math.isnan(rewards[2]) and rewards[4] == 3.0 and m["reward/errors"] == 2.0
    assert hangs_on_b.ended == 0
    hangs_on_b.release.set()
    deadline = time.monotonic() + 30  # the abandoned calls end when the function returns: no thread is left
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == threads and hangs_on_b.ended == 4


def test_too_many_hung_calls_stop_the_run_whatever_the_policy(monkeypatch, hangs_on_b):
    import relayrl.engines.reward.engine as engine

    monkeypatch.setattr(engine, "MAX_ABANDONED", 2)
    eng = RewardEngine(RewardConfig(verifier="user", user_fn="hanging_rewards:score", timeout_s=0.1,
                                    on_error="drop_group"))
    for _ in range(2):  # two calls abandoned (one prompt per call: no second call per prompt)
        assert math.isnan(eng.score(["b"], ["y"], [None])[0][0])
    with pytest.raises(RewardError, match=r"2 calls of reward function .* are still running past "
                                          r"reward.timeout_s=0.1: it hangs"):
        eng.score(["a"], ["x"], [None])  # refused, even for a prompt it would score


def test_the_policy_and_the_time_limit_name_what_they_apply_to(tiny_dir):
    RewardConfig(model=str(tiny_dir), on_error="drop_group")  # a reward model: allowed
    RewardConfig(judge={"path": str(tiny_dir)}, on_error="drop_group")  # a judge: allowed
    with pytest.raises(ValueError, match=r"reward.on_error=drop_group applies to a reward function \(reward.verifier"
                                         r"=user\), a reward model \(reward.model\) or an LLM judge"):
        RewardConfig(verifier="exact", on_error="drop_group")
    with pytest.raises(ValueError, match="reward.timeout_s limits a reward function"):
        RewardConfig(verifier="math", timeout_s=5)


def test_a_remax_baseline_that_fails_stops_the_step_even_with_drop_group(monkeypatch, tiny_tokenizer):
    """ReMax's greedy baseline is due after the group's rewards: too late to drop the group, so a NaN baseline
    (a source failing under drop_group) is an error naming the prompt, not a NaN advantage."""
    import torch

    from relayrl.data.tasks import Problem
    from relayrl.workflows.scoring import ScoreWorker

    monkeypatch.setitem(sys.modules, "flaky_rewards", types.SimpleNamespace(
        score=lambda p, r, a: [math.nan if q == "b" else 1.0 for q in p]))  # (NaN: a contract breach)
    eng = RewardEngine(RewardConfig(verifier="user", user_fn="flaky_rewards:score", on_error="drop_group"))
    worker = ScoreWorker(eng, tiny_tokenizer, None, lambda scores, lengths: scores)

    class Reader:
        def read(self):
            return {"group": [0, 0, 1, 1], "baseline_ids": [torch.tensor([11, 12])] * 4}

    with pytest.raises(RewardError, match=r"the reward failed on the greedy baseline response to prompt 'b' "
                                          r"\(ReMax\): a group cannot be dropped once its baseline is due"):
        worker.baseline_into(Reader(), None, [Problem("a", "1"), Problem("b", "2")])
