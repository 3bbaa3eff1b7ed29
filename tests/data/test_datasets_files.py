"""User datasets from JSONL/JSON/Parquet: good files, nested keys, and every malformed-row error."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from relayrl.data.datasets import DatasetConfig, DatasetError, load_problems
from relayrl.data.tasks import Problem


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_text_prompts_numbers_and_extra_fields(tmp_path):
    f = _jsonl(tmp_path / "train.jsonl", [
        {"prompt": "1+1=", "answer": "2", "source": "hand"},
        "",  # blank lines are skipped but still count as lines
        {"prompt": "2+2=", "answer": 4},
        {"prompt": "half?", "answer": 0.5},
    ])
    problems = load_problems(DatasetConfig(path=f))
    assert problems == [Problem("1+1=", "2"), Problem("2+2=", "4"), Problem("half?", "0.5")]
    assert [p.meta["row"] for p in problems] == [1, 3, 4]
    assert problems[0].meta["extra"] == {"source": "hand"}
    assert "messages" not in problems[0].meta


def test_custom_keys_nested_keys_and_literal_dotted_keys(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [
        {"question": "q1", "extra": {"answer": "a1"}},
        {"question": "q2", "extra": {"answer": "a2"}, "extra.answer": "literal wins"},
    ])
    problems = load_problems(DatasetConfig(path=f, prompt_key="question", answer_key="extra.answer"))
    assert [(p.prompt, p.answer) for p in problems] == [("q1", "a1"), ("q2", "literal wins")]


def test_json_array_file_and_limit(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"prompt": f"p{i}", "answer": str(i)} for i in range(5)]))
    problems = load_problems(DatasetConfig(path=f, limit=3))
    assert [p.prompt for p in problems] == ["p0", "p1", "p2"]


def test_parquet_text_and_chat_prompts(tmp_path):
    f = tmp_path / "train.parquet"
    pq.write_table(pa.table({
        "prompt": [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2?"}],
                   [{"role": "user", "content": "3+4?"}]],
        "reward_model": [{"ground_truth": 3}, {"ground_truth": 7}],
        "id": [10, 11],
    }), f)
    problems = load_problems(DatasetConfig(path=f, answer_key="reward_model.ground_truth"))
    assert [p.answer for p in problems] == ["3", "7"]
    assert problems[0].meta["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2?"}]
    assert problems[0].prompt == "system: be brief\nuser: 1+2?"
    assert problems[1].meta["row"] == 2
    assert problems[1].meta["extra"] == {"reward_model": {"ground_truth": 7}, "id": 11}


def test_parquet_rows_keep_every_column_for_the_reward_function(tmp_path):
    """verl's parquet layout: extra_info, ability and the rest reach a reward function's fields, as JSONL rows'."""
    f = tmp_path / "train.parquet"
    pq.write_table(pa.table({
        "data_source": ["gsm8k"], "prompt": [[{"role": "user", "content": "1+2?"}]], "ability": ["math"],
        "reward_model": [{"style": "rule", "ground_truth": "3"}], "extra_info": [{"split": "train", "index": 7}],
    }), f)
    (p,) = load_problems(DatasetConfig(path=f, answer_key="reward_model.ground_truth"))
    assert p.meta["fields"]["extra_info"] == {"split": "train", "index": 7}
    assert p.meta["fields"]["ability"] == "math" and p.meta["fields"]["data_source"] == "gsm8k"


def test_parquet_missing_column_names_it_and_what_exists(tmp_path):
    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), f)
    with pytest.raises(DatasetError) as e:
        load_problems(DatasetConfig(path=f))
    assert str(e.value) == ("t.parquet: column 'prompt' is missing (columns present: question, answer); "
                            "data.prompt_key (--prompt-key for relayrl eval) names the field to read")


