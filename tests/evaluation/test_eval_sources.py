"""Several held-out sources: each row's source name (its data_source field, else its file's stem) and every eval
metric computed again per source as ``eval/<metric>/<source>``, checked by hand on fixed completions."""

import json

import pytest
import torch

from relayrl.data.tasks import ArithmeticTask, Problem
from relayrl.engines.generation.base import Completion
from relayrl.evaluation.metrics import per_source, source_names
from relayrl.evaluation.runner import evaluate, write_report


def _problem(i: int, source: str, **fields) -> Problem:
    return Problem(f"{i}+{i}=", str(2 * i), {"row": i, "source": source, "fields": {"answer": str(2 * i), **fields}})


# source a (3 rows): every greedy answer right; source b (2 rows): none right
PROBLEMS = [_problem(1, "d/a.jsonl"), _problem(2, "d/a.jsonl"), _problem(3, "d/a.jsonl"),
            _problem(4, "d/b.jsonl"), _problem(5, "d/b.jsonl")]
GREEDY = ["2", "4", "6", "0", "0"]
SAMPLED = [["2", "0"], ["0", "0"], ["6", "6"], ["8", "0"], ["0", "0"]]  # per row: 1/2, 0/2, 2/2, 1/2, 0/2 right


def fake_generate(prompts, params):
    texts = [[g] for g in GREEDY] if params.n == 1 else SAMPLED
    return [Completion(i, s, torch.tensor([0]), torch.tensor([0.0]), "stop", 0, texts[i][s])
            for i in range(len(prompts)) for s in range(params.n)]


def score(prompts, responses, answers, columns, extra):
    return [ArithmeticTask().verify(r, a) for r, a in zip(responses, answers)]


def test_every_metric_is_also_reported_per_source(tmp_path):
    res = evaluate(fake_generate, lambda p: [1, 2], PROBLEMS, score, max_new_tokens=4)
    assert res.metrics == pytest.approx({"eval/accuracy": 0.6, "eval/reward_mean": 0.6,
                                         "eval/accuracy/a": 1.0, "eval/reward_mean/a": 1.0,
                                         "eval/accuracy/b": 0.0, "eval/reward_mean/b": 0.0})
    assert list(res.metrics)[:2] == ["eval/accuracy", "eval/reward_mean"]  # the overall ones first
    assert [s["source"] for s in res.samples] == ["a", "a", "a", "b", "b"]
    report, _ = write_report(res, tmp_path)
    assert json.loads(report.read_text())["metrics"]["eval/accuracy/b"] == 0.0


def test_pass_at_k_per_source():
    m = evaluate(fake_generate, lambda p: [1, 2], PROBLEMS, score, max_new_tokens=4, k=2).metrics
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0 + 1 + 0.5 + 0) / 5)
    assert m["eval/pass@1/a"] == pytest.approx(0.5)
    assert m["eval/pass@1/b"] == pytest.approx(0.25)
    assert m["eval/pass@2/a"] == pytest.approx(2 / 3)
    assert m["eval/pass@2/b"] == pytest.approx(0.5)
    assert m["eval/avg@2/b"] == pytest.approx(0.25)


def test_one_source_adds_no_keys():
    one = [_problem(i, "d/a.jsonl") for i in range(1, 6)]
    m = evaluate(fake_generate, lambda p: [1, 2], one, score, max_new_tokens=4).metrics
    assert set(m) == {"eval/accuracy", "eval/reward_mean"}
    plain = [Problem(f"{i}+{i}=", str(2 * i)) for i in range(1, 6)]  # a built-in task's: no source at all
    assert set(evaluate(fake_generate, lambda p: [1], plain, score, max_new_tokens=4).metrics) == set(m)


def test_the_data_source_field_names_a_row_before_its_file():
    rows = [_problem(1, "x/test.parquet", data_source="openai/gsm8k"), _problem(2, "x/test.parquet"),
            _problem(3, "x/test.parquet", data_source="math500")]
    assert source_names([p.meta for p in rows]) == ["openai/gsm8k", "test", "math500"]


def test_colliding_stems_take_their_directory():
    metas = [{"source": "data/gsm8k/test.parquet"}, {"source": "data/math500/test.parquet"},
             {"source": "other.jsonl"}, {"source": "a/same/x.jsonl"}, {"source": "b/same/x.jsonl"}]
    assert source_names(metas) == ["gsm8k/test", "math500/test", "other", "a/same/x.jsonl", "b/same/x.jsonl"]


def test_per_source_groups_rows_by_name():
    correct = [1, 1, 1, 0, 0]
    got = per_source(["a", "a", "b", "b", "a"],
                     lambda rows: {"eval/accuracy": sum(correct[i] for i in rows) / len(rows)})
    assert got == pytest.approx({"eval/accuracy/a": 2 / 3, "eval/accuracy/b": 0.5})
    assert per_source(["a"] * 3, lambda rows: {"eval/accuracy": 1.0}) == {}


def test_per_source_keys_plot_beside_the_overall_ones():
    pytest.importorskip("matplotlib")
    from relayrl.telemetry.plots import group_families

    families = {f.filename: keys for f, keys in group_families(["eval/accuracy", "eval/accuracy/gsm8k",
                                                                 "eval/pass@4/math500"])}
    assert families == {"reward_accuracy.png": ["eval/accuracy", "eval/accuracy/gsm8k", "eval/pass@4/math500"]}
