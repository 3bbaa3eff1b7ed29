"""A user reward function gets a dataset row's other fields by keyword (as TRL passes a dataset's extra columns):
which fields it takes, the lists it receives, retries per prompt with the right rows, and the training and
evaluation paths that pass them."""

import json
import logging
import textwrap

import pytest
import torch

from relayrl.data.tasks import Problem
from relayrl.engines.reward import RewardConfig, RewardEngine, RewardError
from relayrl.engines.reward.user import call_shape
from relayrl.evaluation.runner import evaluate
from relayrl.engines.generation.base import Completion
from relayrl.workflows.scoring import ScoreWorker


def _engine(tmp_path, body: str, name: str = "colfns", **cfg) -> RewardEngine:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/{name}.py:f", **cfg))


def test_call_shape_reads_what_a_function_takes():
    def three(prompts, responses, answers): ...
    def named(prompts, responses, answers, difficulty=None, *, source="x"): ...
    def every(prompts, responses, answers, **fields): ...
    def positional_only(prompts, responses, answers, level=0, /): ...
    def trl(completions, solution, **kwargs): ...
    def trl_named(prompts, completions, ground_truth, weight=1.0): ...

    def verl(data_source, solution_str, ground_truth, extra_info=None): ...
    def verl_batch(data_sources, solution_strs, ground_truths, **kwargs): ...

    assert call_shape(three) == ("relayrl", frozenset(), frozenset())
    assert call_shape(named) == ("relayrl", {"difficulty", "source"}, frozenset())
    assert call_shape(every) == ("relayrl", None, frozenset())
    assert call_shape(positional_only) == ("relayrl", frozenset(), frozenset())  # cannot be passed by keyword
    assert call_shape(trl) == ("trl", None, {"solution"})
    assert call_shape(trl_named) == ("trl", {"ground_truth", "weight"}, {"ground_truth"})
    assert call_shape(verl) == ("verl", {"data_source", "solution_str", "ground_truth", "extra_info"}, frozenset())
    assert call_shape(verl_batch) == ("verl_batch", None, frozenset())


def test_arguments_list_each_field_over_the_rows():
    rows = [{"prompt": "p?", "difficulty": 1, "tag": "a"}, None, {"difficulty": 3, "prompts": "clash"}]
    args, kwargs = call_shape(lambda prompts, responses, answers, **k: 0).arguments(["p", "q", "r"], ["x"] * 3,
                                                                                   ["a"] * 3, rows)
    assert args == (["p", "q", "r"], ["x"] * 3, ["a"] * 3)
    assert kwargs == {"difficulty": [1, None, 3], "tag": ["a", None, None]}  # not the prompt, nor a list's name
    assert call_shape(lambda prompts, responses, answers, tag=None: 0).arguments(["p"] * 3, ["x"] * 3, ["a"] * 3,
                                                                                  rows)[1] == {"tag": ["a", None, None]}
    # TRL's shape: by keyword, the prompt as the dataset had it (messages: chat completions)
    chat = [{"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2"}, {"prompt": "2+2?", "solution": "4"}]
    args, kwargs = call_shape(lambda completions, **k: 0).arguments(["t1", "t2"], ["2", "5"], ["2", "4"], chat)
    assert args == ()
    assert kwargs == {"prompts": [[{"role": "user", "content": "1+1?"}], "2+2?"],
                      "completions": [[{"role": "assistant", "content": "2"}], "5"], "solution": ["2", "4"]}


def test_a_function_gets_the_fields_it_names_and_one_with_kwargs_gets_all(tmp_path):
    named = _engine(tmp_path, """
        def f(prompts, responses, answers, weight=None):
            return [float(w) for w in weight]
    """)
    cols = [{"weight": 0.5, "other": "x"}, {"weight": 2, "other": "y"}]
    assert named.score(["p", "q"], ["r", "s"], ["a", "b"], columns=cols)[0] == [0.5, 2.0]
    assert named.verify(["p", "q"], ["r", "s"], ["a", "b"], cols) == [0.5, 2.0]  # evaluation's score
    every = _engine(tmp_path, """
        SEEN = []
        def f(prompts, responses, answers, **fields):
            SEEN.append(fields)
            return [0.0] * len(responses)
    """, name="colfns_every")
    every.score(["p", "q"], ["r", "s"], ["a", "b"], columns=[{"weight": 1, "other": "x"}, None])
    seen = every._user[0].fn.__globals__["SEEN"]
    assert seen == [{"weight": [1, None], "other": ["x", None]}]
    every.score(["p"], ["r"], ["a"])  # no columns given: the three lists only
    assert seen[-1] == {}


