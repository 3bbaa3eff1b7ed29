"""verl's keys on a relayrl command line: refused, each naming relayrl's key for it (docs/migrating.md)."""

import re

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config
from relayrl.config.verl_keys import VERL_ADVANTAGES, VERL_KEYS


def _errors(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(Config, "arith_grpo", list(overrides))
    return str(e.value)


def test_the_verl_example_command_names_each_relayrl_key():
    msg = _errors("data.train_batch_size=1024", "data.max_response_length=1024", "algorithm.adv_estimator=grpo",
                  "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.kl_loss_coef=0.001",
                  "actor_rollout_ref.hybrid_engine=true", "trainer.save_freq=20")
    assert "data.train_batch_size: unknown key; verl's data.train_batch_size is data.prompts_per_step" in msg
    assert "data.max_response_length: unknown key; verl's data.max_response_length is rollout.max_new_tokens" in msg
    assert "algorithm.adv_estimator: unknown key; verl's algorithm.adv_estimator is algorithm.advantage" in msg
    assert "actor_rollout_ref.rollout.n: unknown key; verl's actor_rollout_ref.rollout.n is rollout.n" in msg
    assert "actor_rollout_ref.actor.kl_loss_coef: unknown key; verl's actor_rollout_ref.actor.kl_loss_coef is " \
           "algorithm.kl_coef" in msg
    assert "actor_rollout_ref.hybrid_engine: unknown key; no key of that name here; docs/migrating.md" in msg
    assert "trainer.save_freq: unknown key; verl's trainer.save_freq is run.save_every" in msg


def test_a_typo_of_relayrl_s_own_key_still_gets_the_close_one():
    assert "trainer.stepz: unknown key; did you mean trainer.steps?" in _errors("trainer.stepz=3")


def test_verl_s_top_k_of_minus_one_names_relayrl_s_off():
    assert "rollout.top_k: -1 is how verl and vLLM turn top-k off; relayrl's off is rollout.top_k=0" in \
        _errors("rollout.top_k=-1")
    assert "rollout.top_k: Input should be greater than or equal to 0" in _errors("rollout.top_k=-2")


def test_verl_estimator_names_name_relayrl_s():
    msg = _errors("algorithm.advantage=reinforce_plus_plus")
    assert "verl's reinforce_plus_plus is algorithm.advantage=reinforce++" in msg


def test_every_key_the_table_names_exists():
    """Each relayrl key a hint names (the dotted words of its value) validates as a key of the config."""
    from relayrl.config.loader import _fields_at

    for verl, ours in VERL_KEYS.items():
        for key in re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)\b", ours.split(" (")[0]):
            if key.startswith("docs"):
                continue
            assert key.split(".")[-1] in _fields_at(Config, tuple(key.split("."))), f"{verl}: {key} is not a key"
        assert verl.split(".")[-1] not in _fields_at(Config, tuple(verl.split("."))), f"{verl} is a key here"
    from relayrl.config.algorithm import ESTIMATORS

    assert set(VERL_ADVANTAGES.values()) <= set(ESTIMATORS)
