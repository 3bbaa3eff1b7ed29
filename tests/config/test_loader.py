"""Recipes, overrides and validation: every error names the key path and the fix."""

from pathlib import Path

import pytest

from relayrl.config.loader import SHIPPED, ConfigError, apply_overrides, load_config, resolve_recipe
from relayrl.config.schema import Config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _errors(*overrides, recipe=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(Config, recipe, list(overrides))
    return str(e.value)


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_shipped_recipe_validates(name, monkeypatch):
    """On any machine: the GPUs of this one do not count (a two-GPU recipe validates where there is one)."""
    from relayrl.config import schema

    counted = schema.available_devices
    monkeypatch.setattr(schema, "available_devices",
                        lambda cfg: ("GPU", 0) if counted(cfg)[0] == "GPU" else counted(cfg))
    cfg = load_config(Config, RECIPES / name, [])
    assert cfg.workflow in ("sft", "grpo", "dpo", "kto", "rm")


def test_base_recipe_is_merged_under_the_diff():
    dapo = load_config(Config, RECIPES / "arith_dapo.yaml", [])
    grpo = load_config(Config, RECIPES / "arith_grpo.yaml", [])
    assert dapo.algorithm.clip_high == 0.28 and dapo.algorithm.dynamic_sampling
    assert dapo.engine.optim.lr == grpo.engine.optim.lr and dapo.data == grpo.data


def test_overrides_parse_yaml_values_and_nest():
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml",
                      ["trainer.steps=3", "engine.optim.lr=1e-4", "telemetry.sinks=[jsonl]", "eval.stop_at=0.5",
                       "data.task_options.forget_carry=0.2", "run.dir=/tmp/x"])
    assert cfg.trainer.steps == 3 and cfg.engine.optim.lr == 1e-4 and cfg.eval.stop_at == 0.5
    assert cfg.data.task_options == {"min_digits": 2, "max_digits": 2, "forget_carry": 0.2}
    assert str(cfg.run.dir) == "/tmp/x"


def test_a_hash_in_an_override_is_text_not_a_yaml_comment():
    """Old behaviour: the value was read by yaml.safe_load, which took '#...' for a comment: a value starting with
    '#' became null and ' # ...' cut a value short."""
    cfg = load_config(Config, None, ["data.system_prompt=#1 rule: be brief", "data.answer_regex=####\\s*(.+)$",
                                     "data.path=x.jsonl", "data.task=null", "reward.verifier=exact"])
    assert cfg.data.system_prompt == "#1 rule: be brief" and cfg.data.answer_regex == "####\\s*(.+)$"
    assert apply_overrides({}, ["a=be brief # not a comment", "b=[x, #y]", "c=k: 1 # z"]) == {
        "a": "be brief # not a comment", "b": "[x, #y]", "c": "k: 1 # z"}
    # every other YAML typing stays, a quoted '#' too
    assert apply_overrides({}, ["a=null", "b=[a,b]", "c=3", "d=true", "e={k: '#v'}", "f=[x, '#y']", "g=C#"]) == {
        "a": None, "b": ["a", "b"], "c": 3, "d": True, "e": {"k": "#v"}, "f": ["x", "#y"], "g": "C#"}


def test_unknown_key_suggests_the_close_one():
    assert "trainer.stepz: unknown key; did you mean trainer.steps?" in _errors("trainer.stepz=3")
    msg = _errors("eval.zzz=1")
    assert "eval.zzz: unknown key; valid keys here:" in msg and "stop_at" in msg


@pytest.mark.parametrize("override, says", [
    ("rollout.temperature=1e-300", "rollout.temperature: temperature=1e-300 is below 1e-05"),
    ("rollout.repetition_penalty=1e-40", "rollout.repetition_penalty: repetition_penalty=1e-40 is below 1e-05"),
    ("eval.temperature=1e-40", "eval.temperature: temperature=1e-40 is below 1e-05"),
    ("rollout.repetition_penalty=1e38", "rollout.repetition_penalty: repetition_penalty=1e+38 is above 100000"),
    ("rollout.repetition_penalty=.inf", "rollout.repetition_penalty: repetition_penalty=inf is above 100000")])
def test_a_sampling_scale_that_overflows_the_logits_is_refused(override, says):
    """Such a temperature divides the logits to inf in float32: the first rollout failed on an index error of
    the sampler (NaN probabilities), after the model had loaded."""
    extra = ["eval.k=2"] if override.startswith("eval.") else []
    msg = _errors(override, *extra, recipe=RECIPES / "arith_grpo.yaml")
    assert says in msg, msg


