"""A ground truth that is not text (verl's countdown ``{"target": 24, "numbers": [...]}``, an int, a float):
read for a user reward function (``raw_answers``: workflow grpo with ``reward.verifier=user``, ``relayrl eval
--user-fn``), each answer keeps the value the file holds beside its text; read for a built-in verifier or a
workflow that trains on the answer, numbers become text as before and a list or dict is refused naming the row
and the fix."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.data.datasets import DatasetConfig, DatasetError, load_problems
from relayrl.data.truth import GroundTruth, plain, truth_value

ROOT = Path(__file__).resolve().parents[2]
KEY = "reward_model.ground_truth"
TRUTHS = [{"target": 24, "numbers": [3, 7, 5, 9]}, {"target": 10, "numbers": [2, 5, 1]}]


def countdown_rows(truths=TRUTHS) -> list[dict]:
    """verl's countdown layout: a chat prompt, ``data_source``, a dict ground truth, ``extra_info``."""
    return [{"data_source": "countdown", "prompt": [{"role": "user", "content": f"Make {t['target']} from "
                                                    f"{' '.join(map(str, t['numbers']))}"}],
             "reward_model": {"style": "rule", "ground_truth": t}, "extra_info": {"index": i}}
            for i, t in enumerate(truths)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """``rows`` as JSON lines or, for a ``.parquet`` path, a Parquet file (nested structs and lists)."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", ["train.jsonl", "train.parquet"])
def test_a_dict_ground_truth_keeps_the_value_the_file_holds(tmp_path, name):
    f = write_rows(tmp_path / name, countdown_rows())
    problems = load_problems(DatasetConfig(path=f, answer_key=KEY, raw_answers=True))
    values = [truth_value(p.answer) for p in problems]
    assert values == TRUTHS
    assert all(type(v) is dict and type(v["target"]) is int and type(v["numbers"]) is list for v in values)
    assert [p.answer for p in problems] == [json.dumps(t) for t in TRUTHS]  # the text: its JSON
    assert isinstance(problems[0].answer, str)
    assert problems[0].meta["fields"]["reward_model"]["ground_truth"] == TRUTHS[0]  # (the row as it was)
    back = pickle.loads(pickle.dumps(problems[0]))  # (to a worker process)
    assert back.answer == problems[0].answer and truth_value(back.answer) == TRUTHS[0]


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_numbers_keep_their_type_and_text_stays_text(tmp_path, name):
    f = write_rows(tmp_path / name, [{"prompt": "a", "answer": 42}, {"prompt": "b", "answer": 7}])
    raw = load_problems(DatasetConfig(path=f, raw_answers=True))
    assert [p.answer for p in raw] == ["42", "7"]
    assert [truth_value(p.answer) for p in raw] == [42, 7] and type(truth_value(raw[0].answer)) is int
    g = write_rows(tmp_path / f"e{Path(name).suffix}",
                   [{"prompt": "a", "answer": 0.5}, {"prompt": "b", "answer": True}])
    assert [truth_value(p.answer) for p in load_problems(DatasetConfig(path=g, raw_answers=True))] == [0.5, True]
    h = write_rows(tmp_path / f"s{Path(name).suffix}", [{"prompt": "a", "answer": "42"}])
    (text,) = load_problems(DatasetConfig(path=h, raw_answers=True))
    assert type(text.answer) is str and truth_value(text.answer) == "42"
    # for a built-in verifier: the text, exactly as before
    built_in = load_problems(DatasetConfig(path=f))
    assert [p.answer for p in built_in] == ["42", "7"] and all(type(p.answer) is str for p in built_in)
    assert [truth_value(p.answer) for p in built_in] == ["42", "7"]


@pytest.mark.parametrize("name", ["cases.jsonl", "cases.parquet"])
def test_a_list_of_records_ground_truth_is_a_value_not_chat_messages(tmp_path, name):
    """A code task's test cases (``[{"input": ..., "output": ...}]``) are a list of dicts without roles: the
    value a user reward function scores, not an assistant reply; a built-in verifier refuses it as a list."""
    cases = [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "4"}]
    f = write_rows(tmp_path / name, [{"prompt": "add two numbers", "answer": cases}])
    (p,) = load_problems(DatasetConfig(path=f, raw_answers=True))
    assert truth_value(p.answer) == cases
    with pytest.raises(DatasetError, match="field 'answer' is list; expected a string or a number"):
        load_problems(DatasetConfig(path=f))
    g = write_rows(tmp_path / f"chat{Path(name).suffix}",  # a reply given as messages still reads as the reply
                   [{"prompt": "q", "answer": [{"role": "assistant", "content": "42"}]}])
    assert [p.answer for p in load_problems(DatasetConfig(path=g))] == ["42"]


def test_a_dict_ground_truth_for_a_built_in_verifier_is_refused_naming_the_row_and_the_fix(tmp_path):
    rows = [{**countdown_rows()[0], "reward_model": {"style": "rule", "ground_truth": "24"}}, countdown_rows()[1]]
    for f, row in ((write_rows(tmp_path / "train.jsonl", rows), "train.jsonl row 2"),
                   (write_rows(tmp_path / "train.parquet", countdown_rows()), "train.parquet rows 1, 2 (2 rows)")):
        with pytest.raises(DatasetError) as e:
            load_problems(DatasetConfig(path=f, answer_key=KEY))
        msg = str(e.value)
        assert f"{row}: field 'reward_model.ground_truth' is dict; expected a string or a number" in msg, msg
        assert "reward.verifier=user reward.user_fn=" in msg, msg
        assert "data.answer_key=reward_model.ground_truth.target" in msg, msg


def test_a_list_or_bool_answer_is_still_refused_for_a_built_in_verifier(tmp_path):
    f = write_rows(tmp_path / "t.jsonl", [{"prompt": "q", "answer": ["1"]}])
    with pytest.raises(DatasetError, match=r"^t.jsonl row 1: field 'answer' is list; expected a string or a number"):
        load_problems(DatasetConfig(path=f))
    with pytest.raises(DatasetError, match=r"null"):  # (no value to score against, whoever scores)
        load_problems(DatasetConfig(path=write_rows(tmp_path / "n.jsonl", [{"prompt": "q", "answer": None}]),
                                    raw_answers=True))


def test_plain_turns_numpy_values_into_python_ones():
    np = pytest.importorskip("numpy")
    got = plain({"target": np.int64(24), "numbers": np.array([3, 7]), "ok": np.bool_(True),
                 "half": np.float32(0.5), "pair": (np.int32(1), "a")})
    assert got == {"target": 24, "numbers": [3, 7], "ok": True, "half": 0.5, "pair": [1, "a"]}
    assert type(got["target"]) is int and type(got["numbers"][0]) is int and type(got["ok"]) is bool
    assert type(got["half"]) is float and type(got["pair"]) is list
    truth = GroundTruth.of(got)
    assert truth == json.dumps(got) and truth.value is got


def _cfg(tmp_path, tiny_dir, recipe, *over):
    from relayrl.config.loader import load_run_config

    train = write_rows(tmp_path / "train.parquet", countdown_rows(TRUTHS * 6))
    held = write_rows(tmp_path / "test.jsonl", countdown_rows())
    return load_run_config(str(ROOT / "recipes" / recipe), [
        "data.task=null", f"data.path={train}", f"data.eval_path={held}", f"data.answer_key={KEY}", "eval.size=2",
        f"trainer.init_from={tiny_dir}", *over])


def test_a_run_scored_by_a_user_function_reads_the_values_training_and_held_out(tmp_path, tiny_dir):
    from relayrl.workflows.problems import RunProblems

    (tmp_path / "cd.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    return 0.0\n")
    cfg = _cfg(tmp_path, tiny_dir, "arith_grpo.yaml", "reward.verifier=user",
               f"reward.user_fn={tmp_path}/cd.py:compute_score")
    rp = RunProblems(cfg, training=True, log=lambda _: None)
    assert [truth_value(p.answer) for p in rp.train_problems[:2]] == TRUTHS
    assert [truth_value(p.answer) for p in rp.eval_problems] == TRUTHS


@pytest.mark.parametrize("recipe, verifier", [("arith_grpo.yaml", "math"), ("arith_sft.yaml", "user")])
def test_a_run_that_needs_the_answers_text_refuses_a_dict_ground_truth(tmp_path, tiny_dir, recipe, verifier):
    """A built-in verifier compares text; SFT trains on it (whatever scores its held-out rows)."""
    from relayrl.workflows.problems import RunProblems

    (tmp_path / "cd.py").write_text("def score(prompts, responses, answers):\n    return [0.0] * len(answers)\n")
    over = [f"reward.verifier={verifier}"] + ([f"reward.user_fn={tmp_path}/cd.py:score"] if verifier == "user" else [])
    with pytest.raises(DatasetError) as e:
        RunProblems(_cfg(tmp_path, tiny_dir, recipe, *over), training=True, log=lambda _: None)
    msg = str(e.value)
    assert "train.parquet: 12 bad rows" in msg and "rows 1, 2, 3, 4, 5, ... (12 rows): field " \
        "'reward_model.ground_truth' is dict" in msg, msg  # (a column's one type: one line for its rows)


def test_answer_regex_cuts_text_only(tmp_path):
    f = write_rows(tmp_path / "t.jsonl", countdown_rows())
    with pytest.raises(DatasetError, match=r"row 1: field 'reward_model.ground_truth' is dict; answer_regex '#### "
                                           r"\(\.\+\)' cuts the answer out of text: set data.answer_regex=null"):
        load_problems(DatasetConfig(path=f, answer_key=KEY, raw_answers=True, answer_regex="#### (.+)"))


def test_a_step_larger_than_the_training_rows_is_said(tmp_path, tiny_dir):
    """(A step of more prompts than the rows repeated prompts without a word.)"""
    from relayrl.workflows.problems import RunProblems

    (tmp_path / "cd.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    return 0.0\n")
    over = ["reward.verifier=user", f"reward.user_fn={tmp_path}/cd.py:compute_score"]
    for per_step, said in ((13, True), (12, False)):
        lines: list[str] = []
        RunProblems(_cfg(tmp_path, tiny_dir, "arith_grpo.yaml", *over, f"data.prompts_per_step={per_step}"),
                    training=True, log=lines.append)
        assert any(f"data.prompts_per_step={per_step} is more than the 12 training rows" in x for x in lines) == said
