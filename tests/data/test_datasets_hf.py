"""Hugging Face ``datasets`` as a data source: save_to_disk directories, Arrow files, dataset names read from
the cache offline; the same row checks as JSONL. Every dataset is built here (nothing downloaded)."""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

datasets = pytest.importorskip("datasets")

from relayrl.data.config import DataConfig  # noqa: E402
from relayrl.data.datasets import DatasetConfig, DatasetError, encode_prompt, load_problems  # noqa: E402

GSM8K = {"question": ["Tom has 3 apples and buys 4. How many?", "Ann has 1,000 coins and spends 1. Left?"],
         "answer": ["3 + 4 = 7\n#### 7", "1000 - 1 = 999\n#### 999"]}
MATH = {"problem": ["What is $1/2 + 1/4$?", "Solve $x + 1 = 3$."],
        "solution": ["Add: $\\frac{1}{2} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.", "So $x = \\boxed{2}$."]}


def test_save_to_disk_directory_reads_like_jsonl(tmp_path):
    datasets.Dataset.from_dict(GSM8K).save_to_disk(tmp_path / "gsm8k")
    problems = load_problems(DatasetConfig(path=tmp_path / "gsm8k", prompt_key="question",
                                           answer_key="answer", answer_regex=r"####\s*(.+)$"))
    assert [p.answer for p in problems] == ["7", "999"]
    assert [p.meta["row"] for p in problems] == [1, 2]
    assert problems[0].prompt == GSM8K["question"][0]


def test_dataset_dict_directory_picks_the_split(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(MATH),
                               "test": datasets.Dataset.from_dict({k: v[:1] for k, v in MATH.items()})})
    dd.save_to_disk(tmp_path / "math")
    cfg = dict(path=tmp_path / "math", prompt_key="problem", answer_key="solution")
    assert len(load_problems(DatasetConfig(**cfg))) == 2
    (p,) = load_problems(DatasetConfig(**cfg, split="test"))
    assert "boxed" in p.answer  # the math verifier takes the last \boxed{} of a gold solution
    with pytest.raises(DatasetError, match=r"splits train, test, not 'validation': set data.hf_split"):
        load_problems(DatasetConfig(**cfg, split="validation"))


def test_arrow_files_both_layouts(tmp_path):
    import pyarrow as pa

    datasets.Dataset.from_dict(GSM8K).save_to_disk(tmp_path / "d")
    (stream,) = glob.glob(str(tmp_path / "d" / "*.arrow"))  # datasets' own (streaming) layout
    shutil.copy(stream, tmp_path / "train.arrow")
    table = pa.table(GSM8K)
    with pa.ipc.new_file(tmp_path / "file.arrow", table.schema) as w:  # Arrow's random-access file layout
        w.write_table(table)
    for name in ("train.arrow", "file.arrow"):
        problems = load_problems(DatasetConfig(path=tmp_path / name, prompt_key="question", answer_regex=r"####\s*(\S+)"))
        assert [p.answer for p in problems] == ["7", "999"], name
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(DatasetError, match="junk.arrow: not a readable Arrow file"):
        load_problems(DatasetConfig(path=tmp_path / "junk.arrow"))


def test_row_errors_name_the_row(tmp_path):
    rows = {"question": ["a?", "b?", "c?"], "answer": ["#### 1", None, "no marker here"]}
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "bad")
    with pytest.raises(DatasetError) as e:
        load_problems(DatasetConfig(path=tmp_path / "bad", prompt_key="question", answer_regex=r"####\s*(.+)$"))
    msg = str(e.value)
    assert "2 bad rows" in msg
    assert "bad row 2: field 'answer' is null" in msg
    assert "bad row 3: field 'answer' ('no marker here') has no match for answer_regex" in msg


def test_missing_field_names_the_row_and_the_columns(tmp_path):
    datasets.Dataset.from_dict(MATH).save_to_disk(tmp_path / "math")
    with pytest.raises(DatasetError, match=r"math row 1: field 'answer' is missing \(columns present: problem, "
                                           r"solution\)"):
        load_problems(DatasetConfig(path=tmp_path / "math", prompt_key="problem"))


def test_not_a_datasets_directory(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match="nor a directory datasets' save_to_disk wrote"):
        load_problems(DatasetConfig(path=tmp_path / "plain"))


def test_system_prompt_makes_chat_messages(tmp_path, tiny_tokenizer):
    datasets.Dataset.from_dict(MATH).save_to_disk(tmp_path / "math")
    system = "Please reason step by step, and put your final answer within \\boxed{}."
    (p, _) = load_problems(DatasetConfig(path=tmp_path / "math", prompt_key="problem", answer_key="solution",
                                         system_prompt=system))
    assert p.meta["messages"] == [{"role": "system", "content": system}, {"role": "user", "content": MATH["problem"][0]}]
    text = tiny_tokenizer.decode(encode_prompt(tiny_tokenizer, p))
    assert text.index(system) < text.index(MATH["problem"][0])
    assert text.rstrip().endswith("assistant")  # the template's generation prompt


