"""``algorithm.loss_agg=prompt-mean-token-mean`` (ScaleRL's prompt level): taken by workflow grpo with groups of
several responses; refused, naming the key and the fix, where there are no groups to weigh."""

from __future__ import annotations

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config

PROMPT = "algorithm.loss_agg=prompt-mean-token-mean"


def test_grpo_with_groups_takes_it():
    cfg = load_config(Config, "recipes/arith_grpo.yaml", [PROMPT])
    assert cfg.algorithm.loss_agg == "prompt-mean-token-mean"
    assert load_config(Config, "recipes/arith_grpo.yaml", [PROMPT, "trainer.mini_batches=2"]).trainer.mini_batches == 2


def test_one_response_per_prompt_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.n=1 a prompt has one response.*loss_agg=seq-mean-token-mean"):
        load_config(Config, "recipes/arith_ppo.yaml", [PROMPT, "rollout.n=1"])


@pytest.mark.parametrize("recipe, workflow", [("arith_sft.yaml", "sft"), ("arith_dpo.yaml", "dpo"),
                                              ("arith_kto.yaml", "kto")])
def test_workflows_without_groups_are_refused(recipe, workflow):
    with pytest.raises(ConfigError, match=f"algorithm.loss_agg is read by workflow grpo only \\(this run is workflow {workflow}"):
        load_config(Config, f"recipes/{recipe}", [PROMPT])


def test_gmpo_keeps_its_sequence_mean():
    with pytest.raises(ConfigError, match="gmpo averages its sequence-level objective over sequences"):
        load_config(Config, "recipes/arith_grpo.yaml", [PROMPT, "algorithm.policy_loss=gmpo"])


def test_an_unknown_mode_lists_the_new_one():
    with pytest.raises(ConfigError, match="prompt-mean-token-mean"):
        load_config(Config, "recipes/arith_grpo.yaml", ["algorithm.loss_agg=prompt-mean"])
