"""``algorithm.distill``: its weights are read only with a teacher. ``coef`` or ``reward_weight`` set without
``algorithm.distill.teacher`` was accepted and trained plain GRPO (nothing reads them): refused naming the key and
the fix, as ``algorithm.correction.high`` without a level is. A run's saved config (every key written) loads
again, its keys at their defaults unset first."""

from __future__ import annotations

import json

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config


@pytest.mark.parametrize("key", ["coef=0.5", "reward_weight=0.5"])
def test_a_distillation_weight_without_a_teacher_is_refused_naming_it(key):
    with pytest.raises(ConfigError) as e:
        load_config(Config, "arith_grpo", [f"algorithm.distill.{key}"])
    name = key.split("=")[0]
    assert f"algorithm.distill.{name} weighs on-policy distillation's advantages, which algorithm.distill.teacher " \
           f"turns on (it is null: no distillation): set algorithm.distill.teacher=MODEL_DIR or drop " \
           f"algorithm.distill.{name}" in str(e.value)


def test_with_a_teacher_the_weights_are_taken(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(Config, "arith_grpo", [f"algorithm.distill.teacher={tmp_path}", "algorithm.distill.coef=0.5",
                                             "algorithm.distill.reward_weight=0.25"])
    assert (cfg.algorithm.distill.coef, cfg.algorithm.distill.reward_weight) == (0.5, 0.25)
    assert cfg.algorithm.distill.enabled


def test_a_saved_config_without_distillation_loads_again(tmp_path):
    saved = tmp_path / "config.json"  # (a run's dump: every key, distill's coef and reward_weight included)
    saved.write_text(json.dumps(load_config(Config, "arith_grpo").model_dump(mode="json")))
    again = load_config(Config, saved)
    assert again.algorithm.distill.teacher is None and again.algorithm.distill.coef == 1.0