def test_bad_values_name_their_path():
    assert "rollout.temperature" in _errors("rollout.temperature=-1")
    assert "eval.stop_at" in _errors("eval.stop_at=1.5")
    assert "algorithm.loss_agg='mean'" in _errors("algorithm.loss_agg=mean")
    assert "rollout.n >= 2" in _errors("rollout.n=1")
    assert "overlong_cache=8 must be < rollout.max_new_tokens=8" in _errors(
        "algorithm.overlong_shaping=true", "algorithm.overlong_cache=8", "rollout.max_new_tokens=8")


def test_overrides_given_as_one_string_are_refused_with_the_list_to_write():
    """From Python, ``load_run_config(recipe, "trainer.steps=3")`` walked the string's characters and said
    "override 't' must look like key.path=value", which names nothing the caller wrote."""
    from relayrl.config.loader import load_run_config

    with pytest.raises(ConfigError, match=r"overrides must be a list of 'key.path=value' strings, got str "
                                          r"'trainer.steps=3'; write \['trainer.steps=3'\]"):
        load_run_config(SHIPPED / "arith_grpo.yaml", "trainer.steps=3")
    with pytest.raises(ConfigError, match=r"got dict \{'trainer.steps': 3\}; write \['trainer.steps=3', "):
        apply_overrides({}, {"trainer.steps": 3})
    with pytest.raises(ConfigError, match=r"override 3 is not a string \(int\); an override is 'key.path=value'"):
        apply_overrides({}, [3])
    assert load_run_config(SHIPPED / "arith_grpo.yaml", ("trainer.steps=3",)).trainer.steps == 3


def test_every_section_of_a_run_config_checks_an_assignment_or_refuses_it():
    """docs/runs.md: an assignment in Python checks that key's type and range. ``engine``, ``engine.optim``,
    ``critic.optim`` and ``model.tiny`` took any value (``cfg.engine.optim.lr = "abc"``), and the checks ``run``
    makes again before it starts do not validate a section object anew, so the run started with it."""
    from pydantic import BaseModel, ValidationError

    from relayrl.config.loader import load_run_config

    cfg = load_run_config(SHIPPED / "arith_grpo.yaml")

    def unchecked(m: BaseModel, path: str) -> list[str]:
        own = [] if m.model_config.get("validate_assignment") or m.model_config.get("frozen") else [path]
        return own + [k for n in type(m).model_fields if isinstance(v := getattr(m, n), BaseModel)
                      for k in unchecked(v, f"{path}.{n}".lstrip("."))]

    assert unchecked(cfg, "") == []
    for section, key, bad in ((cfg.engine.optim, "lr", "abc"), (cfg.engine.optim, "lr", -1.0),
                              (cfg.engine, "token_budget", 0), (cfg.model.tiny, "num_layers", 0)):
        with pytest.raises(ValidationError, match=key):
            setattr(section, key, bad)
    cfg.engine.optim.lr = 3e-4
    assert cfg.engine.optim.lr == 3e-4


def test_malformed_overrides():
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        apply_overrides({}, ["trainer.steps"])
    with pytest.raises(ConfigError, match="empty key part"):
        apply_overrides({}, ["trainer..steps=3"])
    with pytest.raises(ConfigError, match="trainer.steps is a value, not a section"):
        apply_overrides({"trainer": {"steps": 3}}, ["trainer.steps.x=1"])
    # the earlier override that made a section a value is the one named
    with pytest.raises(ConfigError, match=r"override 'data=foo' made data a value, so 'data.task=arith'"):
        apply_overrides({"data": {"task": "sort"}}, ["data=foo", "data.task=arith"])
    # a mapping makes it a section again
    assert apply_overrides({}, ["data=foo", "data={task: sort}", "data.n=2"]) == {"data": {"task": "sort", "n": 2}}
    with pytest.raises(ConfigError, match=r"space after the colon.*data.task_options.min_digits=2"):
        apply_overrides({}, ["data.task_options={min_digits:2,max_digits:2}"])


def test_a_shipped_recipe_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("arith_grpo") == resolve_recipe("arith_grpo.yaml") == SHIPPED / "arith_grpo.yaml"
    assert load_config(Config, "toolsum_grpo", ["trainer.steps=2"]).trainer.steps == 2  # its base too
    (tmp_path / "arith_grpo.yaml").write_text("trainer: {steps: 7}\n")  # a file here comes first
    assert load_config(Config, "arith_grpo.yaml").trainer.steps == 7
    with pytest.raises(ConfigError, match=r"recipe arith_grp is neither a file here .* nor a shipped recipe; did "
                                          r"you mean arith_grpo"):
        resolve_recipe("arith_grp")
    with pytest.raises(ConfigError, match=r"recipe .*sub/arith_grpo.yaml does not exist"):
        resolve_recipe("sub/arith_grpo.yaml")  # a path is a path


