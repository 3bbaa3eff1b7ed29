"""TRL's ``log_extra``: a reward function's per-completion columns stay with their own rows (per-prompt retries,
several functions, the rows the samples keep) and reach ``RUN_DIR/samples.jsonl``; a breach stops the run."""

import json
import textwrap

import pytest
import torch

from relayrl.data.tasks import Problem
from relayrl.engines.reward import RewardConfig, RewardEngine, RewardError
from relayrl.engines.reward.extra import ExtraLog, sample_fields
from relayrl.engines.reward.user import call_shape
from relayrl.telemetry import TelemetryConfig, Tracker
from relayrl.workflows.scoring import ScoreWorker

FNS = """
    import numpy as np
    def echo(prompts, completions, log_extra, **kwargs):  # TRL's shape: the text it scored, per row
        log_extra("echo", list(completions))
        log_extra("n", np.array([len(c) for c in completions]))
        return [float(len(c)) for c in completions]

    def picky(prompts, completions, log_extra=None, **kwargs):  # fails on a call with several prompts
        log_extra("echo", ["stale"] * len(completions))  # (a failed call's values are kept nowhere)
        if len(set(prompts)) > 1:
            raise ValueError("one prompt at a time")
        log_extra("echo", [c + "!" for c in completions])  # (logged again: the last values)
        return [1.0] * len(completions)

    def second(completions, log_extra, **kwargs):
        log_extra("echo", [c.upper() for c in completions])  # (a column an earlier function logged: last wins)
        log_extra("prompt", ["mine"] * len(completions))  # (a sample's own field: written as extra_prompt)
        log_extra("judge", [{"why": c, "ok": True, "p": float("nan")} for c in completions])
        return [0.0] * len(completions)

    def short(completions, log_extra, **kwargs):
        log_extra("answer", completions[:-1])
        return [1.0] * len(completions)

    def objects(completions, log_extra, **kwargs):
        log_extra("answer", [object() for _ in completions])
        return [1.0] * len(completions)

    def swallows(completions, log_extra, **kwargs):
        try:
            log_extra("answer", "not a list")
        except Exception:
            pass
        return [1.0] * len(completions)

    def needs(prompts, completions, log_extra):  # no default, no **kwargs
        log_extra("k", [1] * len(completions))
        return [1.0] * len(completions)

    def no_logger(prompts, completions):  # takes neither log_extra nor **kwargs: not given it
        return [1.0] * len(completions)

    def relayrl_shape(prompts, responses, answers, **fields):  # relayrl's shape: fields only
        assert "log_extra" not in fields
        return [1.0] * len(responses)
"""


def _engine(tmp_path, *names, **cfg) -> RewardEngine:
    (tmp_path / "extra_fns.py").write_text(textwrap.dedent(FNS))
    fns = [f"{tmp_path}/extra_fns.py:{n}" for n in names]
    return RewardEngine(RewardConfig(verifier="user", user_fn=fns if len(fns) > 1 else fns[0], **cfg))


def _extras(e: RewardEngine, prompts, responses, keep=None) -> list[dict]:
    log = ExtraLog(len(responses) if keep is None else keep)
    e.score_each(prompts, responses, [None] * len(responses), extra=log)
    return log.rows(len(responses))


def test_a_trl_function_gets_log_extra_and_its_values_come_back_per_row_in_order(tmp_path):
    e = _engine(tmp_path, "echo")
    assert call_shape(e._user[0].fn).required == frozenset()  # log_extra is no dataset field
    responses = ["a", "bbb", "cc"]
    assert _extras(e, ["p", "q", "p"], responses) == [{"echo": r, "n": len(r)} for r in responses]
    assert _extras(e, ["p", "q", "p"], responses, keep=2) == [{"echo": "a", "n": 1}, {"echo": "bbb", "n": 3}]
    scores, _, _ = e.score_each(["p"], ["xy"], [None])  # no log: checked, kept nowhere
    assert scores == [2.0]


def test_per_prompt_retries_keep_each_value_with_its_own_row(tmp_path):
    """The batch call fails (its values dropped); the calls per prompt, on rows 0, 2 and 1, 3, log theirs."""
    e = _engine(tmp_path, "picky", on_error="drop_group")  # (fail: a batch no prompt alone fails on raises)
    assert _extras(e, ["p", "q", "p", "q"], ["r0", "r1", "r2", "r3"]) == [{"echo": f"r{i}!"} for i in range(4)]


