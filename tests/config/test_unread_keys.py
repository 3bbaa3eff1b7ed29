"""Keys the run never reads are refused at another value than their default, naming the key, its value and why
(``relayrl.config.unread``; ``data.retire_score``, ``algorithm.tis_cap`` and ``algorithm.correction.high`` in
their sections). Old behaviour, for every case here: the key was accepted and the run trained as without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
OFFLINE = {"sft": "arith_sft.yaml", "dpo": "arith_dpo.yaml", "kto": "arith_kto.yaml", "rm": "arith_rm.yaml"}
DATASET = ["data.task=null", "data.path=train.jsonl", "reward.verifier=exact"]


def _refusal(recipe: str | None, *over: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(Config, None if recipe is None else RECIPES / recipe, list(over))
    return " ".join(str(e.value).split())


def _loads(recipe: str | None, *over: str) -> Config:
    return load_config(Config, None if recipe is None else RECIPES / recipe, list(over))


@pytest.mark.parametrize("workflow", sorted(OFFLINE))
@pytest.mark.parametrize("override,says", [
    ("trainer.stream_groups=4", "trainer.stream_groups=4 is how many prompt groups workflow grpo's streaming stages "
                                "take per call; workflow {wf} trains on its data"),
    ("dock.units=2", "dock.units=2 shapes the dock, the sample store between workflow grpo's stages; workflow {wf} "
                     "trains on its data and builds none, so nothing reads it: drop dock.units"),
    ("telemetry.samples_per_step=3", "telemetry.samples_per_step=3 writes each step's sampled responses to "
                                     "RUN_DIR/samples.jsonl; workflow {wf} trains on its data and samples none"),
])
def test_the_offline_workflows_refuse_grpo_s_streaming_dock_and_sample_keys(workflow, override, says):
    assert says.format(wf=workflow) in _refusal(OFFLINE[workflow], override)


@pytest.mark.parametrize("workflow", ["sft", "dpo", "kto"])
@pytest.mark.parametrize("override", ["reward.normalize=running", "reward.clip=1.5", "reward.verifier_weight=0.5",
                                      "reward.model=runs/rm/model", "reward.judge.path=judge"])
def test_the_offline_workflows_refuse_the_training_reward_s_terms(workflow, override):
    """Evaluation, the only scoring an offline run does, reads the verifier and the format term alone."""
    key = override.split("=")[0]
    says = _refusal(OFFLINE[workflow], override)
    assert f"{key}=" in says and f"shapes the reward a GRPO step trains on; workflow {workflow} trains on its data " \
           f"and scores only its held-out answers, with the verifier and the format term" in says, says
    assert f"drop {key}" in says
    if workflow == "sft":  # (the tool environment's held-out episodes are scored with the whole reward)
        assert getattr(_loads("toolsum_sft.yaml", override).reward, key.split(".")[1]) is not None


@pytest.mark.parametrize("override", ["rollout.top_p=0.9", "rollout.top_k=5", "rollout.min_p=0.1",
                                      "rollout.repetition_penalty=1.2"])
def test_the_rollout_s_filters_are_refused_where_only_evaluation_generates(override):
    says = _refusal("arith_sft.yaml", override)
    key = override.split("=")[0]
    assert f"{override} filters what workflow grpo's rollout samples; workflow sft trains on its data and generates " \
           f"only its held-out answers, greedy (and with eval.k > 1 sampled with eval.top_p, eval.top_k and " \
           f"eval.min_p), so nothing reads it: drop {key}" in says, says
    value = getattr(_loads("arith_grpo.yaml", override).rollout, key.split(".")[1])  # (workflow grpo samples with it)
    assert value == pytest.approx(float(override.split("=")[1]))


def test_the_rollout_temperature_is_read_offline_only_as_the_eval_k_answers_temperature():
    says = _refusal("arith_sft.yaml", "rollout.temperature=0.7")
    assert "rollout.temperature=0.7 is the temperature of workflow grpo's rollout; workflow sft trains on its data " \
           "and generates only its held-out answers, greedy (eval.k=1), so nothing reads it" in says, says
    assert "eval.temperature=0.5 samples its eval.k answers" in _refusal(
        "arith_dpo.yaml", "rollout.temperature=0.7", "eval.k=4", "eval.temperature=0.5")
    assert _loads("arith_sft.yaml", "rollout.temperature=0.7", "eval.k=4").rollout.temperature == 0.7
    assert _loads("arith_grpo.yaml", "rollout.temperature=0.7").rollout.temperature == 0.7


def test_workflow_rm_refuses_the_rollout_keys_and_keeps_the_ones_its_checks_read():
    for override in ("rollout.temperature=0.5", "rollout.engine=vllm", "rollout.max_batch=8"):
        says = _refusal("arith_rm.yaml", override)
        assert f"{override} shapes the rollout, and workflow rm trains a reward model on pairs and generates " \
               f"nothing" in says, says
    # (the held-out prompts are fitted beside rollout.max_new_tokens, and the turn-end check reads stop_strings)
    cfg = _loads("arith_rm.yaml", "rollout.max_new_tokens=8", "rollout.stop_strings=[x]")
    assert cfg.rollout.max_new_tokens == 8 and cfg.rollout.stop_strings == ["x"]


@pytest.mark.parametrize("override,says", [
    ("reward.model_weight=2", "reward.model_weight=2 weighs the reward model's score, and reward.model is null"),
    ("reward.model_batch=8", "reward.model_batch=8 sets the rows of a reward-model pass, and reward.model is null"),
    ("reward.model_device=cpu", "reward.model_device=cpu places the reward model and the judge, and reward.model "
                                "and reward.judge.path are null"),
    ("reward.format_on=response", "reward.format_on=response is what reward.format_regex is searched in, and "
                                  "reward.format_regex is null"),
    ("reward.judge.weight=0.5", "reward.judge.weight=0.5 shapes the LLM judge, and reward.judge.path is null"),
    ("reward.judge.max_new_tokens=4", "reward.judge.max_new_tokens=4 shapes the LLM judge"),
])
def test_an_off_reward_term_s_options_are_refused(override, says):
    assert says in _refusal("arith_grpo.yaml", override)


def test_a_reward_term_that_is_on_reads_its_options():
    cfg = _loads("arith_grpo.yaml", "reward.model=rm", "reward.model_weight=2", "reward.model_batch=8",
                 "reward.model_device=cpu")
    assert (cfg.reward.model_weight, cfg.reward.model_batch, cfg.reward.model_device) == (2.0, 8, "cpu")
    cfg = _loads("arith_grpo.yaml", "reward.judge.path=judge", "reward.judge.weight=0.5", "reward.model_device=cpu")
    assert cfg.reward.judge.weight == 0.5 and cfg.reward.model_device == "cpu"
    cfg = _loads("arith_grpo.yaml", "reward.format_regex=x", "reward.format_on=response")
    assert cfg.reward.format_on == "response"
    assert _loads("arith_grpo_rm.yaml").reward.model_weight == 1.0


@pytest.mark.parametrize("recipe,override,readers", [
    ("arith_grpo.yaml", "data.rejected_key=bad", "workflows dpo and rm only (this run is workflow grpo)"),
    ("arith_sft.yaml", "data.rejected_key=bad", "workflows dpo and rm only (this run is workflow sft)"),
    ("arith_kto.yaml", "data.rejected_key=bad", "workflows dpo and rm only (this run is workflow kto)"),
    ("arith_grpo.yaml", "data.label_key=ok", "workflow kto only (this run is workflow grpo)"),
    ("arith_dpo.yaml", "data.label_key=ok", "workflow kto only (this run is workflow dpo)"),
])
def test_a_data_column_of_another_workflow_is_refused(recipe, override, readers):
    says = _refusal(recipe, override)
    assert f"{override} names the field with" in says and f"read by {readers}: drop {override.split('=')[0]}" in says


def test_the_data_columns_are_read_by_their_workflows():
    assert _loads("arith_dpo.yaml", "data.rejected_key=bad").data.rejected_key == "bad"
    assert _loads("arith_rm.yaml", "data.rejected_key=bad").data.rejected_key == "bad"
    assert _loads("arith_kto.yaml", "data.label_key=ok").data.label_key == "ok"


@pytest.mark.parametrize("override", ["env.max_turns=2", "env.tools=[python]", "env.sandbox.uid_base=5000"])
def test_episode_keys_without_an_environment_are_refused(override):
    says = _refusal("arith_grpo.yaml", override)
    assert "shapes multi-turn episodes, and env.name is null (single-turn responses), so nothing reads it: set " \
           f"env.name (tools, or your environment) or drop {override.split('=')[0]} (env={{}} on the command line " \
           f"empties the section)" in says, says
    # (a tool recipe run single-turn: the section emptied as the message says)
    assert _loads("toolsum_grpo.yaml", "env={}").env.name is None
    assert "env.max_turns=3 shapes multi-turn episodes" in _refusal("toolsum_grpo.yaml", "env.name=null")


def test_stream_groups_in_a_step_that_streams_nothing_is_refused():
    says = _refusal("arith_grpo.yaml", "trainer.stream_groups=4")
    assert "trainer.stream_groups=4 is how many prompt groups a streaming stage takes per call, and every stage of " \
           "this step (step: sync, advantage=grpo" in says and "drop trainer.stream_groups" in says, says
    for streams in (["algorithm.dynamic_sampling=true"], ["placement.pools.gen=1", "placement.rollout=gen"],
                    ["trainer.off_policy_steps=1"], ["reward.stream=sample"], ["algorithm.advantage=remax"]):
        assert _loads("arith_grpo.yaml", "trainer.stream_groups=4", *streams).trainer.stream_groups == 4


def test_retire_score_without_retire_solved_is_refused():
    says = _refusal(None, *DATASET, "data.retire_score=0.5")
    assert "data.retire_score=0.5 is the score from which a response counts as solved in data.retire_solved's pass " \
           "rate, and data.retire_solved is null (no row is retired), so nothing reads it: set data.retire_solved " \
           "(e.g. 0.9) or drop data.retire_score" in says, says
    assert _loads(None, *DATASET, "data.retire_solved=0.9", "data.retire_score=0.5").data.retire_score == 0.5


@pytest.mark.parametrize("cap", ["0.5", "0.999"])
def test_a_tis_cap_below_one_is_refused(cap):
    says = _refusal("arith_grpo_offpolicy.yaml", f"algorithm.tis_cap={cap}")
    assert f"algorithm.tis_cap={cap}: truncated importance sampling (Yao et al. 2025) caps the weight pi_old / mu, " \
           f"which is 1 on average under the rollout policy" in says and "set algorithm.tis_cap >= 1" in says, says
    assert _loads("arith_grpo_offpolicy.yaml", "algorithm.tis_cap=1").algorithm.tis_cap == 1.0


@pytest.mark.parametrize("mode,says", [
    ("truncate", "mode=truncate caps every weight below 1, the tokens where the two policies agree (weight 1) too"),
    ("mask", "mode=mask keeps only weights in [low, high], and without 1 in it every token where the two policies "
             "agree (weight 1) is dropped")])
def test_a_correction_bound_that_leaves_out_a_weight_of_one_is_refused(mode, says):
    on = ["algorithm.correction.level=token", f"algorithm.correction.mode={mode}"]
    got = _refusal("arith_grpo_offpolicy.yaml", "algorithm.tis_cap=null", *on, "algorithm.correction.high=0.8")
    assert "algorithm.correction.high=0.8: the importance weight pi_old / mu is 1 on average" in got and says in got
    assert "set algorithm.correction.high >= 1" in got
    if mode == "mask":
        got = _refusal("arith_grpo_offpolicy.yaml", "algorithm.tis_cap=null", *on, "algorithm.correction.low=1.5",
                       "algorithm.correction.high=3")
        assert "algorithm.correction.low=1.5 is above 1" in got and "set algorithm.correction.low <= 1" in got, got
    cfg = _loads("arith_grpo_offpolicy.yaml", "algorithm.tis_cap=null", *on, "algorithm.correction.high=1")
    assert cfg.algorithm.correction.high == 1.0


@pytest.mark.parametrize("over,says", [
    (["engine.optim.min_lr_ratio=0.1"], "engine.optim.min_lr_ratio=0.1 is the floor of a cosine or linear decay, and "
                                        "engine.optim.schedule=constant keeps the learning rate at engine.optim.lr"),
    (["algorithm.advantage=gae", "critic.optim.min_lr_ratio=0.2"], "critic.optim.min_lr_ratio=0.2 is the floor of a "
                                                                   "cosine or linear decay"),
    (["run.nonfinite_skip_limit=3"], "run.nonfinite_skip_limit=3 counts the updates run.on_nonfinite=skip skips in a "
                                     "row, and run.on_nonfinite=stop stops at the first"),
    (["cluster.ray_address=auto"], "cluster.ray_address=auto is read by the Ray backend only (it joins that Ray "
                                   "cluster), and cluster.backend=local: set cluster.backend=ray"),
    (["cluster.num_cpus=4"], "cluster.num_cpus=4 is read by the Ray backend only"),
])
def test_an_option_its_switch_turns_off_is_refused(over, says):
    assert says in _refusal("arith_grpo.yaml", *over)


def test_the_options_are_read_with_their_switch_on():
    assert _loads("arith_grpo.yaml", "engine.optim.schedule=cosine",
                  "engine.optim.min_lr_ratio=0.1").engine.optim.min_lr_ratio == 0.1
    assert _loads("arith_grpo.yaml", "run.on_nonfinite=skip", "run.nonfinite_skip_limit=3").run.nonfinite_skip_limit == 3
    cfg = _loads("arith_grpo.yaml", "cluster.backend=ray", "cluster.num_cpus=4", "cluster.ray_address=auto")
    assert (cfg.cluster.num_cpus, cfg.cluster.ray_address) == (4, "auto")
