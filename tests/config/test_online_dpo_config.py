"""``algorithm.advantage=online-dpo`` in the config: the recipe loads and its step plan builds a reference and runs
the pi_old pass; every combination that would not give DPO's gradient is refused, naming the key and the fix."""

from __future__ import annotations

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.plan import step_plan
from relayrl.config.schema import Config

RECIPE = "recipes/arith_online_dpo.yaml"


def _cfg(*over: str) -> Config:
    return load_config(Config, RECIPE, list(over))


def test_the_recipe_plans_a_reference_and_the_pre_update_pass():
    cfg = _cfg()
    a = cfg.algorithm
    assert (a.advantage, a.policy_loss, a.loss_agg, a.kl_coef) == ("online-dpo", "gpg", "seq-mean-token-sum", 0.0)
    assert a.online_dpo.spec().beta == 0.1 and a.online_dpo.spec().kind == "sigmoid"
    plan = step_plan(cfg)
    assert plan.roles == ("actor", "rollout", "reference")  # a reference with kl_coef=0
    assert plan.recompute_old and plan.update == "batch"
    assert {"reference", "old"} <= set(plan.stage("advantages").reads)
    assert any("pi_old pass runs" in n for n in plan.notes)
    # several optimizer steps per batch: the run says at start-up that the coefficients are the first pass's
    notes = step_plan(_cfg("trainer.mini_batches=2")).notes
    assert any("keep those coefficients" in n for n in notes)
    assert not any("keep those coefficients" in n for n in step_plan(cfg).notes)


def test_semi_online_and_periodic_steps_plan_the_same_passes():
    for over in (["trainer.off_policy_steps=1"],
                 ["trainer.mode=periodic", "placement.pools={gen: 1}", "placement.rollout=gen"]):
        plan = step_plan(_cfg(*over))
        assert "reference" in plan.roles and plan.recompute_old and plan.update == "batch", over
        assert {"reference", "old"} <= set(plan.stage("advantages").reads), over


def test_the_options_are_read_and_checked():
    a = _cfg("algorithm.online_dpo.kind=ipo", "algorithm.online_dpo.beta=0.5",
             "algorithm.online_dpo.nll_weight=1").algorithm.online_dpo.spec()
    assert (a.kind, a.beta, a.nll_weight) == ("ipo", 0.5, 1.0)
    with pytest.raises(ConfigError, match="label_smoothing is defined for kind=sigmoid only"):
        _cfg("algorithm.online_dpo.kind=hinge", "algorithm.online_dpo.label_smoothing=0.1")
    with pytest.raises(ConfigError, match="kind"):
        _cfg("algorithm.online_dpo.kind=simpo")  # reference-free kinds take other inputs


@pytest.mark.parametrize("over, match", [
    (["rollout.n=1"], r"rollout.n=1: group advantages \(online-dpo\) need rollout.n >= 2"),
    (["algorithm.policy_loss=ppo"], r"set algorithm.policy_loss=gpg and algorithm.loss_agg=seq-mean-token-sum"),
    (["algorithm.loss_agg=seq-mean-token-mean"], r"set algorithm.policy_loss=gpg and algorithm.loss_agg=seq-mean"),
    (["algorithm.kl_coef=0.05"], r"algorithm.kl_coef=0.05 adds a KL .* set algorithm.kl_coef=0"),
    (["algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true"], r"kl_in_reward=true .* set algorithm.kl_coef=0 and "
                                                                 r"kl_in_reward=false"),
    (["algorithm.tis_cap=2"], r"algorithm.tis_cap weighs .* drop algorithm.tis_cap"),
    (["algorithm.correction.level=token"], r"algorithm.correction weighs .* drop algorithm.correction"),
    (["algorithm.top_entropy_quantile=0.2"], r"set algorithm.top_entropy_quantile=1"),
    (["algorithm.overlong_filter=true"], r"algorithm.overlong_filter .* one side: drop it"),
    (["algorithm.old_logprobs=rollout"], r"old_logprobs=rollout skips: use old_logprobs=auto"),
    (["trainer.tri_model=true"], r"trainer.tri_model .* reads them before .*: drop trainer.tri_model"),
    (["algorithm.gamma=0.9"], r"algorithm.gamma=0.9 .* 'online-dpo' ignores it: set algorithm.gamma=1.0"),
])
def test_combinations_without_dpos_gradient_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(*over)


def test_its_options_are_refused_for_another_estimator():
    with pytest.raises(ConfigError, match=r"algorithm.online_dpo.beta is read by algorithm.advantage=online-dpo "
                                          r"only \(got 'grpo'\)"):
        load_config(Config, "recipes/arith_grpo.yaml", ["algorithm.online_dpo.beta=0.2"])


def test_a_critic_is_never_built_and_the_reference_can_move():
    """No critic: the estimator reads no values (a critic comes only with advantage=gae, one estimator a run).
    The reference it builds with kl_coef=0 is a reference trainer.ref_sync_every may move (TR-DPO's soft update,
    online)."""
    assert "critic" not in step_plan(_cfg()).roles
    assert _cfg("trainer.ref_sync_every=2").trainer.ref_sync_every == 2
    with pytest.raises(ConfigError, match="algorithm.kl_coef=0 loads none"):  # (GRPO without a KL still refuses)
        load_config(Config, "recipes/arith_grpo.yaml", ["trainer.ref_sync_every=2"])


def test_distillation_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # (a model directory, as far as the config checks)
    with pytest.raises(ConfigError, match=r"algorithm.distill.teacher adds a teacher's reverse KL .* drop "
                                          r"algorithm.distill.teacher"):
        _cfg(f"algorithm.distill.teacher={tmp_path}")
