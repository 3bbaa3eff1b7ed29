"""data.task_options / data.eval_task_options without a built-in task (data.task=null) are refused, not ignored;
a layer that sets data.task=null over a recipe's task drops that task's options."""

import json

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config

DATA = ["data.task=null", "data.path=train.jsonl", "reward.verifier=exact"]


@pytest.mark.parametrize("key", ["data.task_options", "data.eval_task_options"])
def test_task_options_given_with_a_null_task_are_refused_naming_the_key_and_the_fix(key):
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, [*DATA, f"{key}={{min_digits: 3}}"])
    assert f"{key}={{'min_digits': 3}}" in str(e.value)
    assert "data.task is null" in str(e.value) and f"drop {key}" in str(e.value)


def test_options_given_before_the_task_is_nulled_are_refused_too():
    with pytest.raises(ConfigError, match="data.task_options"):
        load_config(Config, None, ["data.task_options={min_digits: 3}", *DATA])


def test_nulling_a_recipes_task_drops_that_tasks_options(tmp_path):
    cfg = load_config(Config, "recipes/arith_grpo.yaml", DATA)  # the recipe's arith options go with its task
    assert cfg.data.task is None and cfg.data.task_options == {} and cfg.data.eval_task_options is None
    base = tmp_path / "base.yaml"
    base.write_text("data:\n  task: arith\n  task_options: {min_digits: 2}\n  eval_task_options: {carries: inner}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\ndata:\n  task: null\n  path: train.jsonl\nreward:\n  verifier: exact\n")
    cfg = load_config(Config, child)
    assert cfg.data.task_options == {} and cfg.data.eval_task_options is None
    child.write_text("base: base.yaml\ndata:\n  task: null\n  path: train.jsonl\n  task_options: {max_digits: 3}\n")
    with pytest.raises(ConfigError, match="data.task_options"):
        load_config(Config, child)


def test_a_saved_run_config_from_before_keeps_loading(tmp_path):
    saved = json.loads(Config(**{"data": {"task": None, "path": "train.jsonl"},
                                 "reward": {"verifier": "exact"}}).model_dump_json())
    saved["data"]["task_options"] = {"min_digits": 2}  # what an older run wrote (never read)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved))
    assert load_config(Config, path).data.task_options == {}


def test_a_checkpoint_whose_null_task_kept_stale_options_resumes(tmp_path):
    from relayrl.checkpoint.format import CheckpointError
    from relayrl.checkpoint.rundir import check_fingerprint

    now = json.loads(load_config(Config, None, DATA).model_dump_json())
    old = json.loads(json.dumps(now))
    old["data"]["task_options"] = {"min_digits": 2}
    check_fingerprint(tmp_path, old, now)  # unread options of an older run: not a difference
    old["data"]["task"], now["data"]["task"] = "arith", "arith"
    with pytest.raises(CheckpointError, match="data.task_options"):
        check_fingerprint(tmp_path, old, now)