def test_a_field_the_function_names_that_no_row_has_is_warned_once(tmp_path, caplog):
    e = _engine(tmp_path, """
        def f(prompts, responses, answers, difficulty=7):
            return [float(difficulty)] * len(responses)
    """)
    with caplog.at_level(logging.WARNING, "relayrl.engines.reward.engine"):
        assert e.score(["p"], ["r"], ["a"], columns=[{"level": 1}])[0] == [7.0]
        e.score(["p"], ["r"], ["a"], columns=[{"level": 1}])
    warned = [r.getMessage() for r in caplog.records if "difficulty" in r.getMessage()]
    assert len(warned) == 1 and "no such field" in warned[0] and "level" in warned[0]


def test_the_retry_per_prompt_passes_each_prompts_own_fields(tmp_path):
    """A batch call that fails is made again per prompt: each call gets its rows' fields, not the batch's."""
    e = _engine(tmp_path, """
        def f(prompts, responses, answers, bad=None):
            if any(bad):
                raise ValueError("a bad row")
            return [float(len(prompts))] * len(responses)
    """, on_error="drop_group")
    rewards, metrics = e.score(["p", "p", "q", "q"], ["r"] * 4, ["a"] * 4,
                               columns=[{"bad": False}, {"bad": False}, {"bad": True}, {"bad": False}])
    assert rewards[:2] == [2.0, 2.0] and all(r != r for r in rewards[2:])  # q's group dropped, p's scored alone
    assert metrics["reward/errors"] == 2.0


class _Reader:
    def __init__(self, cols):
        self.cols = cols

    def read(self):
        return self.cols


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def test_the_score_stage_passes_each_rows_problem_fields(tmp_path):
    e = _engine(tmp_path, """
        def f(prompts, responses, answers, target=None):
            return [float(len(r) == t) for r, t in zip(responses, target)]
    """)
    problems = [Problem("p0", "a", {"fields": {"target": 2}}), Problem("p1", "b", {"fields": {"target": 3}})]
    worker = ScoreWorker(e, _Tok(), None, lambda scores, lengths: scores)
    cols = {"group": [0, 0, 1, 1], "response_ids": [torch.ones(2), torch.ones(3), torch.ones(3), torch.ones(1)]}
    out = worker.score_rows(_Reader(cols), problems)
    assert out.scores == [1.0, 0.0, 1.0, 0.0]


def test_evaluation_passes_each_problems_fields(tmp_path):
    e = _engine(tmp_path, """
        def f(prompts, responses, answers, **fields):
            return [float(w) for w in fields["weight"]]
    """)
    problems = [Problem("p0", "a", {"fields": {"weight": 1}}), Problem("p1", "b", {"fields": {"weight": 0}})]

    def generate(prompts, params):
        return [Completion(i, s, torch.tensor([0]), torch.tensor([0.0]), "stop", 0, "r")
                for i in range(len(prompts)) for s in range(params.n)]

    res = evaluate(generate, lambda p: [1], problems, lambda a, b, c, d, x: e.verify(a, b, c, d, x),
                   max_new_tokens=2, k=3)
    assert res.metrics["eval/accuracy"] == 0.5 and res.metrics["eval/pass@3"] == 0.5
    assert [s["reward"] for s in res.samples] == [1.0, 0.0] + [1.0] * 3 + [0.0] * 3


TRL_FNS = """
    import re

    def accuracy_reward(completions, solution, **kwargs):  # as written for TRL's GRPOTrainer
        contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(c.strip() == str(s)) for c, s in zip(contents, solution)]

    def needs_level(prompts, completions, level, **kwargs):
        return [float(l) for l in level]
"""


def test_a_function_written_for_trl_scores_unchanged(tmp_path):
    (tmp_path / "trl_fns.py").write_text(textwrap.dedent(TRL_FNS))
    e = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/trl_fns.py:accuracy_reward"))
    fields = [{"prompt": [{"role": "user", "content": "1+1?"}], "solution": 2}, {"prompt": "2+2?", "solution": "4"}]
    assert e.score(["t1", "t2"], ["2", "5"], ["2", "4"], columns=fields)[0] == [1.0, 0.0]