def test_parquet_bad_row_has_its_number(tmp_path):
    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", None], "answer": ["1", "2", "3"]}), f)
    with pytest.raises(DatasetError, match=r"^t.parquet row 3: field 'prompt' is null$"):
        load_problems(DatasetConfig(path=f))


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"question": "q", "answer": "1"}, "train.jsonl row 3: field 'prompt' is missing (columns present: question, answer)"),
        ('{"prompt": "q", "answer": }', "train.jsonl row 3: invalid JSON (Expecting value at column 27)"),
        ('{"prompt": "q", "answer": "1"', "train.jsonl row 3: invalid JSON (Expecting ',' delimiter at column 30)"),
        ('["q", "1"]', "train.jsonl row 3: expected a JSON object with fields, got list"),
        ({"prompt": 5, "answer": "1"}, "train.jsonl row 3: field 'prompt' is int; expected a string or a list of"),
        ({"prompt": "  ", "answer": "1"}, "train.jsonl row 3: field 'prompt' is an empty string"),
        ({"prompt": [], "answer": "1"}, "train.jsonl row 3: field 'prompt' is an empty list of messages"),
        ({"prompt": ["hi"], "answer": "1"}, "train.jsonl row 3: field 'prompt' message 1 is str; expected {'role', 'content'}"),
        ({"prompt": [{"role": "user", "content": "a"}, {"content": "b"}], "answer": "1"},
         "train.jsonl row 3: field 'prompt' message 2 has no 'role' (keys: content)"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, "train.jsonl row 3: field 'prompt' message 1 has no 'content' (keys: role)"),
        ({"prompt": [{"role": "user", "content": 3}], "answer": "1"},
         "train.jsonl row 3: field 'prompt' message 1 'content' is int; expected a string"),
        ({"prompt": "q"}, "train.jsonl row 3: field 'answer' is missing (columns present: prompt)"),
        ({"prompt": "q", "answer": None}, "train.jsonl row 3: field 'answer' is null"),
        ({"prompt": "q", "answer": ["1"]}, "train.jsonl row 3: field 'answer' is list; expected a string or a number"),
        ({"prompt": "q", "answer": True}, "train.jsonl row 3: field 'answer' is bool; expected a string or a number"),
    ],
)
def test_malformed_row_reported_with_row_number(tmp_path, bad_row, message):
    f = _jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, bad_row])
    with pytest.raises(DatasetError) as e:
        load_problems(DatasetConfig(path=f))
    assert str(e.value).startswith(message)


def test_a_dotted_key_with_a_typo_names_what_its_parent_holds(tmp_path):
    f = _jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "reward_model": {"style": "rule", "ground_truth": "1"}}])
    with pytest.raises(DatasetError) as e:
        load_problems(DatasetConfig(path=f, answer_key="reward_model.groundtruth"))
    assert str(e.value) == ("train.jsonl row 1: field 'reward_model.groundtruth' is missing (columns present: "
                            "prompt, reward_model; reward_model holds: style, ground_truth); data.answer_key "
                            "(--answer-key for relayrl eval) names the field to read")


def test_bad_utf8_row(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl row 2: not valid UTF-8"):
        load_problems(DatasetConfig(path=f))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", b"", "is empty"),
        ("blank.jsonl", b"\n  \n", "has no rows"),
        ("data.csv", b"prompt,answer\n", "cannot tell the format of data.csv"),
        ("broken.parquet", b"not parquet at all", "broken.parquet: not a readable Parquet file"),
        ("arr.json", b"[{", "arr.json: invalid JSON array"),
    ],
)
def test_bad_files(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(DatasetError, match=message):
        load_problems(DatasetConfig(path=f))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_problems(DatasetConfig(path=tmp_path / "nope.jsonl"))
    with pytest.raises(DatasetError, match="is not a file"):
        load_problems(DatasetConfig(path=tmp_path))


def test_format_override_and_config_checks(tmp_path):
    f = _jsonl(tmp_path / "data.txt", [{"prompt": "p", "answer": "a"}])
    assert load_problems(DatasetConfig(path=f, format="jsonl"))[0].answer == "a"
    with pytest.raises(ValidationError, match="format"):
        DatasetConfig(path=f, format="csv")
    with pytest.raises(ValidationError, match="prompt_key"):
        DatasetConfig(path=f, prompt_key="")


def test_json_array_bad_item_has_its_position(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"prompt": "p", "answer": "1"}, 5]))
    with pytest.raises(DatasetError, match=r"^d.json row 2: expected a JSON object with fields, got int$"):
        load_problems(DatasetConfig(path=f))


