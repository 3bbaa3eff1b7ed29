"""verl's, NeMo-RL's, OpenRLHF's and TRL's keys on a relayrl command line or in a recipe: refused, each naming
relayrl's key for it (docs/migrating.md)."""

import re

import pytest

from relayrl.cli.main import main
from relayrl.config.foreign_keys import frameworks
from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config


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


@pytest.mark.parametrize("fw", frameworks(), ids=lambda fw: fw.name)
def test_every_key_a_table_names_exists(fw):
    """Each relayrl key a hint names (the dotted words of its value) validates as a key of the config, and no
    key of the table is one of relayrl's."""
    from relayrl.config.loader import _fields_at

    for theirs, ours in fw.keys.items():
        for key in re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)\b", ours.split(" (")[0]):
            if key.startswith("docs"):
                continue
            assert key.split(".")[-1] in _fields_at(Config, tuple(key.split("."))), f"{theirs}: {key} is not a key"
        assert theirs.split(".")[-1] not in _fields_at(Config, tuple(theirs.split("."))), f"{theirs} is a key here"
    from relayrl.config.algorithm import ESTIMATORS

    assert set(fw.advantages.values()) <= set(ESTIMATORS)


def test_openrlhf_s_flag_names_as_overrides_name_relayrl_s():
    msg = _errors("n_samples_per_prompt=8", "rollout_batch_size=128", "init_kl_coef=0.01")
    assert "n_samples_per_prompt: unknown key; OpenRLHF's --n_samples_per_prompt 8 is rollout.n=8 here" in msg
    assert "rollout_batch_size: unknown key; OpenRLHF's --rollout_batch_size 128 is data.prompts_per_step=128 " \
           "here" in msg
    assert "init_kl_coef: unknown key; OpenRLHF's --init_kl_coef 0.01 is algorithm.kl_coef=0.01 here (OpenRLHF " \
           "puts it in the reward unless --use_kl_loss: algorithm.kl_in_reward=true)" in msg
    # a flag whose value means something else here gets the key only
    assert "micro_train_batch_size: unknown key; OpenRLHF's --micro_train_batch_size is engine.token_budget " \
           "here" in _errors("micro_train_batch_size=4")


def test_openrlhf_s_flags_on_the_command_line_name_relayrl_s(capsys):
    with pytest.raises(SystemExit):
        main(["train", "arith_grpo", "--n_samples_per_prompt", "8", "--advantage_estimator=reinforce_baseline"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --n_samples_per_prompt 8 --advantage_estimator=reinforce_baseline" in err
    assert "--n_samples_per_prompt: relayrl takes dotted overrides (section.key=value), not flags; OpenRLHF's " \
           "--n_samples_per_prompt 8 is rollout.n=8 here" in err
    assert "--advantage_estimator: relayrl takes dotted overrides (section.key=value), not flags; OpenRLHF's " \
           "--advantage_estimator reinforce_baseline is algorithm.advantage=reinforce++-baseline here" in err


def test_a_flag_s_value_is_named_only_when_it_is_one(capsys):
    """The next argument is a flag's value unless it is a flag or an override; a flag without one (the last,
    a boolean) is named by its key."""
    with pytest.raises(SystemExit):
        main(["train", "arith_grpo", "--temperature", "--seed", "3", "--bf16", "trainer.steps=1", "--top_p"])
    err = capsys.readouterr().err
    assert "OpenRLHF's --temperature is rollout.temperature here" in err
    assert "OpenRLHF's --seed 3 is run.seed=3 here" in err
    assert "OpenRLHF's --bf16 is model.dtype=bfloat16 here" in err and "--bf16 trainer.steps=1 is" not in err
    assert "OpenRLHF's --top_p is rollout.top_p here" in err


def test_openrlhf_s_same_value_flags_map_to_one_key():
    from relayrl.config.openrlhf_keys import OPENRLHF_KEYS, OPENRLHF_SAME_VALUES

    for flag in OPENRLHF_SAME_VALUES:
        ours = OPENRLHF_KEYS[flag].split(" (")[0]
        assert re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", ours), (flag, ours)  # one key, no value of its own


def test_trl_s_cli_flags_and_dotted_flags_name_the_override(capsys):
    """Old behaviour: ``--learning_rate 1e-6`` (TRL's CLI) and ``--trainer.steps=3`` were unrecognized arguments
    with no hint, and an override given before the recipe was read as a recipe's name."""
    with pytest.raises(SystemExit):
        main(["train", "arith_grpo", "--learning_rate", "3e-6", "--trainer.steps=3", "--rollout.n", "4"])
    err = capsys.readouterr().err
    assert "--learning_rate: relayrl takes dotted overrides (section.key=value), not flags; TRL's --learning_rate " \
           "3e-6 is engine.optim.lr=3e-6 here" in err
    assert "--trainer.steps: relayrl takes dotted overrides without dashes: trainer.steps=3" in err
    assert "--rollout.n: relayrl takes dotted overrides without dashes: rollout.n=4" in err
    assert main(["train", "trainer.steps=3", "arith_grpo"]) == 2
    assert "recipe trainer.steps=3: that is an override; the recipe comes first (relayrl train RECIPE " \
           "trainer.steps=3 ..." in capsys.readouterr().err


def test_an_unknown_flag_gets_no_hint(capsys):
    with pytest.raises(SystemExit):
        main(["train", "arith_grpo", "--no_such_flag"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no_such_flag" in err and "OpenRLHF" not in err


@pytest.mark.parametrize("theirs,ours", [("reinforce", "reinforce++"), ("reinforce_baseline", "reinforce++-baseline"),
                                         ("group_norm", "grpo"), ("dr_grpo", "drgrpo")])
def test_openrlhf_estimator_names_name_relayrl_s(theirs, ours):
    assert f"OpenRLHF's {theirs} is algorithm.advantage={ours}" in _errors(f"algorithm.advantage={theirs}")


def test_nemo_rl_overrides_name_relayrl_s_keys_in_their_sections_and_in_relayrl_s():
    msg = _errors("grpo.num_generations_per_prompt=8", "loss_fn.reference_policy_kl_penalty=0.01",
                  "cluster.gpus_per_node=8", "dpo.reference_policy_kl_penalty=0.05")
    assert "grpo.num_generations_per_prompt: unknown key; NeMo-RL's grpo.num_generations_per_prompt is rollout.n " \
           "here" in msg
    assert "loss_fn.reference_policy_kl_penalty: unknown key; NeMo-RL's loss_fn.reference_policy_kl_penalty is " \
           "algorithm.kl_coef here" in msg
    assert "cluster.gpus_per_node: unknown key; NeMo-RL's cluster.gpus_per_node is cluster.devices here" in msg
    assert "dpo.reference_policy_kl_penalty: unknown key; NeMo-RL's dpo.reference_policy_kl_penalty is dpo.beta" in msg


NEMO_RECIPE = """\
defaults: grpo_math_1B.yaml
grpo:
  num_prompts_per_step: 32
  num_generations_per_prompt: 16
  normalize_rewards: true
  use_leave_one_out_baseline: true
  async_grpo: {enabled: true, max_trajectory_age_steps: 1}
  no_such_key: 1
loss_fn:
  ratio_clip_min: 0.2
policy:
  train_global_batch_size: 512
  generation: {backend: vllm}
cluster:
  gpus_per_node: 8
"""


def test_a_nemo_rl_yaml_recipe_names_relayrl_s_key_for_each_of_its_keys(tmp_path):
    (tmp_path / "nemo.yaml").write_text(NEMO_RECIPE)
    with pytest.raises(ConfigError) as e:
        load_config(Config, str(tmp_path / "nemo.yaml"), [])
    msg = str(e.value)
    for theirs, ours in [("defaults", "base"), ("grpo.num_prompts_per_step", "data.prompts_per_step"),
                         ("grpo.num_generations_per_prompt", "rollout.n"),
                         ("grpo.normalize_rewards", "algorithm.normalize_std"),
                         ("grpo.use_leave_one_out_baseline", "algorithm.advantage=grpo-loo"),
                         ("grpo.async_grpo.max_trajectory_age_steps", "trainer.off_policy_steps"),
                         ("loss_fn.ratio_clip_min", "algorithm.clip_low"),
                         ("policy.train_global_batch_size", "trainer.mini_batches"),
                         ("policy.generation.backend", "rollout.engine"), ("cluster.gpus_per_node", "cluster.devices")]:
        assert f"{theirs}: unknown key; NeMo-RL's {theirs} is {ours} here" in msg, theirs
    assert "grpo.no_such_key: unknown key; no key of that name here; docs/migrating.md maps NeMo-RL's keys" in msg


def test_trl_s_names_alone_or_under_a_section_name_relayrl_s():
    """Old behaviour: TRL's names got the generic 'unknown key; valid keys here: ...' (num_generations=8), or a
    wrong close match (trainer.sync_ref_model: 'did you mean trainer.tri_model?')."""
    msg = _errors("num_generations=8", "max_completion_length=256", "learning_rate=1e-6", "num_train_epochs=1",
                  "beta=0.04", "trainer.sync_ref_model=true", "algorithm.scale_rewards=none")
    assert "num_generations: unknown key; TRL's num_generations 8 is rollout.n=8 here (docs/migrating.md)" in msg
    assert "max_completion_length: unknown key; TRL's max_completion_length 256 is rollout.max_new_tokens=256" in msg
    assert "learning_rate: unknown key; TRL's learning_rate 1e-6 is engine.optim.lr=1e-6 here" in msg
    assert "num_train_epochs: unknown key; TRL's num_train_epochs 1 is trainer.total_epochs=1 here" in msg
    assert "beta: unknown key; TRL's beta is algorithm.kl_coef here (GRPOConfig's; DPOConfig's" in msg
    assert "trainer.sync_ref_model: unknown key; TRL's sync_ref_model is trainer.ref_sync_every here" in msg
    assert "tri_model" not in msg
    assert "algorithm.scale_rewards: unknown key; TRL's scale_rewards is algorithm.normalize_std here" in msg
    with pytest.raises(ConfigError) as e:
        load_config(Config, "arith_dpo", ["dpo.loss_type=ipo", "dpo.rpo_alpha=1", "dpo.precompute_ref_log_probs=true"])
    msg = str(e.value)
    assert "dpo.loss_type: unknown key; TRL's loss_type is algorithm.loss_agg or algorithm.policy_loss here" in msg
    assert "DPOConfig's and CPOConfig's loss_type is dpo.kind" in msg
    assert "dpo.rpo_alpha: unknown key; TRL's rpo_alpha is dpo.nll_weight here" in msg
    assert "dpo.precompute_ref_log_probs: unknown key; TRL's precompute_ref_log_probs true is " \
           "trainer.precompute_ref=true here" in msg
    # a key under another framework's section is that framework's, whatever its last part
    assert "TRL" not in _errors("actor_rollout_ref.actor.no_such.weight_decay=0.1")


def test_trl_s_same_value_names_map_to_one_key():
    from relayrl.config.trl_keys import TRL_KEYS, TRL_SAME_VALUES

    assert TRL_SAME_VALUES <= TRL_KEYS.keys()
    for name in TRL_SAME_VALUES:
        ours = TRL_KEYS[name].split(" (")[0]
        assert re.fullmatch(r"[a-z_0-9]+(\.[a-z_0-9]+)+", ours), (name, ours)  # one key, no value of its own
