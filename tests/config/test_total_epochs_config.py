"""``trainer.total_epochs``: the step count it resolves to (a pure function), the rows a step takes per workflow,
and the configs it refuses (with trainer.steps, on a built-in task, zero or negative)."""

from __future__ import annotations

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config, TrainerConfig
from relayrl.config.trainer import epoch_steps, resolve_total_epochs, rows_per_step

DATA = ["data.task=null", "data.path=train.jsonl", "reward.verifier=exact"]


def test_epoch_steps_round_up_so_the_last_step_finishes_the_last_pass():
    assert epoch_steps(3, 7473, 64) == 351  # 22,419 rows / 64 = 350.3 (verl's GSM8K at 64 prompts a step)
    assert epoch_steps(1, 64, 64) == 1 and epoch_steps(2, 64, 64) == 2  # exact passes: no extra step
    assert epoch_steps(1, 65, 64) == 2
    assert epoch_steps(1, 5, 8) == 1  # a dataset smaller than a step: one step
    assert epoch_steps(1.5, 10, 4) == 4  # 15 rows
    assert epoch_steps(0.1, 30, 3) == 1  # 0.1 read as the decimal it prints as (float: 1.0000000000000002)
    assert epoch_steps(2.5, 26, 8) == 9  # 65 rows / 8 = 8.1
    for bad in ((0, 10, 2), (1, 0, 2), (1, 10, 0), (-1, 10, 2)):
        with pytest.raises(ValueError):
            epoch_steps(*bad)


def test_a_step_takes_prompts_per_step_in_grpo_and_batch_size_offline():
    cfg = load_config(Config, None, [*DATA, "trainer.total_epochs=2", "data.prompts_per_step=16"])
    assert rows_per_step(cfg) == (16, "data.prompts_per_step")
    for workflow in ("sft", "kto"):  # (each workflow refuses the other's key: a step takes only its own)
        off = load_config(Config, None, [*DATA, "trainer.total_epochs=2", f"workflow={workflow}",
                                         "trainer.batch_size=32"])
        assert rows_per_step(off) == (32, "trainer.batch_size")


def test_resolving_sets_the_steps_and_records_them_in_a_config_that_loads_again():
    cfg = load_config(Config, None, [*DATA, "trainer.total_epochs=3", "data.prompts_per_step=64"])
    out, line = resolve_total_epochs(cfg, 7473)
    assert line == "trainer.total_epochs=3 over 7,473 rows at 64 a step (data.prompts_per_step): 351 steps"
    assert out.trainer.steps == 351 and out.trainer.total_epochs is None
    assert cfg.trainer.steps == 100 and cfg.trainer.total_epochs == 3  # the given config is not changed
    # the section as config.json and checkpoints hold it (every key) reads back
    assert TrainerConfig.model_validate(out.trainer.model_dump(mode="json")).steps == 351
    plain = load_config(Config, None, ["trainer.steps=7"])
    assert resolve_total_epochs(plain, 100) == (plain, None)
    _, line = resolve_total_epochs(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(
        update={"total_epochs": 0.25})}), 4)
    assert line.endswith(": 1 step")


def test_steps_and_total_epochs_together_are_refused_naming_both():
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, [*DATA, "trainer.steps=50", "trainer.total_epochs=2"])
    assert "trainer.steps=50 and trainer.total_epochs=2 both set the run's length" in str(e.value)
    # a recipe's steps give way with trainer.steps=null
    with pytest.raises(ConfigError, match="trainer.steps=150 and trainer.total_epochs=1.5"):
        load_config(Config, "recipes/arith_sft.yaml", [*DATA, "trainer.total_epochs=1.5"])
    cfg = load_config(Config, "recipes/arith_sft.yaml", [*DATA, "trainer.total_epochs=1.5", "trainer.steps=null"])
    assert cfg.trainer.total_epochs == 1.5 and "steps" not in cfg.trainer.model_fields_set
    with pytest.raises(ValueError, match="both set the run's length"):  # an assignment in Python too
        cfg.trainer.steps = 10
    # without trainer.total_epochs, null would run the default length nobody asked for
    with pytest.raises(ValueError, match="trainer.total_epochs is not set .the run would take the default 100 steps"):
        TrainerConfig(steps=None)
    with pytest.raises(ConfigError, match="give trainer.steps=N or trainer.total_epochs=E"):
        load_config(Config, "recipes/arith_sft.yaml", ["trainer.steps=null"])


def test_a_key_given_null_says_what_yaml_reads_as_null():
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, ["run.dir=~"])
    assert "run.dir: " in str(e.value) and "got null" in str(e.value) and "~" in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="trainer.batch_size: .*got null"):
        load_config(Config, None, ["trainer.batch_size=null"])


def test_a_built_in_task_has_no_epochs():
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, ["trainer.total_epochs=2"])
    msg = str(e.value)
    assert "trainer.total_epochs=2 counts passes over a training dataset, and data.task=arith draws problems " \
           "without end" in msg and "data.path" in msg and "trainer.steps" in msg, msg


@pytest.mark.parametrize("value,words", [("0", "greater than 0"), ("-1", "greater than 0"), (".inf", "finite"),
                                         ("true", "not a boolean"), ("two", "valid number")])
def test_zero_negative_infinite_and_non_numbers_are_refused(value, words):
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, [*DATA, f"trainer.total_epochs={value}"])
    assert "trainer.total_epochs" in str(e.value) and words in str(e.value), str(e.value)


def test_max_rows_and_shuffle_pick_and_order_the_rows():
    """data.max_rows (verl's train_max_samples): a seeded subset in file order, or the first rows with
    data.shuffle=false; data.shuffle=false walks the rows in the file's order every epoch."""
    from relayrl.workflows.problems import first_rows
    from relayrl.workflows.session import PromptSource

    rows = list(range(10))
    assert first_rows(rows, 20, seed=0, shuffle=True) == (rows, None)
    kept, line = first_rows(rows, 4, seed=3, shuffle=True)
    assert len(kept) == 4 and kept == sorted(kept) and kept != [0, 1, 2, 3]
    assert kept == first_rows(rows, 4, seed=3, shuffle=True)[0] != first_rows(rows, 4, seed=4, shuffle=True)[0]
    assert line == "data.max_rows=4: training on 4 of 10 rows, drawn with run.seed"
    assert first_rows(rows, 4, seed=3, shuffle=False)[0] == [0, 1, 2, 3]
    from relayrl.data.tasks import Problem

    problems = [Problem(str(i), str(i)) for i in range(5)]
    walked = [p.prompt for p in PromptSource(0, problems=problems, shuffle=False).take(12)]
    assert walked == [str(i % 5) for i in range(12)]
    shuffled = [p.prompt for p in PromptSource(0, problems=problems).take(5)]
    assert sorted(shuffled) == [str(i) for i in range(5)] and shuffled != [str(i) for i in range(5)]


def test_max_rows_and_shuffle_need_a_dataset():
    for over, msg in ((["data.max_rows=10"], "data.max_rows=10 picks"), (["data.shuffle=false"], "data.shuffle=false")):
        with pytest.raises(ConfigError, match=msg):
            load_config(Config, "recipes/arith_grpo.yaml", over)