def test_a_field_a_trl_function_needs_is_checked_before_the_run(tmp_path):
    (tmp_path / "trl_fns2.py").write_text(textwrap.dedent(TRL_FNS))
    e = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/trl_fns2.py:needs_level",
                                  on_error="drop_group"))
    e.check_fields([{"prompt": "p", "level": 2}])
    with pytest.raises(RewardError, match=r"needs the dataset field\(s\) level, which the rows lack \(fields: "
                                          r"prompt, answer\)"):
        e.check_fields([{"prompt": "p", "answer": "1"}])
    with pytest.raises(RewardError, match="none: a built-in task's rows"):
        e.check_fields([None])
    with pytest.raises(RewardError, match="needs the dataset field"):  # in a call too, whatever on_error says
        e.score(["p"], ["r"], ["a"], columns=[{"prompt": "p"}])


SEVERAL = """
    def fmt(prompts, responses, answers):
        return [float(r.endswith("!")) for r in responses]

    def accuracy(completions, answer, **kwargs):
        return [float(c.rstrip("!") == a) for c, a in zip(completions, answer)]

    def flaky(prompts, responses, answers):
        if "bad" in prompts:
            raise ValueError("no")
        return [1.0] * len(responses)
"""


def test_several_functions_score_their_weighted_sum_each_logged(tmp_path):
    (tmp_path / "several.py").write_text(textwrap.dedent(SEVERAL))
    fns = [f"{tmp_path}/several.py:fmt", f"{tmp_path}/several.py:accuracy"]
    e = RewardEngine(RewardConfig(verifier="user", user_fn=fns, user_weights=[0.5, 2.0]))
    fields = [{"prompt": "p", "answer": "4"}] * 3
    rewards, m = e.score(["p"] * 3, ["4!", "4", "5!"], ["4"] * 3, columns=fields)
    assert rewards == [2.5, 2.0, 0.5]
    assert m["reward/fn/fmt_mean"] == 2 / 3 and m["reward/fn/accuracy_mean"] == 2 / 3
    assert m["reward/verifier_mean"] == 5 / 3 and m["reward/verifier_accuracy"] == 2 / 3
    assert e.verify(["p"] * 3, ["4!", "4", "5!"], ["4"] * 3, fields) == [2.5, 2.0, 0.5]
    one = RewardEngine(RewardConfig(verifier="user", user_fn=fns[:1]))  # a list of one: no per-function keys
    assert not any(k.startswith("reward/fn/") for k in one.score(["p"], ["x!"], ["4"])[1])


def test_one_function_failing_on_a_prompt_drops_its_group_whatever_the_others_say(tmp_path):
    (tmp_path / "several2.py").write_text(textwrap.dedent(SEVERAL))
    fns = [f"{tmp_path}/several2.py:fmt", f"{tmp_path}/several2.py:flaky"]
    e = RewardEngine(RewardConfig(verifier="user", user_fn=fns, on_error="drop_group"))
    rewards, m = e.score(["ok", "ok", "bad", "bad"], ["a!", "b", "c!", "d"], ["x"] * 4)
    assert rewards[:2] == [2.0, 1.0] and all(r != r for r in rewards[2:]) and m["reward/errors"] == 2.0
    assert m["reward/fn/flaky_mean"] == 1.0 and m["reward/fn/fmt_mean"] == 0.5


def test_a_list_of_functions_is_checked_when_the_config_loads(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="2 weight\\(s\\) for 1 function"):
        RewardConfig(verifier="user", user_fn=["a.b:f"], user_weights=[1, 2])
    with pytest.raises(ValidationError, match="names a function twice"):
        RewardConfig(verifier="user", user_fn=["a.b:f", "a.b:f"])
    with pytest.raises(ValidationError, match="names no function"):
        RewardConfig(verifier="user", user_fn=[])
    with pytest.raises(ValidationError, match="finite"):
        RewardConfig(verifier="user", user_fn=["a.b:f"], user_weights=[float("nan")])
    assert RewardConfig(verifier="user", user_fn="a.b:f").user_fns == ["a.b:f"]


VERL_FNS = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's shape, per response
        bonus = (extra_info or {}).get("bonus", 0.0)
        if data_source == "dict":
            return {"score": float(solution_str == ground_truth) + bonus, "acc": 1}
        return float(solution_str == ground_truth) + bonus

    def batched(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(s == g) for s, g in zip(solution_strs, ground_truths)]

    def no_score(solution_str, ground_truth):
        return {"acc": 1.0}
