"""Preference rows (DPO / RM pairs) read alike from every format: the answer regex cuts both sides, TRL's
implicit-prompt rows load from columnar files as from JSONL, and the errors name the option and the rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.data.config import DataConfig
from relayrl.data.datasets import DatasetConfig, DatasetError, load_problems

REGEX = r"####\s*(.+)$"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pairs(tmp_path, rows, **cfg):
    return load_problems(DatasetConfig(path=_jsonl(tmp_path / "pairs.jsonl", rows), answer_key="chosen",
                                       rejected_key="rejected", **cfg))


def test_answer_regex_cuts_the_rejected_answer_as_the_chosen_one(tmp_path):
    # old: the chosen answer was cut ('11') and the rejected one kept whole ('#### 12'), so DPO and RM trained
    # a 1-token answer against a 3-token one
    (p,) = _pairs(tmp_path, [{"prompt": "10+1=", "chosen": "#### 11", "rejected": "#### 12"}], answer_regex=REGEX)
    assert (p.answer, p.meta["rejected"]) == ("11", "12")
    # a conversational rejected reply is cut too
    (p,) = _pairs(tmp_path, [{"prompt": "10+1=", "chosen": [{"role": "assistant", "content": "so #### 11"}],
                              "rejected": [{"role": "assistant", "content": "so #### 12"}]}], answer_regex=REGEX)
    assert (p.answer, p.meta["rejected"]) == ("11", "12")


def test_the_equality_check_compares_the_answers_as_trained(tmp_path):
    # old: '11' (cut) was compared with '####11' (uncut), so a pair that trains '11' against '11' passed
    with pytest.raises(DatasetError, match=r"^pairs.jsonl row 1: the rejected answer equals the chosen one \('11'\)"):
        _pairs(tmp_path, [{"prompt": "10+1=", "chosen": "#### 11", "rejected": "work ####11"}], answer_regex=REGEX)


def test_a_rejected_answer_without_a_match_is_refused_as_a_chosen_one_is(tmp_path):
    # old: a rejected answer with no match was trained whole, where a chosen one was refused
    with pytest.raises(DatasetError) as e:
        _pairs(tmp_path, [{"prompt": "10+1=", "chosen": "#### 11", "rejected": "twelve"}], answer_regex=REGEX)
    assert str(e.value) == f"pairs.jsonl row 1: field 'rejected' ('twelve') has no match for answer_regex {REGEX!r}"
    with pytest.raises(DatasetError) as e:
        _pairs(tmp_path, [{"prompt": "10+1=", "chosen": "eleven", "rejected": "#### 12"}], answer_regex=REGEX)
    assert str(e.value) == f"pairs.jsonl row 1: field 'chosen' ('eleven') has no match for answer_regex {REGEX!r}"


def test_sft_and_kto_rows_train_their_cut_completion(tmp_path):
    """One answer per row (SFT's completion, KTO's completion beside its boolean label): nothing else to cut."""
    (p,) = load_problems(DatasetConfig(path=_jsonl(tmp_path / "k.jsonl", [
        {"prompt": "10+1=", "completion": "#### 11", "label": "true"}]), answer_key="completion", label_key="label",
        answer_regex=REGEX))
    assert (p.answer, p.meta["label"]) == ("11", True)


def test_a_missing_rejected_answer_names_its_option_as_a_missing_chosen_one_does(tmp_path):
    # old: 'field 'rejected' (the rejected answer) is missing (columns present: prompt, chosen)', no option named
    with pytest.raises(DatasetError) as e:
        _pairs(tmp_path, [{"prompt": "1+1=", "chosen": "2"}])
    assert str(e.value) == ("pairs.jsonl row 1: field 'rejected' (the rejected answer) is missing (columns present: "
                            "prompt, chosen); data.rejected_key names the field to read")
    with pytest.raises(DatasetError) as e:
        _pairs(tmp_path, [{"prompt": "1+1=", "rejected": "3"}])
    assert str(e.value).endswith("data.answer_key (--answer-key for relayrl eval) names the field to read")
    with pytest.raises(DatasetError, match=r"row 1: field 'label' is missing \(columns present: prompt, answer\); "
                                           r"data.label_key names the field to read \(the label: true"):
        load_problems(DatasetConfig(path=_jsonl(tmp_path / "k.jsonl", [{"prompt": "1+1=", "answer": "2"}]),
                                    label_key="label"))


def _said(reply: str) -> list[dict]:
    return [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": reply}]


IMPLICIT = [{"chosen": _said(str(4 + i)), "rejected": _said(str(9 + i))} for i in range(3)]


def _write(tmp_path, rows, fmt: str):
    """``rows`` as a file (or directory) of format ``fmt``."""
    if fmt == "jsonl":
        return _jsonl(tmp_path / "rows.jsonl", rows)
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
        return tmp_path / "rows.parquet"
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(rows)
    if fmt == "save_to_disk":
        ds.save_to_disk(tmp_path / "rows")
        return tmp_path / "rows"
    with pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink, pa.ipc.new_file(sink, ds.data.schema) as w:
        w.write_table(ds.data.table)
    return tmp_path / "rows.arrow"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow", "save_to_disk"])
def test_implicit_prompt_rows_load_from_every_format(tmp_path, fmt):
    # old: Parquet and the datasets sources refused them up front: column 'prompt' is missing (columns present:
    # chosen, rejected), though the same rows load from JSONL
    got = load_problems(DatasetConfig(path=_write(tmp_path, IMPLICIT, fmt), answer_key="chosen",
                                      rejected_key="rejected"))
    assert [(p.answer, p.meta["rejected"]) for p in got] == [("4", "9"), ("5", "10"), ("6", "11")]
    assert got[0].meta["messages"] == [{"role": "user", "content": "2+2?"}]


def test_implicit_prompt_rows_as_the_held_out_set(tmp_path):
    path = _write(tmp_path, IMPLICIT, "parquet")  # data.eval_path goes through the same reader
    (held,) = DataConfig(task=None, path=str(path), eval_path=str(path), answer_key="chosen").eval_datasets(
        rejected_key="rejected")
    assert [p.answer for p in load_problems(held)] == ["4", "5", "6"]


@pytest.mark.parametrize("fmt", ["parquet", "save_to_disk"])
def test_a_prompt_column_is_still_required_where_the_answers_are_not_conversations(tmp_path, fmt):
    with pytest.raises(DatasetError) as e:
        load_problems(DatasetConfig(path=_write(tmp_path, [{"chosen": "4", "rejected": "5"}], fmt),
                                    answer_key="chosen", rejected_key="rejected"))
    column = "t.parquet: column" if fmt == "parquet" else "rows row 1: field"
    assert str(e.value).replace("rows.parquet", "t.parquet").startswith(
        f"{column} 'prompt' is missing (columns present: chosen, rejected); data.prompt_key (--prompt-key for "
        f"relayrl eval) names the field to read")


def test_whole_conversations_load_from_parquet_with_messages_key(tmp_path):
    # old: Parquet asked for the prompt and answer columns beside data.messages_key (and then told the user to
    # set data.messages_key, which was set)
    conv = [{"messages": _said("4")}]
    (p,) = load_problems(DatasetConfig(path=_write(tmp_path, conv, "parquet"), messages_key="messages"))
    assert p.answer == "4" and p.meta["conversation"] == _said("4")


def test_a_wrongly_typed_column_is_reported_once_with_its_rows(tmp_path):
    # old: the same type error once per row, ten identical lines
    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": [f"{i}+1=" for i in range(10)], "chosen": [str(i) for i in range(10)],
                             "rejected": [[i] for i in range(10)]}), f)
    with pytest.raises(DatasetError) as e:
        load_problems(DatasetConfig(path=f, answer_key="chosen", rejected_key="rejected"))
    assert str(e.value) == (f"{f}: 10 bad rows; fix or remove them:\n  t.parquet rows 1, 2, 3, 4, 5, ... (10 rows): "
                            "field 'rejected' is list; expected a string or a number")
    # rows failing for different reasons keep a line each; two alike list both numbers
    pq.write_table(pa.table({"prompt": ["a", None, "c", None], "chosen": ["1", "2", None, "4"],
                             "rejected": ["5", "6", "7", "8"]}), f)
    with pytest.raises(DatasetError) as e:
        load_problems(DatasetConfig(path=f, answer_key="chosen", rejected_key="rejected"))
    assert str(e.value) == (f"{f}: 3 bad rows; fix or remove them:\n  t.parquet rows 2, 4 (2 rows): field 'prompt' is "
                            "null\n  t.parquet row 3: field 'chosen' is null")


def test_jsonl_rows_keep_a_line_each(tmp_path):
    """A JSONL row's error is its own (rows do not share a type): each bad row is listed, as before."""
    with pytest.raises(DatasetError) as e:
        _pairs(tmp_path, [{"prompt": "a", "chosen": "1", "rejected": [1]}, {"prompt": "b", "chosen": "2", "rejected": [2]}])
    assert str(e.value).count("\n  pairs.jsonl row ") == 2