def test_several_functions_merge_their_columns_the_last_one_wins_a_clash(tmp_path):
    e = _engine(tmp_path, "echo", "second")
    rows = _extras(e, ["p", "p"], ["ab", "c"])
    assert rows == [{"echo": "AB", "n": 2, "prompt": "mine", "judge": {"why": "ab", "ok": True, "p": None}},
                    {"echo": "C", "n": 1, "prompt": "mine", "judge": {"why": "c", "ok": True, "p": None}}]
    assert sample_fields(rows[0]) == {"echo": "AB", "n": 2, "extra_prompt": "mine", "judge": rows[0]["judge"]}


@pytest.mark.parametrize("name,why", [("short", "1 values for the 2 completions"), ("objects", "is a object"),
                                      ("swallows", "values is a str")])
def test_a_breach_stops_the_run_naming_the_function_and_the_column(tmp_path, name, why):
    e = _engine(tmp_path, name, on_error="drop_group")  # (not a row's fault: no group is dropped for it)
    for log in (ExtraLog(2), None):  # the same with samples off
        with pytest.raises(RewardError) as err:
            e.score_each(["p", "q"], ["ab", "c"], [None, None], extra=log)
        msg = str(err.value)
        assert f"extra_fns.py:{name}" in msg and "log_extra('answer'" in msg and why in msg


def test_log_extra_goes_only_to_the_trl_functions_that_take_it(tmp_path):
    for name in ("no_logger", "relayrl_shape"):
        e = _engine(tmp_path, name)
        assert _extras(e, ["p"], ["a"]) == [{}]

    e = _engine(tmp_path, "needs")  # (loads: log_extra is no dataset field, and is given)
    assert call_shape(e._user[0].fn).required == frozenset() and _extras(e, ["p", "p"], ["a", "b"]) == [{"k": 1}] * 2


def test_the_score_worker_returns_the_first_rows_extras_only_when_asked(tmp_path):
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    class Reader:
        def read(self):
            return {"group": [0, 0, 0], "response_ids": [torch.ones(1), torch.ones(3), torch.ones(2)]}

    worker = ScoreWorker(_engine(tmp_path, "echo"), Tok(), None, lambda scores, lengths: scores)
    out = worker.score_rows(Reader(), [Problem("p0", "a")], None, 2)
    assert out.extra == [{"echo": "x", "n": 1}, {"echo": "xxx", "n": 3}]
    assert worker.score_rows(Reader(), [Problem("p0", "a")]).extra is None


def test_the_samples_share_their_steps_columns_null_where_a_row_lacks_one(tmp_path):
    with Tracker(tmp_path, TelemetryConfig(sinks=[], samples_per_step=2), total_steps=1) as t:
        t.log_samples(1, [{"response": "a", "echo": "a"}, {"response": "b"}])
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "response": "a", "echo": "a"}, {"step": 1, "response": "b", "echo": None}]


VERL_FNS = """
    class Opaque:
        def __repr__(self):
            return "<Opaque>"

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's shape, one response
        ok = solution_str == ground_truth
        out = {"score": float(ok), "acc": ok, "pred": solution_str.strip(), "obj": Opaque()}
        if ok:
            out["why"] = {"matched": ground_truth}  # (a key some rows lack: null in the others)
        return out
"""


def test_a_verl_dicts_extras_are_metrics_and_sample_columns_and_an_unjsonable_one_is_said_once(tmp_path, caplog):
    """verl keeps every key of a compute_score's dict (its reward_extra_info) with the sample it dumps; relayrl
    logged the numbers as metrics and dropped "pred" and the rest without a word."""
    from relayrl.engines.reward import user

    (tmp_path / "verl_extra_fns.py").write_text(textwrap.dedent(VERL_FNS))
    e = RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path}/verl_extra_fns.py:compute_score"))
    getattr(user, "_dropped", set()).clear()  # (said once per run: a fresh run here)
    with caplog.at_level("WARNING", logger="relayrl.engines.reward.user"):
        for _ in range(2):
            log = ExtraLog(2)
            scores, m, _ = e.score_each(["p", "q"], ["4 ", "5"], ["4 ", "7"], extra=log)
    assert scores == [1.0, 0.0] and m["reward/user/acc"] == 0.5 and "reward/user/pred" not in m
    rows = log.rows(2)
    assert rows == [{"acc": True, "pred": "4", "why": {"matched": "4 "}}, {"acc": False, "pred": "5", "why": None}]
    said = [r.getMessage() for r in caplog.records if "obj" in r.getMessage()]
    assert len(said) == 1 and "verl_extra_fns.py:compute_score" in said[0] and "Opaque" in said[0] and "str(value)" in said[0]
