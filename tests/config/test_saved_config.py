"""A run's saved config (``RUN_DIR/config.json``, every key at the value it ran with, defaults included) loads
again as a recipe: its keys at their defaults are read as unset, so the checks that refuse a key nothing reads
(``rollout.interrupt.answer_tokens`` without ``after_tokens``) see the keys the run set."""

import json
from pathlib import Path

import pytest

from relayrl.config.loader import ConfigError, load_config, load_run_config
from relayrl.config.schema import Config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _save(cfg: Config, path: Path) -> Path:
    path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")  # (as a run writes it)
    return path


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_a_saved_config_loads_again_as_it_was(name, tmp_path, monkeypatch):
    from relayrl.config import schema

    counted = schema.available_devices  # (a GPU recipe validates on any machine, as in test_loader.py)
    monkeypatch.setattr(schema, "available_devices",
                        lambda cfg: ("GPU", 0) if counted(cfg)[0] == "GPU" else counted(cfg))
    cfg = load_config(Config, RECIPES / name, [])
    again = load_config(Config, _save(cfg, tmp_path / "config.json"), [])
    assert again == cfg and again.model_dump(mode="json") == cfg.model_dump(mode="json")
    twice = load_config(Config, _save(again, tmp_path / "again.json"), [])
    assert (tmp_path / "again.json").read_text() == (tmp_path / "config.json").read_text() and twice == cfg


def test_a_saved_config_still_refuses_what_nothing_reads(tmp_path):
    """Only the defaults the dump lists are unset again: a key nothing reads, at another value (an edited file,
    or an override), is refused naming it, as in a recipe."""
    saved = _save(Config(), tmp_path / "config.json")
    with pytest.raises(ConfigError, match="rollout.interrupt.answer_tokens is read only with"):
        load_run_config(saved, ["rollout.interrupt.answer_tokens=8"])
    data = json.loads(saved.read_text())
    data["kto"]["desirable_weight"] = 2.0
    saved.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="kto.desirable_weight is read by workflow kto only"):
        load_run_config(saved)
    assert load_run_config(saved, ["workflow=kto", "data.task=arith"]).kto.desirable_weight == 2.0


def test_a_recipe_is_read_as_written(tmp_path):
    """A recipe that is not a run's saved config keeps every key it writes, at its default too: an unread key is
    refused there as before."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rollout:\n  interrupt:\n    answer_tokens: null\n")
    with pytest.raises(ConfigError, match="rollout.interrupt.answer_tokens is read only with"):
        load_run_config(recipe)


def test_the_keys_that_mark_a_saved_config_are_the_run_directorys():
    from relayrl.checkpoint.rundir import RUN_CONFIG_KEYS
    from relayrl.config.loader import SAVED_RUN_KEYS

    assert SAVED_RUN_KEYS == RUN_CONFIG_KEYS


def test_a_json_recipe_is_read_as_json(tmp_path):
    """YAML reads JSON's ``1e-05`` as a string (its floats need a dot): a ``.json`` recipe is parsed as JSON, and a
    key written twice is refused as in YAML."""
    from relayrl.config.loader import load_recipe_dict

    recipe = tmp_path / "r.json"
    recipe.write_text('{"engine": {"optim": {"lr": 1e-05, "eps": 1e-08}}}')
    assert load_recipe_dict(recipe) == {"engine": {"optim": {"lr": 1e-05, "eps": 1e-08}}}
    recipe.write_text('{"trainer": {"steps": 2, "steps": 3}}')
    with pytest.raises(ConfigError, match="key 'steps' is written twice"):
        load_recipe_dict(recipe)
    recipe.write_text('{"trainer": ')
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_recipe_dict(recipe)


def test_a_saved_config_names_its_local_paths_absolute(tmp_path, monkeypatch):
    """Old behaviour: RUN_DIR/config.json kept data.path (and every other local path) as given, relative to where
    the run started, so `relayrl eval --recipe RUN/config.json` from another directory failed with 'dataset file
    data/x.jsonl does not exist'."""
    from types import SimpleNamespace

    from relayrl.config.paths import absolute_paths
    from relayrl.workflows.session import Session

    here = tmp_path / "here"
    (here / "data").mkdir(parents=True)
    (here / "models" / "sft").mkdir(parents=True)
    for name in ("train.jsonl", "a.jsonl", "b.jsonl"):
        (here / "data" / name).write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (here / "tpl.jinja").write_text("{{ messages[0]['content'] }}")
    (here / "runs" / "x").mkdir(parents=True)
    monkeypatch.chdir(here)
    cfg = load_run_config(None, ["data.task=null", "data.path=data/train.jsonl", "reward.verifier=exact",
                                 "data.eval_path=[data/a.jsonl, data/b.jsonl]", "trainer.init_from=models/sft",
                                 "model.chat_template=tpl.jinja", "run.dir=runs/x", "reward.model=Org/hub-name"])
    record = Session.config_record(SimpleNamespace(cfg=cfg))  # what the run writes to RUN_DIR/config.json
    assert record["data"]["path"] == str(here / "data" / "train.jsonl")
    assert record["data"]["eval_path"] == [str(here / "data" / "a.jsonl"), str(here / "data" / "b.jsonl")]
    assert record["trainer"]["init_from"] == str(here / "models" / "sft")
    assert record["model"]["chat_template"] == str(here / "tpl.jinja") and record["run"]["dir"] == str(here / "runs/x")
    # a hub name, a template's own text, run.resume=auto and a path that does not exist stay as written
    assert record["reward"]["model"] == "Org/hub-name" and record["run"]["resume"] == "never"
    assert absolute_paths({"model": {"chat_template": "{{ x }}"}, "run": {"resume": "auto"}, "data": {"path": "no.jsonl"}},
                          here) == {"model": {"chat_template": "{{ x }}"}, "run": {"resume": "auto"},
                                    "data": {"path": "no.jsonl"}}
    assert cfg.data.path == "data/train.jsonl"  # (the config itself is not changed)
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)  # another directory: the saved config still names the same files
    again = load_run_config(saved)
    assert Path(again.data.path).is_file() and all(Path(p).is_file() for p in again.data.eval_path)


@pytest.mark.parametrize("name", ["arith_grpo.yaml", "arith_dpo.yaml", "toolsum_grpo.yaml"])
def test_the_printed_config_is_the_config_and_a_recipe_of_its_own(name, tmp_path, capsys):
    """``relayrl train RECIPE --print-config``: every key as YAML (and the step's plan), nothing started; the
    printout loads again as a recipe with the same values (old behaviour: no way to see the resolved config
    before a run but to start one and read its config.json)."""
    from relayrl.cli import main as cli

    assert cli.main(["train", str(RECIPES / name), "trainer.steps=3", f"run.dir={tmp_path / 'run'}",
                     "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert not (tmp_path / "run").exists()
    cfg = load_config(Config, RECIPES / name, ["trainer.steps=3", f"run.dir={tmp_path / 'run'}"])
    assert printed.startswith("# step: sync, advantage=") == (cfg.workflow == "grpo")
    assert "\n  max_new_tokens: " in printed and "\ntrainer:\n  steps: 3\n" in printed
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_config(Config, tmp_path / "printed.yaml", []) == cfg
    # a recipe that lists some sections keeps its keys set (the checks still see what it sets)
    (tmp_path / "part.yaml").write_text("workflow: sft\nalgorithm: {clip_high: 0.28}\n")
    with pytest.raises(ConfigError, match="algorithm.clip_high is read by workflow grpo only"):
        load_config(Config, tmp_path / "part.yaml", [])
