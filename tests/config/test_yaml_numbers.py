"""Numbers in recipes and overrides as YAML 1.2 reads them (PyYAML follows YAML 1.1: ``010`` is octal 8,
``1:30`` is base-60 90)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config.loader import ConfigError, apply_overrides, load_config
from relayrl.config.schema import Config

SFT = Path(__file__).resolve().parents[2] / "recipes" / "arith_sft.yaml"


@pytest.mark.parametrize("raw, steps", [("010", 10), ("-0", 0), ("0", 0), ("1_000", 1000), ("0x10", 16)])
def test_a_leading_zero_is_decimal_in_an_override(raw, steps):
    """``trainer.steps=010`` ran 8 steps (YAML 1.1's octal)."""
    assert load_config(Config, SFT, [f"trainer.steps={raw}"]).trainer.steps == steps


def test_a_leading_zero_is_decimal_in_a_recipe_and_text_stays_as_written(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {SFT}\ntrainer: {{steps: 010}}\nrun: {{dir: 010}}\n")
    cfg = load_config(Config, recipe, [])
    assert cfg.trainer.steps == 10 and str(cfg.run.dir).endswith("010")
    assert apply_overrides({}, ["run.dir=007"]) == {"run": {"dir": "007"}}


@pytest.mark.parametrize("raw", ["1:30", "1:30.5"])
def test_base_60_numbers_are_refused_naming_the_key(raw):
    """``trainer.steps=1:30`` ran 90 steps (YAML 1.1's base 60)."""
    with pytest.raises(ConfigError, match=rf"trainer.steps: .*\(got '{raw}'\)"):
        load_config(Config, SFT, [f"trainer.steps={raw}"])