"""


def test_a_compute_score_written_for_verl_scores_unchanged(tmp_path):
    (tmp_path / "verl_fns.py").write_text(textwrap.dedent(VERL_FNS))
    path = f"{tmp_path}/verl_fns.py"
    fields = [{"prompt": "p", "data_source": "gsm8k", "extra_info": {"bonus": 0.5}},
              {"prompt": "q", "data_source": "dict"}, None]
    e = RewardEngine(RewardConfig(verifier="user", user_fn=f"{path}:compute_score"))
    assert e.score(["p", "q", "r"], ["4", "5", "6"], ["4", "5", "7"], columns=fields)[0] == [1.5, 1.0, 0.0]
    b = RewardEngine(RewardConfig(verifier="user", user_fn=f"{path}:batched"))
    assert b.score(["p", "q", "r"], ["4", "5", "6"], ["4", "5", "7"], columns=fields)[0] == [1.0, 1.0, 0.0]
    bad = RewardEngine(RewardConfig(verifier="user", user_fn=f"{path}:no_score"))
    with pytest.raises(RewardError, match=r"no_score returned a dict without a 'score' key at index 0 \(\['acc'\]\)"):
        bad.score(["p"], ["4"], ["4"])


ASYNC_FNS = """
    import asyncio
    import os

    EVENTS = os.path.join(os.path.dirname(__file__), "events.log")

    def _note(what):
        with open(EVENTS, "a") as f:
            f.write(what + "\\n")

    async def per_response(data_source, solution_str, ground_truth, extra_info=None):  # verl's, async
        _note("start")
        await asyncio.sleep(0.05)
        _note("end")
        return float(solution_str == ground_truth)

    async def trl_async(completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]
"""


def test_async_reward_functions_are_awaited_verls_per_response_calls_together(tmp_path):
    (tmp_path / "async_fns.py").write_text(textwrap.dedent(ASYNC_FNS))
    e = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/async_fns.py:per_response", timeout_s=60))
    assert e.score(["p"] * 8, ["4"] * 4 + ["5"] * 4, ["4"] * 8)[0] == [1.0] * 4 + [0.0] * 4
    # eight calls at once: all started before any ended (one after another: start, end, start, end, ...)
    assert (tmp_path / "events.log").read_text().split() == ["start"] * 8 + ["end"] * 8
    t = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/async_fns.py:trl_async"))
    assert t.score(["p", "q"], ["ab", "c"], ["x", "y"])[0] == [2.0, 1.0]


NONE_FNS = """
    def math_only(completions, task, **kwargs):  # TRL: None for the rows that are not this function's
        return [float(c == "4") if t == "math" else None for c, t in zip(completions, task)]

    def code_only(completions, task, **kwargs):
        return [float("def" in c) if t == "code" else None for c, t in zip(completions, task)]
"""


def test_a_function_returning_none_for_a_row_adds_nothing_to_it_as_in_trl(tmp_path, caplog):
    (tmp_path / "none_fns.py").write_text(textwrap.dedent(NONE_FNS))
    path = f"{tmp_path}/none_fns.py"
    e = RewardEngine(RewardConfig(verifier="user", user_fn=[f"{path}:math_only", f"{path}:code_only"]))
    fields = [{"task": "math"}, {"task": "code"}, {"task": "code"}, {"task": "poem"}]
    with caplog.at_level(logging.WARNING, "relayrl.engines.reward.engine"):
        rewards, m = e.score(["p", "q", "r", "s"], ["4", "def f", "x", "roses"], ["4"] * 4, columns=fields)
    assert rewards == [1.0, 1.0, 0.0, 0.0]
    assert m["reward/fn/math_only_mean"] == 1.0 and m["reward/fn/code_only_mean"] == 0.5  # over its own rows
    assert [r.getMessage() for r in caplog.records if "no score" in r.getMessage()] == [
        "reward: 1 of 4 rows have no score: every reward function returned None for them (first: prompt 's'); "
        "they score 0 (said once)"]


def test_a_trl_function_gets_the_completion_ids_where_the_caller_has_them(tmp_path):
    (tmp_path / "ids_fns.py").write_text("def shorter(completion_ids, **kwargs):\n"
                                         "    return [-len(ids) / 10 for ids in completion_ids]\n")
    e = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/ids_fns.py:shorter"))
    assert call_shape(e._user[0].fn).style == "trl"  # (no completions parameter: TRL's shape by completion_ids)
    e.check_fields([None])  # token ids are the caller's, not a dataset field: nothing to check before the run
    from relayrl.engines.reward.user import with_ids

    cols = with_ids([{"prompt": "p"}, None], [torch.tensor([1, 2, 3]), [4]])
    assert cols[1] == {"completion_ids": [4]}
    assert e.score(["p", "q"], ["abc", "d"], ["x", "y"], columns=cols)[0] == [-0.3, -0.1]
    with pytest.raises(RewardError, match="missing 1 required keyword-only argument|missing a required argument|"
                                          "completion_ids"):
        e.score(["p"], ["abc"], ["x"])  # a caller without token ids (the tools environment's final answer)


PROGRESS_FNS = """
    def curriculum(completions, trainer_state, log_metric, **kwargs):  # TRL: reward shaped by training progress
        frac = trainer_state.global_step / trainer_state.max_steps
        log_metric("progress", frac)
        log_metric("long_frac", sum(len(c) > 2 for c in completions) / len(completions))
        return [frac * len(c) for c in completions]

    def uses_kwargs(completions, **kwargs):
        kwargs["log_metric"]("seen_step", kwargs["trainer_state"].global_step)
        return [1.0] * len(completions)

    def verl_extras(data_source, solution_str, ground_truth, extra_info=None):
        ok = solution_str == ground_truth  # (verl's DAPO scorer: acc a bool, which was not logged)
        return {"score": float(ok), "acc": ok, "pred": solution_str}  # (a string: not a metric)