def test_the_docs_recipes_path_from_another_directory_names_the_shipped_recipe(tmp_path, monkeypatch):
    """The docs write recipes/gsm8k_grpo.yaml (a checkout's path); from elsewhere it is refused, naming the name
    that finds it. A path stays a path: it is not read from the shipped recipes."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        resolve_recipe("recipes/gsm8k_grpo.yaml")
    assert str(e.value) == (f"recipe {tmp_path}/recipes/gsm8k_grpo.yaml does not exist; the shipped recipe of that "
                            f"name is {SHIPPED / 'gsm8k_grpo.yaml'}: give its name (gsm8k_grpo) to use it")


def test_recipe_file_errors(tmp_path):
    assert "does not exist" in _errors(recipe=tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    assert "not valid YAML" in _errors(recipe=bad)
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    assert "base chain loops" in _errors(recipe=tmp_path / "a.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert "is empty" in _errors(recipe=tmp_path / "empty.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfeworkflow: sft\n")
    assert "is not UTF-8 text" in _errors(recipe=tmp_path / "bin.yaml")
    (tmp_path / "list_base.yaml").write_text("base: [a.yaml]\n")
    assert "base must be the path of one recipe" in _errors(recipe=tmp_path / "list_base.yaml")
    (tmp_path / "twice.yaml").write_text("trainer:\n  steps: 2\n  steps: 5\n")
    assert "key 'steps' appears twice (first on line 2)" in _errors(recipe=tmp_path / "twice.yaml")


def test_a_mapping_override_merges_into_its_section_and_an_empty_one_clears_it():
    data = {"engine": {"optim": {"lr": 1e-3, "warmup_steps": 10}}, "data": {"task_options": {"max_digits": 2}}}
    out = apply_overrides(data, ["engine.optim={lr: 0.0001}", "data.task_options={}"])
    assert out["engine"]["optim"] == {"lr": 1e-4, "warmup_steps": 10}
    assert out["data"]["task_options"] == {}
    assert data["engine"]["optim"]["lr"] == 1e-3  # the input is not changed


def test_off_policy_settings_that_cannot_work_are_refused():
    assert "applies to workflow grpo" in _errors("workflow=sft", "trainer.off_policy_steps=1")
    assert "old_logprobs=rollout" in _errors("algorithm.tis_cap=2.0", "algorithm.old_logprobs=rollout")
    assert "trainer.off_policy_steps" in _errors("trainer.off_policy_steps=-1")
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", ["trainer.off_policy_steps=2", "algorithm.tis_cap=2"])
    assert cfg.trainer.off_policy_steps == 2 and cfg.algorithm.tis_cap == 2.0


def test_data_parallel_settings_that_cannot_work_are_refused():
    assert "4 rows, fewer than trainer.mini_batches=5" in _errors(
        "cluster.devices=4", "data.prompts_per_step=1", "rollout.n=4", "trainer.mini_batches=5")
    # a mini-batch needs a row of the step's batch, not one on each rank (fewer groups than ranks: a rank has none)
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", ["cluster.devices=4", "cluster.oversubscribe=true",
                                                             "data.prompts_per_step=1", "rollout.n=4",
                                                             "trainer.mini_batches=2"])
    assert cfg.trainer.mini_batches == 2
    assert "trainer.batch_size = 2 rows over 4" in _errors("workflow=sft", "trainer.batch_size=2", "cluster.devices=4")
    assert "set cluster.backend=ray" in _errors("cluster.nodes=2")
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", ["cluster.devices=2"])
    assert cfg.cluster.devices == 2


def test_dpo_settings_that_cannot_work_are_refused():
    assert "set engine.packing=shared_prompt" in _errors("workflow=dpo", "engine.packing=none")
    assert "data.task='sort' has none" in _errors("workflow=dpo", "data.task=sort")
    assert "dpo.label_smoothing is defined for dpo.kind=sigmoid" in _errors("workflow=dpo", "dpo.kind=ipo",
                                                                            "dpo.label_smoothing=0.1")
    assert "dpo.beta" in _errors("workflow=dpo", "dpo.beta=0")
    for kind in ("simpo", "orpo", "apo_zero", "apo_down"):
        assert "dpo.label_smoothing is defined for dpo.kind=sigmoid" in _errors(
            "workflow=dpo", f"dpo.kind={kind}", "dpo.label_smoothing=0.1")
    assert "read by dpo.kind=simpo only (got 'sigmoid')" in _errors("workflow=dpo", "dpo.gamma=1.0")
    assert "read by dpo.kind=simpo only (got 'orpo')" in _errors("workflow=dpo", "dpo.kind=orpo", "dpo.gamma=1.0")
    assert load_config(Config, None, ["workflow=dpo", "dpo.kind=simpo", "dpo.gamma=1.0"]).dpo.gamma == 1.0
    assert "dpo.kind=orpo's loss holds the chosen answers' NLL" in _errors("workflow=dpo", "dpo.kind=orpo",
                                                                             "dpo.nll_weight=1.0")
    for kind in ("simpo", "orpo", "cpo"):
        assert f"dpo.kind={kind} is reference-free: it loads none" in _errors(
            "workflow=dpo", f"dpo.kind={kind}", "trainer.ref_sync_every=5")
    assert load_config(Config, None, ["workflow=dpo", "dpo.kind=apo_zero", "trainer.ref_sync_every=5"])
    # CPO: TRL's CPOConfig(loss_type="sigmoid") smooths its labels and adds its NLL term (cpo_alpha); no gamma
    cpo = load_config(Config, None, ["workflow=dpo", "dpo.kind=cpo", "dpo.label_smoothing=0.1", "dpo.nll_weight=1"]).dpo
    assert (cpo.kind, cpo.label_smoothing, cpo.nll_weight) == ("cpo", 0.1, 1.0)
    assert "read by dpo.kind=simpo only (got 'cpo')" in _errors("workflow=dpo", "dpo.kind=cpo", "dpo.gamma=1.0")
    assert "dpo.kind" in _errors("workflow=dpo", "dpo.kind=cpo_simpo")


@pytest.mark.parametrize("recipe, override, says", [
    ("arith_rm", "dpo.beta=0.5", "dpo.beta is read by workflow dpo only (this run is workflow rm): drop it or set "
                                 "workflow=dpo"),
    ("arith_sft", "dpo.kind=ipo", "dpo.kind is read by workflow dpo only (this run is workflow sft)"),
    ("arith_grpo", "dpo.beta=0.5", "dpo.beta is read by workflow dpo only (this run is workflow grpo)"),
    ("arith_kto", "dpo.nll_weight=1", "dpo.nll_weight is read by workflow dpo only (this run is workflow kto)"),
    ("arith_dpo", "rm.margin=1", "rm.margin is read by workflow rm only (this run is workflow dpo): drop it or set "
                                 "workflow=rm"),
    ("arith_grpo", "rm.margin=1", "rm.margin is read by workflow rm only (this run is workflow grpo)"),
    ("arith_dpo", "kto.beta=0.5", "kto.beta is read by workflow kto only (this run is workflow dpo)")])
def test_a_section_only_another_workflow_reads_is_refused(recipe, override, says):
    """Old behaviour: kto.* was refused outside workflow kto, but dpo.* and rm.* keys were silently ignored by
    the workflows that do not read them (workflow rm trained with dpo.beta=0.5 as without it)."""
    assert says in _errors(override, recipe=RECIPES / f"{recipe}.yaml")


def test_a_grpo_recipe_run_as_another_workflow_names_every_key_it_would_ignore(tmp_path):
    """Old behaviour: ``relayrl train arith_grpo workflow=dpo`` trained DPO with the recipe's algorithm.* and
    rollout.n silently unused."""
    says = _errors("workflow=dpo", recipe=RECIPES / "arith_grpo.yaml")
    assert ("algorithm.advantage, algorithm.clip_high, algorithm.clip_low, algorithm.kl_coef, algorithm.loss_agg, "
            "rollout.n, data.prompts_per_step are read by workflow grpo only (this run is workflow dpo") in says
    assert "algorithm.clip_high is read by workflow grpo only (this run is workflow sft" in _errors(
        "algorithm.clip_high=0.28", recipe=RECIPES / "arith_sft.yaml")
    assert "rollout.n is read by workflow grpo only" in _errors("rollout.n=4", recipe=RECIPES / "arith_kto.yaml")
    assert "rollout.n, data.prompts_per_step are read by workflow grpo only" in _errors(
        "workflow=dpo", "algorithm={}", recipe=RECIPES / "arith_grpo.yaml")
    sft = tmp_path / "sft.yaml"
    sft.write_text("workflow: sft\nalgorithm: {clip_high: 0.28}\n")
    assert "(algorithm={} on the command line empties that section)" in _errors(recipe=sft)
    assert load_config(Config, sft, ["algorithm={}"]).algorithm.clip_high == 0.2
    # (the rollout's other keys stay: evaluation generates with them; the temperature samples the eval.k answers)
    assert load_config(Config, RECIPES / "arith_sft.yaml", ["rollout.max_new_tokens=7"]).rollout.max_new_tokens == 7
    assert load_config(Config, RECIPES / "arith_sft.yaml",
                       ["rollout.temperature=0.7", "eval.k=4"]).rollout.temperature == 0.7


def test_the_batch_key_another_workflow_reads_is_refused():
    """Old behaviour: ``trainer.batch_size=32`` in workflow grpo (TRL's habit; a step takes data.prompts_per_step
    prompts) and ``data.prompts_per_step=4`` in workflow sft (a step takes trainer.batch_size examples) were
    accepted and trained as without them."""
    says = _errors("trainer.batch_size=32", recipe=RECIPES / "arith_grpo.yaml")
    assert ("trainer.batch_size is read by workflows sft, dpo, kto and rm only (this run is workflow grpo, whose "
            "steps take data.prompts_per_step prompts, each answered rollout.n times)") in says
    for recipe in ("arith_sft", "arith_dpo", "arith_kto", "arith_rm"):
        assert "data.prompts_per_step is read by workflow grpo only" in _errors(
            "data.prompts_per_step=4", recipe=RECIPES / f"{recipe}.yaml")
    assert load_config(Config, RECIPES / "arith_grpo.yaml", ["data.prompts_per_step=4"]).data.prompts_per_step == 4
    assert load_config(Config, RECIPES / "arith_sft.yaml", ["trainer.batch_size=8"]).trainer.batch_size == 8


def test_each_workflow_keeps_the_section_it_reads():
    assert load_config(Config, RECIPES / "arith_dpo.yaml", ["dpo.beta=0.5"]).dpo.beta == 0.5
    assert load_config(Config, RECIPES / "arith_rm.yaml", ["rm.margin=1"]).rm.margin == 1.0
    assert load_config(Config, RECIPES / "arith_kto.yaml", ["kto.beta=0.5"]).kto.beta == 0.5
    # an emptied section is not set: a dpo recipe can be run as another workflow with dpo={}
    assert load_config(Config, RECIPES / "arith_dpo.yaml", ["workflow=rm", "dpo={}"]).workflow == "rm"


def test_workflow_rm_on_a_dataset_needs_no_verifier(tmp_path):
    """Old behaviour: workflow rm, which scores no response, was refused with 'reward.verifier=task needs a
    built-in data.task' on a dataset, and a reward.* key it never reads was accepted."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    on_data = ["data.task=null", f"data.path={pairs}", "data.answer_key=chosen"]
    cfg = load_config(Config, RECIPES / "arith_rm.yaml", on_data)
    assert cfg.workflow == "rm" and cfg.reward.verifier == "task"  # the default, read by nothing here
    assert ("reward.verifier scores responses, and workflow rm generates none (it evaluates the reward model on "
            "held-out pairs): drop reward.verifier") in _errors(*on_data, "reward.verifier=exact",
                                                                recipe=RECIPES / "arith_rm.yaml")
    # the workflows that score held-out answers keep the rule
    assert "reward.verifier=task needs a built-in data.task" in _errors(*on_data, "data.rejected_key=rejected",
                                                                        recipe=RECIPES / "arith_dpo.yaml")