def test_preference_pairs_are_read_and_checked_per_row(tmp_path):
    f = _jsonl(tmp_path / "pairs.jsonl", [{"q": "1+1=", "good": "2", "bad": "3", "id": 7}])
    (p,) = load_problems(DatasetConfig(path=f, prompt_key="q", answer_key="good", rejected_key="bad"))
    assert (p.answer, p.meta["rejected"], p.meta["extra"]) == ("2", "3", {"id": 7})
    for row, message in [({"q": "1+1=", "good": "2"}, "row 1: field 'bad' .* is missing"),
                         ({"q": "1+1=", "good": "2", "bad": ""}, "row 1: field 'bad' must be a non-empty string"),
                         ({"q": "1+1=", "good": "2", "bad": "2"}, "row 1: the rejected answer equals the chosen")]:
        with pytest.raises(DatasetError, match=message):
            load_problems(DatasetConfig(path=_jsonl(tmp_path / "bad.jsonl", [row]), prompt_key="q", answer_key="good",
                                        rejected_key="bad"))
    pq.write_table(pa.table({"prompt": ["2+2="], "answer": ["4"], "rejected": ["5"]}), tmp_path / "p.parquet")
    (p,) = load_problems(DatasetConfig(path=tmp_path / "p.parquet", rejected_key="rejected"))
    assert p.meta["rejected"] == "5"


def test_every_bad_row_is_reported_up_to_a_limit(tmp_path):
    from relayrl.data.datasets import MAX_ROW_ERRORS

    f = tmp_path / "many.jsonl"
    lines = [json.dumps({"prompt": "ok", "answer": "1"})]
    lines += [json.dumps({"prompt": f"p{i}"}) for i in range(MAX_ROW_ERRORS + 5)]
    f.write_bytes("\n".join(lines).encode("utf-8") + b"\n{broken\n\xff\xfe\n")  # + bad JSON, bad UTF-8
    with pytest.raises(DatasetError) as info:
        load_problems(DatasetConfig(path=f))
    msg = str(info.value)
    n_bad = MAX_ROW_ERRORS + 7
    assert msg.startswith(f"{f}: {n_bad} bad rows (the first {MAX_ROW_ERRORS} listed); fix or remove them:")
    assert msg.count("\n  many.jsonl row ") == MAX_ROW_ERRORS
    assert "many.jsonl row 2: field 'answer' is missing" in msg
    assert f"row {MAX_ROW_ERRORS + 1}:" in msg and f"row {MAX_ROW_ERRORS + 2}:" not in msg
    # a few bad rows are all listed, whatever went wrong in each
    f.write_bytes(b'{"prompt": "a", "answer": "1"}\n{broken\n\xff\n{"prompt": "", "answer": "2"}\n')
    with pytest.raises(DatasetError) as info:
        load_problems(DatasetConfig(path=f))
    msg = str(info.value)
    assert "3 bad rows; fix or remove them" in msg
    for part in ("row 2: invalid JSON", "row 3: not valid UTF-8", "row 4: field 'prompt' is an empty string"):
        assert part in msg
    # one bad row reads as before: just that row
    f.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(DatasetError, match=r"^many.jsonl row 2: field 'answer' is missing"):
        load_problems(DatasetConfig(path=f))


def test_empty_or_meaningless_answers_are_refused_per_row(tmp_path):
    for row, message in [({"prompt": "4+4=", "answer": "  "}, "row 1: field 'answer' must be a non-empty string"),
                         ({"prompt": "4+4=", "answer": float("nan")}, "row 1: field 'answer' is nan, not an answer"),
                         ({"prompt": "4+4=", "answer": "8", "rejected": " 8"},
                          "row 1: the rejected answer equals the chosen one .* apart from spaces")]:
        with pytest.raises(DatasetError, match=message):
            load_problems(DatasetConfig(path=_jsonl(tmp_path / "bad.jsonl", [row]),
                                        rejected_key="rejected" if "rejected" in row else None))
    (p,) = load_problems(DatasetConfig(path=_jsonl(tmp_path / "num.jsonl", [{"prompt": "3+3=", "answer": 6,
                                                                             "rejected": 7}]), rejected_key="rejected"))
    assert (p.answer, p.meta["rejected"]) == ("6", "7")  # numbers on both sides, as text
    for msgs, message in [([{"role": "user", "content": "3+3="}, {"role": "assistant", "content": ""}],
                           "message 2 is an empty assistant turn"),
                          ([{"role": "usr", "content": "3+3="}, {"role": "assistant", "content": "6"}],
                           "message 1 has role 'usr'; expected one of system, developer, user, assistant, tool")]:
        with pytest.raises(DatasetError, match=message):
            load_problems(DatasetConfig(path=_jsonl(tmp_path / "conv.jsonl", [{"messages": msgs}]),
                                        messages_key="messages"))


