"""``data.retire_solved``: a pass rate in (0, 1] or null (the default), for workflow grpo on a dataset; a built-in
task and the other workflows are refused naming the key. ``data.retire_score``: the score a response is solved
from, any finite number, 1.0 by default."""

from __future__ import annotations

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config

DATA = ["data.task=null", "data.path=train.jsonl", "reward.verifier=exact"]


def test_off_by_default_and_a_pass_rate_in_zero_to_one_is_taken():
    assert load_config(Config, None, DATA).data.retire_solved is None
    assert load_config(Config, None, [*DATA, "data.retire_solved=0.9"]).data.retire_solved == 0.9
    assert load_config(Config, None, [*DATA, "data.retire_solved=1"]).data.retire_solved == 1.0
    assert load_config(Config, "recipes/arith_grpo.yaml", [*DATA, "data.retire_solved=null"]).data.retire_solved is None


@pytest.mark.parametrize("value,words", [("0", "greater than 0"), ("-0.5", "greater than 0"),
                                         ("1.5", "less than or equal to 1"), ("high", "valid number")])
def test_a_pass_rate_outside_zero_to_one_is_refused(value, words):
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, [*DATA, f"data.retire_solved={value}"])
    assert "data.retire_solved" in str(e.value) and words in str(e.value), str(e.value)


def test_a_built_in_task_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(Config, "recipes/arith_grpo.yaml", ["data.retire_solved=0.9"])
    msg = str(e.value)
    assert "data.retire_solved=0.9 retires the rows of a dataset (data.path or data.hf_name) once solved; the " \
           "built-in task data.task='arith' draws fresh prompts without end: drop data.retire_solved" in msg, msg


@pytest.mark.parametrize("recipe,workflow", [("arith_sft.yaml", "sft"), ("arith_dpo.yaml", "dpo"),
                                             ("arith_kto.yaml", "kto"), ("arith_rm.yaml", "rm")])
def test_workflows_that_sample_no_responses_are_refused(recipe, workflow):
    data = DATA if workflow != "rm" else DATA[:2]  # (workflow rm scores nothing: it needs no reward.verifier, refuses one)
    with pytest.raises(ConfigError) as e:
        load_config(Config, f"recipes/{recipe}", [*data, "data.retire_solved=0.9"])
    msg = str(e.value)
    assert f"data.retire_solved=0.9 retires a prompt once the responses a GRPO step samples to it are solved; " \
           f"workflow {workflow} samples none: drop data.retire_solved" in msg, msg


def test_the_solved_score_defaults_to_one_and_takes_any_finite_score():
    assert load_config(Config, None, DATA).data.retire_score == 1.0
    for value, want in [("0.5", 0.5), ("-2", -2.0), ("3", 3.0), ("0", 0.0)]:
        cfg = load_config(Config, None, [*DATA, "data.retire_solved=0.9", f"data.retire_score={value}"])
        assert cfg.data.retire_score == want


@pytest.mark.parametrize("value,words", [("nan", "finite number"), ("inf", "finite number"),
                                         ("high", "valid number"), ("null", "valid number")])
def test_a_solved_score_that_is_not_a_finite_number_is_refused(value, words):
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, [*DATA, "data.retire_solved=0.9", f"data.retire_score={value}"])
    assert "data.retire_score" in str(e.value) and words in str(e.value), str(e.value)