def test_ppo_settings():
    assert load_config(Config, RECIPES / "arith_grpo.yaml", ["algorithm.advantage=remax", "rollout.n=1"]).rollout.n == 1
    assert "reinforce++ or gae" in _errors("algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1")
    cfg = load_config(Config, RECIPES / "arith_ppo.yaml", ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1"])
    assert cfg.algorithm.advantage == "gae" and cfg.critic.value_clip == 0.5
    assert "critic.value_clip" in _errors("algorithm.advantage=gae", "critic.value_clip=0")


def test_dynamic_sampling_with_one_response_per_prompt_is_refused():
    """Old behaviour: PPO's rollout.n=1 with algorithm.dynamic_sampling=true loaded, and every step dropped every
    group (one response is a group whose rewards are all equal) and trained nothing, its log line advising more
    resample rounds."""
    says = _errors("rollout.n=1", "algorithm.dynamic_sampling=true", recipe=RECIPES / "arith_ppo.yaml")
    assert "with rollout.n=1 each group is one response" in says and "set rollout.n >= 2" in says
    assert load_config(Config, RECIPES / "arith_ppo.yaml", ["rollout.n=2", "algorithm.dynamic_sampling=true"])


def test_algorithm_keys_outside_workflow_grpo_are_refused():
    """Old behaviour: workflows sft, dpo, kto and rm read nothing of the algorithm section and took any key there
    (algorithm.loss_agg=seq-mean-token-sum on SFT trained its token mean; algorithm.kl_coef on DPO did nothing)."""
    says = _errors("algorithm.loss_agg=seq-mean-token-sum", recipe=RECIPES / "arith_sft.yaml")
    assert "algorithm.loss_agg is read by workflow grpo only (this run is workflow sft, which would train " \
           "without it): drop it" in says
    assert "algorithm.kl_coef is read by workflow grpo only (this run is workflow dpo, which would train without " \
           "it; its options are dpo.*)" in _errors("algorithm.kl_coef=0.1", recipe=RECIPES / "arith_dpo.yaml")
    assert "its options are kto.*" in _errors("algorithm.entropy_coef=0.01", recipe=RECIPES / "arith_kto.yaml")
    # a nested key in full
    assert "algorithm.policy_loss, algorithm.sapo.tau_pos are read by workflow grpo only" in _errors(
        "algorithm.policy_loss=sapo", "algorithm.sapo.tau_pos=2", recipe=RECIPES / "arith_sft.yaml")


def test_critic_keys_without_a_critic_are_refused():
    """Old behaviour: critic.* was taken and ignored by every estimator but gae (a verl user's critic.optim.lr or
    critic.warmup_steps on a GRPO run trained no critic and held no actor back)."""
    says = _errors("critic.optim.lr=1e-3", recipe=RECIPES / "arith_grpo.yaml")
    assert "critic.optim.lr shapes PPO's critic" in says and "set algorithm.advantage=gae (got 'grpo')" in says
    assert "drop critic.warmup_steps" in _errors("critic.warmup_steps=2", recipe=RECIPES / "arith_sft.yaml")
    assert "drop critic.optim.lr" in _errors("algorithm.advantage=rloo", recipe=RECIPES / "arith_ppo.yaml")
    cfg = load_config(Config, RECIPES / "arith_ppo.yaml", ["critic.warmup_steps=2"])
    assert cfg.critic.warmup_steps == 2 and cfg.critic.optim.lr == 1e-4


def test_options_of_a_feature_that_is_off_are_named_on_the_runs_first_lines():
    """Old behaviour: algorithm.max_resample_rounds without dynamic_sampling, overlong_cache / overlong_penalty
    without overlong_shaping and kl_kind with kl_coef=0 were taken and did nothing, unsaid (a verl user's
    kl_kind=low_var_kl trained with no KL at all). They are named in the step plan's notes (printed first by the
    run and by --print-config); not refused, as turning off a recipe's feature is an ablation and a run's saved
    config must load again."""
    from relayrl.config.plan import step_plan

    grpo, dapo = RECIPES / "arith_grpo.yaml", RECIPES / "arith_dapo.yaml"

    def notes(*over, recipe=grpo):
        return "\n".join(step_plan(load_config(Config, recipe, list(over))).notes)

    assert "algorithm.max_resample_rounds=5 is unused: it counts dynamic sampling's refills, which is off (every " \
           "group is kept after one round); set algorithm.dynamic_sampling=true to use it" in notes(
               "algorithm.max_resample_rounds=5")
    assert "algorithm.overlong_penalty=0.5 is unused: it shapes DAPO's overlong penalty" in notes(
        "algorithm.overlong_penalty=0.5")
    assert "algorithm.kl_kind=low_var_kl is unused" in notes("algorithm.kl_kind=low_var_kl") or \
        "algorithm.kl_kind=k3 is unused" in notes("algorithm.kl_kind=low_var_kl")  # (low_var_kl is read as k3)
    assert "set algorithm.kl_coef > 0 (e.g. 0.001) to use it" in notes("algorithm.kl_kind=low_var_kl")
    # DAPO's ablation: its own options stay, named
    said = notes("algorithm.overlong_shaping=false", recipe=dapo)
    assert "algorithm.overlong_cache=2 is unused" in said and "overlong_penalty" not in said
    assert notes() == "" and notes(recipe=dapo) == ""
    assert load_config(Config, grpo, ["algorithm.kl_kind=k2", "algorithm.kl_coef=0.1"]).algorithm.kl_kind == "k2"
    assert "kl_kind" not in notes("algorithm.kl_kind=k2", "algorithm.kl_coef=0.1")


def test_settings_a_workflow_would_ignore_are_refused():
    """Issue 11 item 7: SFT and DPO accepted trainer.mini_batches / epochs and ignored them; algorithm.gamma
    was ignored by every estimator but gae (fails before)."""
    assert "set trainer.mini_batches=1 and trainer.epochs=1" in _errors("workflow=sft", "trainer.mini_batches=2")
    assert "workflow dpo takes one optimizer step" in _errors("workflow=dpo", "trainer.epochs=2")
    assert "set algorithm.gamma=1.0" in _errors("algorithm.gamma=0.9")
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", ["algorithm.advantage=reinforce++", "algorithm.gamma=0.9",
                                                            "trainer.mini_batches=2"])
    assert cfg.algorithm.gamma == 0.9