def _cache_as_hub_dataset(tmp_path: Path, name: str, config: str) -> Path:
    """Lay out a datasets cache that holds ``name`` (config ``config``) as load_dataset leaves a hub dataset
    behind: ``<cache>/<org>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow`` plus its info."""
    src = tmp_path / "src"
    src.mkdir()
    for split, rows in (("train", GSM8K), ("test", {k: v[:1] for k, v in GSM8K.items()})):
        datasets.Dataset.from_dict(rows).to_parquet(src / f"{split}.parquet")
    datasets.load_dataset("parquet", data_files={s: str(src / f"{s}.parquet") for s in ("train", "test")},
                          cache_dir=str(tmp_path / "build"))
    (built,) = [d for d in glob.glob(str(tmp_path / "build" / "parquet" / "*" / "*" / "*")) if Path(d).is_dir()]
    org, short = name.split("/")
    cache = tmp_path / "cache"
    dst = cache / f"{org}___{short}" / config / "0.0.0" / Path(built).name
    shutil.copytree(built, dst)
    for f in dst.glob("parquet-*.arrow"):
        f.rename(f.with_name(f.name.replace("parquet-", f"{short}-")))
    info = json.loads((dst / "dataset_info.json").read_text())
    (dst / "dataset_info.json").write_text(json.dumps({**info, "config_name": config}))
    return cache


def test_dataset_name_is_read_from_the_cache_without_network(tmp_path, monkeypatch):
    cache = _cache_as_hub_dataset(tmp_path, "local/gsm8k", "main")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # (nothing listens: any hub request would fail)
    cfg = DataConfig(task=None, hf_name="local/gsm8k", hf_config="main", hf_eval_split="test", prompt_key="question",
                     answer_regex=r"####\s*(.+)$")
    train = load_problems(cfg.dataset())
    held = load_problems(cfg.dataset(held_out=True))
    assert [p.answer for p in train] == ["7", "999"] and [p.answer for p in held] == ["7"]
    assert not datasets.config.HF_HUB_OFFLINE  # offline mode was for the cache lookup only
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 sets it
    with pytest.raises(DatasetError, match=r"data.hf_name=local/missing: not found in the datasets cache .* offline"):
        load_problems(DataConfig(task=None, hf_name="local/missing").dataset())


def test_dataset_name_may_be_a_local_directory_of_files(tmp_path):
    (tmp_path / "gsm").mkdir()
    datasets.Dataset.from_dict(GSM8K).to_json(tmp_path / "gsm" / "train.jsonl")
    cfg = DataConfig(task=None, hf_name=str(tmp_path / "gsm"), prompt_key="question", answer_regex=r"####\s*(.+)$")
    assert [p.answer for p in load_problems(cfg.dataset())] == ["7", "999"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(hf_name="openai/gsm8k"), "data.task and data.hf_name are both set; set data.task=null"),
    # old behaviour: the reward.verifier the dataset needs came as a second error once data.task=null was set
    (dict(path="a.jsonl"), "set data.task=null to train on data.path and, unless the recipe sets another, a "
                           "reward.verifier for the rows (math, exact or user"),
    (dict(task=None, path="a.jsonl", hf_name="openai/gsm8k"), "data.path and data.hf_name are both set"),
    (dict(task=None, hf_name="x", hf_eval_split="test", eval_path="e.jsonl"), "set one to null"),
    (dict(task=None, path="a.jsonl", answer_regex="####(("), "data.answer_regex='####((' is not a regular"),
])
def test_data_section_checks(kwargs, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(".", r"\.")):
        DataConfig(**kwargs)


def test_without_the_datasets_package_a_run_is_refused_with_the_install_line(tmp_path, monkeypatch):
    """``data.hf_name`` is refused when the config loads; a save_to_disk directory when it is opened. Both name
    the extra to install (no ModuleNotFoundError traceback)."""
    datasets.Dataset.from_dict(GSM8K).save_to_disk(tmp_path / "gsm8k")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # as if it were not installed
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(ValidationError, match=r"data.hf_name='openai/gsm8k' is read with Hugging Face datasets.*"
                                              r"pip install 'relayrl\[datasets\]'"):
        DataConfig(task=None, hf_name="openai/gsm8k")
    with pytest.raises(DatasetError, match=r"dataset path .*gsm8k is read with Hugging Face datasets.*relayrl\[datasets\]"):
        load_problems(DatasetConfig(path=tmp_path / "gsm8k", prompt_key="question", answer_key="answer"))
