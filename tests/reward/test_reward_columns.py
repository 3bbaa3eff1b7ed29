"""A user reward function gets a dataset row's other fields by keyword (as TRL passes a dataset's extra columns):
which fields it takes, the lists it receives, retries per prompt with the right rows, and the training and
evaluation paths that pass them."""

import json
import logging
import textwrap

import torch

from relayrl.data.tasks import Problem
from relayrl.engines.reward import RewardConfig, RewardEngine
from relayrl.engines.reward.user import column_kwargs, column_params
from relayrl.evaluation.runner import evaluate
from relayrl.engines.generation.base import Completion
from relayrl.workflows.scoring import ScoreWorker


def _engine(tmp_path, body: str, name: str = "colfns", **cfg) -> RewardEngine:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/{name}.py:f", **cfg))


def test_column_params_reads_what_a_function_takes():
    def three(prompts, responses, answers): ...
    def named(prompts, responses, answers, difficulty=None, *, source="x"): ...
    def every(prompts, responses, answers, **fields): ...
    def positional_only(prompts, responses, answers, level=0, /): ...

    assert column_params(three) == frozenset()
    assert column_params(named) == {"difficulty", "source"}
    assert column_params(every) is None
    assert column_params(positional_only) == frozenset()  # cannot be passed by keyword


def test_column_kwargs_lists_each_field_over_the_rows():
    rows = [{"difficulty": 1, "tag": "a"}, None, {"difficulty": 3, "prompts": "clash"}]
    assert column_kwargs(None, rows) == {"difficulty": [1, None, 3], "tag": ["a", None, None]}
    assert column_kwargs(frozenset({"tag"}), rows) == {"tag": ["a", None, None]}
    assert column_kwargs(frozenset(), rows) == {}


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
    seen = every._user_fn.__globals__["SEEN"]
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
    problems = [Problem("p0", "a", {"extra": {"target": 2}}), Problem("p1", "b", {"extra": {"target": 3}})]
    worker = ScoreWorker(e, _Tok(), None, lambda scores, lengths: scores)
    cols = {"group": [0, 0, 1, 1], "response_ids": [torch.ones(2), torch.ones(3), torch.ones(3), torch.ones(1)]}
    out = worker.score_rows(_Reader(cols), problems)
    assert out.scores == [1.0, 0.0, 1.0, 0.0]


def test_evaluation_passes_each_problems_fields(tmp_path):
    e = _engine(tmp_path, """
        def f(prompts, responses, answers, **fields):
            return [float(w) for w in fields["weight"]]
    """)
    problems = [Problem("p0", "a", {"extra": {"weight": 1}}), Problem("p1", "b", {"extra": {"weight": 0}})]

    def generate(prompts, params):
        return [Completion(i, s, torch.tensor([0]), torch.tensor([0.0]), "stop", 0, "r")
                for i in range(len(prompts)) for s in range(params.n)]

    res = evaluate(generate, lambda p: [1], problems, lambda a, b, c, d: e.verify(a, b, c, d), max_new_tokens=2, k=3)
    assert res.metrics["eval/accuracy"] == 0.5 and res.metrics["eval/pass@3"] == 0.5
    assert [s["reward"] for s in res.samples] == [1.0, 0.0] + [1.0] * 3 + [0.0] * 3