def test_values_that_would_fail_in_a_worker_are_refused_when_the_config_loads():
    assert "unknown task 'nosuch'" in _errors("data.task=nosuch")
    msg = _errors("data.task_options={foo: 1}")
    assert "task 'arith' has no option 'foo'; its options are" in msg and "max_digits" in msg
    assert "need 1 <= min_digits <= max_digits" in _errors("data.task_options={min_digits: 5, max_digits: 2}")
    assert "data.eval_task_options=" in _errors("data.eval_task_options={bar: 2}")
    assert "algorithm.clip_low" in _errors("algorithm.clip_low=1.5")
    assert "eval.max_new_tokens" in _errors("eval.max_new_tokens=-3")
    assert "engine.optim.betas.0" in _errors("engine.optim.betas=[1.5,0.9]")
    assert "algorithm.lam=0.5 is GAE's lambda" in _errors("algorithm.lam=0.5")
    load_config(Config, None, ["algorithm.advantage=gae", "algorithm.lam=0.95"])  # where lam means something


def test_a_task_option_that_another_key_sets_is_refused():
    """An ``eval_size`` in data.task_options was silently replaced by eval.size (the held-out set kept eval.size's
    200 rows); ``name`` renamed the task. Both are refused naming the key that sets them, and the options a
    wrong one lists are the ones a user sets."""
    assert ("data.task_options: 'eval_size' is set by eval.size, not by the task's options: drop it from "
            "data.task_options and set eval.size=N") in _errors("data.task_options={eval_size: 50}")
    assert "data.eval_task_options: 'name' is set by data.task" in _errors("data.eval_task_options={name: sums}")
    msg = _errors("data.task_options={foo: 1}")
    assert "'eval_seed'" in msg and "'eval_size'" not in msg and "'name'" not in msg
    load_config(Config, RECIPES / "arith_grpo.yaml", ["data.eval_task_options={eval_seed: 7}"])  # (a real option)


