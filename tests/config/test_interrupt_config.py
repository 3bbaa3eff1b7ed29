"""``rollout.interrupt``: off by default, ScaleRL's phrase and ``</think>`` as defaults, budgets that cannot fit
``rollout.max_new_tokens`` (or ``eval.max_new_tokens``) refused, and the combinations it cannot run refused naming
the keys."""

from __future__ import annotations

import pytest

from relayrl.config.interrupt import SCALERL_PHRASE
from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config

ON = ["rollout.max_new_tokens=64", "rollout.interrupt.after_tokens=32"]


def _refused(*over: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(Config, "recipes/arith_grpo.yaml", list(over))
    return str(e.value)


def test_off_by_default_and_scalerls_phrase_when_on():
    assert not load_config(Config, "recipes/arith_grpo.yaml", []).rollout.interrupt.enabled
    it = load_config(Config, "recipes/arith_grpo.yaml", ON).rollout.interrupt
    assert it.enabled and it.text == SCALERL_PHRASE and it.marker == "</think>"
    assert it.answer_tokens is None and it.eval


def test_settings_without_a_budget_are_refused():
    msg = _refused("rollout.interrupt.answer_tokens=8")
    assert "rollout.interrupt.answer_tokens is read only with rollout.interrupt.after_tokens set" in msg, msg


@pytest.mark.parametrize("over,key", [
    (["rollout.max_new_tokens=32", "rollout.interrupt.after_tokens=32"], "rollout.max_new_tokens=32"),
    ([*ON, "rollout.interrupt.answer_tokens=40"], "rollout.max_new_tokens=64"),
    ([*ON, "eval.max_new_tokens=16"], "eval.max_new_tokens=16")])
def test_budgets_that_cannot_fit_are_refused(over, key):
    msg = _refused(*over)
    assert f"must fit in {key}, which caps the whole response" in msg, msg


def test_evaluation_without_the_budget_may_have_a_short_cap():
    cfg = load_config(Config, "recipes/arith_grpo.yaml", [*ON, "eval.max_new_tokens=16", "rollout.interrupt.eval=false"])
    assert cfg.eval.max_new_tokens == 16


def test_a_server_and_episodes_are_refused_naming_the_keys():
    msg = _refused(*ON, "rollout.engine=openai", "rollout.base_url=http://127.0.0.1:8000/v1")
    assert "rollout.interrupt" in msg and "rollout.engine=openai" in msg and "use rollout.engine=native or vllm" in msg
    msg = _refused(*ON, "env.name=tools", "rollout.stop_strings=['</tool>']")
    assert "env.name=tools runs multi-turn episodes" in msg and "drop rollout.interrupt.after_tokens or env.name" in msg


def test_the_phrase_that_does_not_fit_is_refused_when_the_tokenizer_loads(tiny_tokenizer):
    """The config can only count the phrase as one token; its real length is checked before any generation."""
    from relayrl.engines.generation.interrupt import InterruptError
    from relayrl.workflows.heldout import interrupts

    cfg = load_config(Config, "recipes/arith_grpo.yaml", ["rollout.max_new_tokens=7", "rollout.interrupt.after_tokens=4",
                                                          "rollout.interrupt.text=' = = ='"])
    with pytest.raises(InterruptError, match="the phrase.s 3 tokens .* rollout.max_new_tokens=7"):
        interrupts(cfg, tiny_tokenizer)
    ok = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_new_tokens": 10})})
    train, evaluation = interrupts(ok, tiny_tokenizer)
    assert train == evaluation and train.answer_tokens == 3 and len(train.forced_ids) == 3