"""


def test_a_trl_function_gets_the_trainer_state_and_logs_metrics_verl_extras_too(tmp_path):
    from relayrl.engines.reward.user import trainer_state, with_progress

    (tmp_path / "progress_fns.py").write_text(textwrap.dedent(PROGRESS_FNS))
    e = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/progress_fns.py:curriculum"))
    assert call_shape(e._user[0].fn).required == frozenset()  # neither is a dataset field
    e.check_fields([{"prompt": "p"}])
    cols = with_progress([{"prompt": "p"}, None], trainer_state(5, 10))
    scores, m = e.score(["p", "q"], ["abcd", "d"], ["x", "y"], columns=cols)
    assert scores == [2.0, 0.5]
    assert m["reward/user/progress"] == 0.5 and m["reward/user/long_frac"] == 0.5
    kw = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/progress_fns.py:uses_kwargs"))
    assert kw.score(["p"], ["a"], ["x"], columns=with_progress([None], trainer_state(3, 9)))[1]["reward/user/seen_step"] == 3
    verl = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/progress_fns.py:verl_extras"))
    scores, m = verl.score(["p", "q"], ["4", "5"], ["4", "7"])
    assert scores == [1.0, 0.0] and m["reward/user/acc"] == 0.5 and "reward/user/pred" not in m


def test_the_score_stage_passes_the_steps_done(tmp_path):
    from relayrl.engines.reward.user import trainer_state

    (tmp_path / "progress_fns.py").write_text(textwrap.dedent(PROGRESS_FNS))
    e = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/progress_fns.py:uses_kwargs"))
    worker = ScoreWorker(e, _Tok(), None, lambda scores, lengths: scores)
    cols = {"group": [0, 0], "response_ids": [torch.ones(2), torch.ones(3)]}
    out = worker.score_rows(_Reader(cols), [Problem("p0", "a")], trainer_state(4, 8))
    assert out.metrics["reward/user/seen_step"] == 4


@pytest.mark.slow
def test_a_run_gives_trl_functions_its_progress_and_logs_what_they_report(tmp_path, tiny_dir):
    """Two steps: the function sees global_step 0 then 1 of max_steps 2 (its progress metric 0, then 0.5)."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.pipeline import GRPOPipeline

    (tmp_path / "progress_fns.py").write_text(textwrap.dedent(PROGRESS_FNS))
    cfg = load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={tmp_path / 'run'}", "trainer.steps=2", "eval.size=4", "eval.every=0", "data.prompts_per_step=2",
        "rollout.n=4", "rollout.max_new_tokens=8", "telemetry.sinks=[jsonl]", "run.save_every=0",
        f"trainer.init_from={tiny_dir}", "reward.verifier=user", f"reward.user_fn={tmp_path}/progress_fns.py:curriculum"])
    GRPOPipeline(cfg).run()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r.get("reward/user/progress") for r in recs if r["step"] > 0] == [0.0, 0.5]


def test_a_function_that_needs_the_trainer_state_is_refused_outside_a_training_run(tmp_path):
    """(relayrl eval called it without one and it raised a TypeError part-way through the held-out set.)"""
    (tmp_path / "state_fns.py").write_text(textwrap.dedent("""
        def needs(completions, trainer_state, **kwargs):
            return [float(trainer_state.global_step)] * len(completions)

        def optional(completions, trainer_state=None, **kwargs):
            return [0.0 if trainer_state is None else 1.0] * len(completions)
    """))
    needs = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/state_fns.py:needs"))
    with pytest.raises(RewardError, match=r"state_fns.py:needs needs trainer_state, which relayrl eval cannot give"):
        needs.check_standalone()
    RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/state_fns.py:optional")).check_standalone()