def test_a_yes_for_run_resume_says_what_to_write():
    assert "run.resume: true (YAML reads yes, no, true and false as booleans) is not a resume mode: write never, " \
           "auto or a checkpoint path" in _errors("run.resume=yes")


@pytest.mark.parametrize("override, says", [
    ("trainer.steps=true", "trainer.steps=true: an integer is expected, not a boolean; write the number"),
    ("trainer.steps=false", "trainer.steps=false: an integer is expected"),
    ("rollout.top_p=true", "rollout.top_p=true: a number is expected, not a boolean"),
    ("placement.pools={gen: true}", "placement.pools.gen=true: an integer is expected")])
def test_a_boolean_is_not_read_as_a_number(override, says):
    extra = ["placement.rollout=gen"] if "pools" in override else []
    assert says in _errors(override, *extra, recipe=RECIPES / "arith_grpo.yaml")
    assert load_config(Config, RECIPES / "arith_grpo.yaml", ["trainer.steps=3"]).trainer.steps == 3


@pytest.mark.parametrize("override, says", [
    ("rollout.temperature=inf", "rollout.temperature=inf is not a finite number; write a finite number (its "
                                "default is 1.0)"),
    ("rollout.temperature=1e308", "rollout.temperature=1e+308 is beyond float32's range"),
    ("engine.optim.lr=inf", "engine.optim.lr=inf is not a finite number"),
    ("algorithm.kl_coef=.inf", "algorithm.kl_coef=inf is not a finite number"),
    ("reward.verifier_weight=nan", "reward.verifier_weight=nan is not a finite number"),
    ("reward.judge={path: judge, min_score: -.inf}", "reward.judge.min_score=-inf is not a finite number"),
    ("engine.optim.lr=inf", "engine.optim.lr=inf is not a finite number; write a finite number (its default is "
                            "1e-05)"),
    # the critic's own default (its optim section is OptimConfig(lr=1e-4); old behaviour: the class's 1e-05)
    ("critic.optim={lr: .inf}", "critic.optim.lr=inf is not a finite number; write a finite number (its default "
                                "is 0.0001)")])
