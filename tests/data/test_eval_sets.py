"""``data.eval_path`` as a list of held-out sets (verl's ``data.val_files``): the config takes a list or one path,
each set gives its first ``eval.size`` rows with their source, and a bad path is named in the error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from relayrl.data.config import DataConfig
from relayrl.data.datasets import DatasetError, load_problems
from relayrl.evaluation.metrics import source_names

ROOT = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, n: int, start: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(start, start + n)))
    return path


def test_a_list_or_one_path():
    one = DataConfig(task=None, path="t.jsonl", eval_path="e.jsonl")
    assert one.eval_path == "e.jsonl" and one.eval_paths == ["e.jsonl"]
    assert [d.path for d in one.eval_datasets()] == [Path("e.jsonl")]
    assert one.dataset(held_out=True).path == Path("e.jsonl")
    two = DataConfig(task=None, path="t.jsonl", eval_path=["a/test.jsonl", "~/b.parquet"])
    assert two.eval_paths == ["a/test.jsonl", str(Path.home() / "b.parquet")]  # ~ expanded in each
    assert [d.path for d in two.eval_datasets()] == [Path("a/test.jsonl"), Path.home() / "b.parquet"]
    assert DataConfig(task=None, path="t.jsonl", eval_path=["e.jsonl"]).eval_path == "e.jsonl"  # as one path
    assert DataConfig(task=None, path="t.jsonl").eval_datasets() == []


@pytest.mark.parametrize("value, match", [([], "empty list"), (["a.jsonl", "a.jsonl"], "lists 'a.jsonl' twice"),
                                          (["a.jsonl", " "], "item 1 is empty")])
def test_a_bad_list_is_refused(value, match):
    with pytest.raises(ValidationError, match=match):
        DataConfig(task=None, path="t.jsonl", eval_path=value)


def test_the_override_parser_reads_a_list():
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    recipe = ROOT / "recipes" / "arith_grpo.yaml"
    base = ["data.task=null", "data.path=t.jsonl", "reward.verifier=exact"]
    cfg = load_config(Config, recipe, [*base, "data.eval_path=[a.jsonl,b/c.jsonl]"])
    assert cfg.data.eval_path == ["a.jsonl", "b/c.jsonl"]
    cfg = load_config(Config, recipe, [*base, "data.eval_path=a.jsonl"])
    assert cfg.data.eval_path == "a.jsonl"
    assert cfg.model_dump(mode="json")["data"]["eval_path"] == "a.jsonl"  # a saved config as before


def test_a_parquet_data_source_column_is_read_and_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "gsm8k" / "test.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"], "data_source": ["openai/gsm8k", None],
                             "big": ["x", "y"]}), path)
    rows = load_problems(DataConfig(task=None, path="t.jsonl", eval_path=str(path)).dataset(held_out=True))
    assert rows[0].meta["fields"]["data_source"] == "openai/gsm8k"
    assert rows[0].meta["fields"]["big"] == "x"  # (every column, as a JSONL row's: a reward function's fields)
    assert source_names([p.meta for p in rows]) == ["openai/gsm8k", "test"]


def _session(tmp_path, tiny_dir, *over: str, lines=None):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.heldout import EvalSession

    train = _jsonl(tmp_path / "train.jsonl", 30)
    cfg = load_config(Config, ROOT / "recipes" / "arith_grpo.yaml",
                      ["data.task=null", f"data.path={train}", f"model.path={tiny_dir}", "reward.verifier=exact",
                       "run.threads=1", *over])
    return EvalSession(cfg, report_dir=tmp_path / "eval", log=(lines if lines is not None else []).append)


def test_each_set_gives_its_first_eval_size_rows(tmp_path, tiny_dir):
    a, b = _jsonl(tmp_path / "gsm8k" / "test.jsonl", 5), _jsonl(tmp_path / "math" / "test.jsonl", 2, start=100)
    s = _session(tmp_path, tiny_dir, f"data.eval_path=[{a},{b}]", "eval.size=3")
    assert [(p.meta["source"], p.meta["row"]) for p in s.eval_problems] == \
        [(str(a), 1), (str(a), 2), (str(a), 3), (str(b), 1), (str(b), 2)]
    assert len(s.train_problems) == 30  # nothing of the training file held out
    assert source_names([p.meta for p in s.eval_problems]) == ["gsm8k/test"] * 3 + ["math/test"] * 2
    # one path: as before
    assert len(_session(tmp_path, tiny_dir, f"data.eval_path={a}", "eval.size=3").eval_problems) == 3


def test_a_missing_file_names_its_key(tmp_path, tiny_dir):
    """data.path and data.eval_path both read "dataset file X does not exist": the message says which key."""
    a = _jsonl(tmp_path / "a.jsonl", 30)
    with pytest.raises(DatasetError, match=r"^data.eval_path=.*tset.jsonl: dataset file .*tset.jsonl does not exist$"):
        _session(tmp_path, tiny_dir, f"data.eval_path={tmp_path / 'tset.jsonl'}")
    with pytest.raises(DatasetError, match=r"^data.path=.*trian.jsonl: dataset file .*trian.jsonl does not exist$"):
        _session(tmp_path, tiny_dir, f"data.path={tmp_path / 'trian.jsonl'}", f"data.eval_path={a}")


def test_a_bad_path_in_the_list_is_named(tmp_path, tiny_dir):
    a = _jsonl(tmp_path / "a.jsonl", 3)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(DatasetError, match=r"data.eval_path item 1 \(.*b.jsonl\): .*b.jsonl row 2: field 'answer' "
                       r"is missing"):
        _session(tmp_path, tiny_dir, f"data.eval_path=[{a},{bad}]")
    with pytest.raises(DatasetError, match=r"data.eval_path item 0 \(.*nowhere.jsonl\): dataset file .*nowhere.jsonl "
                       r"does not exist"):
        _session(tmp_path, tiny_dir, f"data.eval_path=[{tmp_path / 'nowhere.jsonl'},{a}]")