def test_a_byte_order_mark_is_read_past(tmp_path):
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "1+1=", "answer": "2"}).encode() + b"\n")
    assert [p.answer for p in load_problems(DatasetConfig(path=f))] == ["2"]
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"prompt": "1+1=", "answer": "2"}]).encode())
    assert [p.answer for p in load_problems(DatasetConfig(path=f))] == ["2"]


def test_a_utf16_file_is_named_as_such_once(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_bytes(json.dumps({"prompt": "1+1=", "answer": "2"}).encode("utf-16"))  # (with its BOM)
    with pytest.raises(DatasetError, match=r"w.jsonl: the file is UTF-16 text .* save it as UTF-8"):
        load_problems(DatasetConfig(path=f))


def test_rows_of_whole_conversations_without_messages_key_say_which_key_reads_them(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="},
                                             {"role": "assistant", "content": "2"}]}) + "\n")
    with pytest.raises(DatasetError, match=r"chats.jsonl row 1: field 'prompt' is missing \(columns present: "
                                           r"messages\); rows of whole conversations: set data.messages_key=messages"):
        load_problems(DatasetConfig(path=path))


def test_a_key_twice_in_a_json_row_is_refused_naming_the_row(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "a", "prompt": "b", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl row 2: key 'prompt' appears twice"):
        load_problems(DatasetConfig(path=f))
    arr = tmp_path / "d.json"
    arr.write_text('[{"prompt": "a", "answer": "1", "answer": "2"}]')
    with pytest.raises(DatasetError, match=r"d.json: key 'answer' appears twice"):
        load_problems(DatasetConfig(path=arr))


@pytest.mark.parametrize("objects", [1, 2])
def test_a_pretty_printed_json_file_is_refused_once_with_the_fix(tmp_path, objects):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": "a", "answer": "1"}, indent=2) for _ in range(objects)))
    what = "one JSON object" if objects == 1 else "2 JSON objects"
    with pytest.raises(DatasetError, match=rf"d.jsonl: the file is {what} written over several lines") as e:
        load_problems(DatasetConfig(path=f))
    assert "row" not in str(e.value).split("(")[0] and "d.lines.jsonl" in str(e.value)


def test_a_broken_first_line_is_still_a_bad_row(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "ans\n{"prompt": "a", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl row 1: invalid JSON"):
        load_problems(DatasetConfig(path=f))


@pytest.mark.parametrize("names", [["prompt", "answer", "prompt"], ["prompt", "answer", "e", "e"]])
def test_a_parquet_column_twice_is_refused_naming_it(tmp_path, names):
    f = tmp_path / "d.parquet"
    cols = [pa.array([f"{n}{i}" for i in range(2)]) for n in names]
    pq.write_table(pa.Table.from_arrays(cols, names=names), f)
    with pytest.raises(DatasetError, match=rf"d.parquet: column '{names[-1]}' appears 2 times"):
        load_problems(DatasetConfig(path=f))


def test_a_file_of_one_object_holding_the_rows_under_a_key_says_how_to_rewrite_it(tmp_path):
    """``{"data": [{...}, ...]}`` on one line, an export's shape: said only "field 'prompt' is missing (columns
    present: data)", with no word of the rows inside."""
    f = tmp_path / "export.jsonl"
    f.write_text(json.dumps({"data": [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]}) + "\n")
    with pytest.raises(DatasetError) as e:
        load_problems(DatasetConfig(path=f))
    assert "field 'prompt' is missing (columns present: data)" in str(e.value), e.value
    assert "rows in a list under 'data'" in str(e.value) and "jq -c '.data[]'" in str(e.value), e.value