def test_a_non_finite_number_is_refused(override, says):
    """Old behaviour: a bound like ge=0 let infinity through and a key without one took NaN too, so
    rollout.temperature=inf trained sampling uniformly and engine.optim.lr=inf loaded."""
    recipe = RECIPES / ("arith_ppo.yaml" if override.startswith("critic.") else "arith_grpo.yaml")  # (a critic)
    assert says in _errors(override, recipe=recipe)


def test_infinity_stays_where_it_means_something():
    # engine.optim.max_grad_norm=inf clips nothing, as null does (Field(allow_inf_nan=True)); NaN is still refused
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", ["engine.optim.max_grad_norm=inf", "rollout.temperature=3"])
    assert cfg.engine.optim.max_grad_norm == float("inf") and cfg.rollout.temperature == 3.0
    assert "engine.optim.max_grad_norm" in _errors("engine.optim.max_grad_norm=nan")


def test_more_cpu_ranks_than_cores_are_refused_unless_asked_for():
    import os

    cores = len(os.sched_getaffinity(0))
    over = [f"cluster.devices={cores + 1}", "model.device=cpu", "data.prompts_per_step=64"]
    says = _errors(*over, recipe=RECIPES / "arith_grpo.yaml")
    assert f"cluster.devices={cores + 1} starts {cores + 1} ranks, one per CPU core, but this machine has {cores}" in says
    assert f"set cluster.devices <= {cores}, or set cluster.oversubscribe=true" in says
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", [*over, "cluster.oversubscribe=true"])
    assert cfg.cluster.devices == cores + 1


