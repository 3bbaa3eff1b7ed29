"""What a user reward function gets as the ground truth of rows read for it (``raw_answers``): a verl
``compute_score`` (per response and batched) the value the file holds (a dict, an int) as verl passes it;
relayrl's own shape the answer's text, as before; a TRL function the row's columns as the file has them."""

from __future__ import annotations

import json
import textwrap

import pytest

from relayrl.data.datasets import DatasetConfig, load_problems
from relayrl.engines.reward import RewardConfig, RewardEngine
from tests.data.test_ground_truths import KEY, TRUTHS, countdown_rows, write_rows

FNS = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's countdown, per response
        assert isinstance(ground_truth, dict) and isinstance(ground_truth["target"], int), ground_truth
        return {"score": float(solution_str.strip() == str(ground_truth["target"])),
                "numbers": len(ground_truth["numbers"])}

    def batched(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(s.strip() == str(g["target"])) for s, g in zip(solution_strs, ground_truths)]

    def exact_int(data_source, solution_str, ground_truth, extra_info=None):
        assert type(ground_truth) is int, type(ground_truth)
        return float(int(solution_str) == ground_truth)

    def own(prompts, responses, answers, reward_model=None):  # relayrl's shape: the text; the field as it is
        assert all(isinstance(a, str) for a in answers), answers
        return [float(json.loads(a)["target"] == m["ground_truth"]["target"]) for a, m in zip(answers, reward_model)]

    def trl(completions, reward_model, **kwargs):
        return [float(c[0]["content"] == str(m["ground_truth"]["target"])) for c, m in zip(completions, reward_model)]
"""


@pytest.fixture()
def fns(tmp_path):
    (tmp_path / "gt_fns.py").write_text("import json\n" + textwrap.dedent(FNS))
    return f"{tmp_path}/gt_fns.py"


def _score(fn: str, problems, responses):
    engine = RewardEngine(RewardConfig(verifier="user", user_fn=fn))
    return engine.score([p.prompt for p in problems], responses, [p.answer for p in problems],
                        columns=[p.meta.get("fields") for p in problems])


@pytest.mark.parametrize("name", ["train.jsonl", "train.parquet"])
def test_a_verl_compute_score_gets_the_dict_ground_truth_per_response_and_batched(tmp_path, fns, name):
    problems = load_problems(DatasetConfig(path=write_rows(tmp_path / name, countdown_rows()), answer_key=KEY,
                                           raw_answers=True))
    rewards, metrics = _score(f"{fns}:compute_score", problems, ["24", "9"])
    assert rewards == [1.0, 0.0]
    assert metrics["reward/user/numbers"] == pytest.approx(3.5)  # (4 and 3 numbers)
    assert _score(f"{fns}:batched", problems, [" 24", "10"])[0] == [1.0, 1.0]


def test_an_int_ground_truth_arrives_as_an_int(tmp_path, fns):
    f = write_rows(tmp_path / "d.parquet", [{"prompt": "6*7=", "answer": 42}, {"prompt": "1+1=", "answer": 2}])
    problems = load_problems(DatasetConfig(path=f, raw_answers=True))
    assert _score(f"{fns}:exact_int", problems, ["42", "3"])[0] == [1.0, 0.0]


def test_relayrl_and_trl_functions_get_what_they_got_before(tmp_path, fns):
    problems = load_problems(DatasetConfig(path=write_rows(tmp_path / "t.jsonl", countdown_rows()), answer_key=KEY,
                                           raw_answers=True))
    assert [p.answer for p in problems] == [json.dumps(t) for t in TRUTHS]
    assert _score(f"{fns}:own", problems, ["x", "y"])[0] == [1.0, 1.0]
    assert _score(f"{fns}:trl", problems, ["24", "11"])[0] == [1.0, 0.0]
