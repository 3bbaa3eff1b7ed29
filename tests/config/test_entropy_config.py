"""The adaptive entropy coefficient's bounds (``algorithm.entropy_coef_min``, ``_max``) in the wrong order are
refused as such; before, the message blamed ``algorithm.entropy_coef`` for lying outside ``[0.5, 0.1]``. A start
outside ordered bounds is still refused naming ``entropy_coef``."""

from __future__ import annotations

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config

ADAPTIVE = "algorithm.entropy_target=0.2"


def _error(*over: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(Config, "arith_grpo", [ADAPTIVE, *over])
    return str(e.value)


def test_bounds_in_the_wrong_order_are_named():
    said = _error("algorithm.entropy_coef_min=0.5", "algorithm.entropy_coef_max=0.1")
    assert "algorithm.entropy_coef_min=0.5 is above algorithm.entropy_coef_max=0.1" in said
    assert "set entropy_coef_min <= entropy_coef_max" in said


def test_a_start_outside_ordered_bounds_names_the_start():
    said = _error("algorithm.entropy_coef=2")
    assert "algorithm.entropy_coef=2.0 starts the adaptive coefficient outside [entropy_coef_min, " \
           "entropy_coef_max] = [0.0, 1.0]" in said


def test_ordered_bounds_around_the_start_are_taken():
    cfg = load_config(Config, "arith_grpo", [ADAPTIVE, "algorithm.entropy_coef=0.01", "algorithm.entropy_coef_min=0.0",
                                             "algorithm.entropy_coef_max=0.05"])
    assert (cfg.algorithm.entropy_coef_min, cfg.algorithm.entropy_coef_max) == (0.0, 0.05)