def test_home_is_expanded_in_paths_and_an_empty_run_dir_is_refused(tmp_path, monkeypatch):
    from relayrl.config.loader import load_run_config

    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {task: null, path: ~/data/train.jsonl}\nreward: {verifier: math}\n")
    cfg = load_run_config(recipe, ["run.dir=~/runs/a", "trainer.init_from=~/sft/model", "run.resume=~/ck/step-000002"])
    assert cfg.data.path == str(tmp_path / "data" / "train.jsonl")
    assert (cfg.run.dir, cfg.trainer.init_from) == (tmp_path / "runs" / "a", str(tmp_path / "sft" / "model"))
    assert cfg.run.resume == str(tmp_path / "ck" / "step-000002")
    assert load_run_config(recipe, ["run.resume=auto"]).run.resume == "auto"
    with pytest.raises(ConfigError, match=r"run.dir: is empty; give a directory"):
        load_run_config(recipe, ["run.dir="])


def test_a_recipe_that_is_a_directory_names_the_recipes_in_it(tmp_path):
    from relayrl.config.loader import load_run_config

    (tmp_path / "mine.yaml").write_text("trainer: {steps: 1}\n")
    with pytest.raises(ConfigError, match=r"is a directory; give a recipe file in it \(mine.yaml\)"):
        load_run_config(tmp_path, [])


def test_sampled_evaluation_keys_are_checked():
    assert "set eval.k > 1" in _errors("eval.temperature=0.6")
    assert "eval.k=1" in _errors("workflow=rm", "eval.k=4", recipe=RECIPES / "arith_rm.yaml")
    assert "eval.k" in _errors("eval.k=0")
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", ["eval.k=8", "eval.temperature=0.6"])
    assert (cfg.eval.k, cfg.eval.temperature) == (8, 0.6)


def test_a_yaml_boolean_word_for_a_choice_says_how_yaml_read_it():
    err = _errors("engine.dropout=off")
    assert "engine.dropout: Input should be 'auto', 'none' or 'model' (got False)" in err
    assert "YAML reads on, off, yes and no as false" in err


def test_the_prompt_limit_keys_are_checked(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    on_data = ["data.task=null", f"data.path={data}", "reward.verifier=exact"]
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", [*on_data, "data.max_prompt_tokens=256",
                                                            "data.long_prompts=drop"])
    assert (cfg.data.max_prompt_tokens, cfg.data.long_prompts) == (256, "drop")
    cfg = load_config(Config, RECIPES / "arith_sft.yaml", [*on_data, "data.long_prompts=drop"])  # (no cap: allowed)
    assert cfg.data.max_prompt_tokens is None and cfg.data.long_prompts == "drop"
    assert "data.max_prompt_tokens" in _errors(*on_data, "data.max_prompt_tokens=0")
    assert "data.long_prompts: Input should be 'fail' or 'drop'" in _errors(*on_data, "data.long_prompts=cut")
    assert "data.max_prompt_tokens measures the rows of a dataset (data.path or data.hf_name); the built-in task " \
           "data.task='arith' draws fresh prompts, whose size data.task_options sets: unset it" in \
           _errors("data.max_prompt_tokens=64")
    assert "set data.long_prompts=fail" in _errors("data.long_prompts=drop")


@pytest.mark.parametrize("overrides", [[], ["critic.optim.warmup_steps=3"], ["critic.optim={schedule: cosine}"]])
def test_the_critic_keeps_its_learning_rate_when_its_optimizer_is_given_in_part(overrides):
    """Old behaviour: critic.optim was an instance default, OptimConfig(lr=1e-4), so a critic.optim given in part
    was validated from the class and silently took the policy's 1e-5 (and the config reference showed 1e-5)."""
    cfg = load_config(Config, RECIPES / "arith_grpo.yaml", ["algorithm.advantage=gae", *overrides])
    assert cfg.critic.optim.lr == 1e-4
    assert cfg.engine.optim.lr == load_config(Config, RECIPES / "arith_grpo.yaml", []).engine.optim.lr
    assert load_config(Config, RECIPES / "arith_grpo.yaml", ["algorithm.advantage=gae", "critic.optim.lr=3e-4",
                                                              *overrides]).critic.optim.lr == 3e-4


def _instance_defaults_differing(section, prefix: str) -> list[str]:
    """The keys under ``section`` (a default config's section) whose value is not its field's own default."""
    from pydantic import BaseModel

    out = []
    for name, field in type(section).model_fields.items():
        value, key = getattr(section, name), f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out += _instance_defaults_differing(value, f"{key}.")
        elif value != field.get_default(call_default_factory=True):
            out.append(f"{key}={value!r} (field default {field.get_default(call_default_factory=True)!r})")
    return out


def test_every_default_is_its_fields_own_default():
    """A section whose default is an instance with other values (critic.optim was OptimConfig(lr=1e-4)) loses them
    when it is given in part, and the config reference (read from the fields) shows the field's default: every
    default must be the field's own, so the reference and a partial section say what the run does."""
    assert _instance_defaults_differing(Config(), "") == []
