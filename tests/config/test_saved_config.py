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
