"""data.chat_template_kwargs: the variables reach the chat template wherever relayrl renders with it (prompts,
SFT conversation masks, tool messages), and bad names are refused with the key."""

from __future__ import annotations

import pytest

from relayrl.data.chat import conversation_ids
from relayrl.data.datasets import encode_prompt, render_prompt
from relayrl.data.tasks import Problem
from relayrl.environments.tools import chat_tool_turn

TEMPLATE = ("{% if mode is defined %}[{{ mode }}]{% endif %}{% for m in messages %}<{{ m['role'] }}>"
            "{% if m['role'] == 'tool' and mode is defined %}{{ mode }}:{% endif %}{{ m['content'] }}</{{ m['role'] }}>"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def tok(tiny_dir):
    from relayrl.models.load import load_tokenizer

    t = load_tokenizer(tiny_dir)
    t.chat_template = TEMPLATE
    return t


def test_prompts_render_with_the_variables(tok):
    chat = Problem("1+1=", "2", meta={"messages": [{"role": "user", "content": "1+1="}]})
    assert render_prompt(tok, chat) == "<user>1+1=</user><assistant>"
    assert render_prompt(tok, chat, None, {"mode": "fast"}) == "[fast]<user>1+1=</user><assistant>"
    assert tok.decode(encode_prompt(tok, chat, None, {"mode": "fast"})).startswith("[fast]")
    text = Problem("1+1=", "2")  # a text prompt: no template unless data.chat_template=true
    assert render_prompt(tok, text, None, {"mode": "fast"}) == "1+1="
    assert render_prompt(tok, text, True, {"mode": "fast"}) == "[fast]<user>1+1=</user><assistant>"


def test_sft_masks_and_tool_turns_render_with_the_variables(tok):
    talk = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    prompt, (response, mask) = conversation_ids(tok, talk, {"mode": "x"})
    assert tok.decode(prompt).replace(" ", "").startswith("[x]<user>") and tok.decode(response).startswith("4")
    assert sum(mask) > 0
    plain_prompt, _ = conversation_ids(tok, talk)
    assert not tok.decode(plain_prompt).startswith("[")
    assert chat_tool_turn(tok, {"mode": "x"})("9") == "</assistant><tool>x:9</tool><assistant>"
    assert chat_tool_turn(tok)("9") == "</assistant><tool>9</tool><assistant>"


def test_the_config_refuses_what_a_template_cannot_read():
    from relayrl.config.loader import ConfigError, load_config
    from relayrl.config.schema import Config

    cfg = load_config(Config, "recipes/arith_grpo.yaml", ["data.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    for over, msg in ((["data.chat_template_kwargs={add_generation_prompt: true}"], "apply_chat_template's own"),
                      (["data.chat_template_kwargs={'a-b': 1}"], "not a name a template can read"),
                      (["data.chat_template_kwargs={x: 1}", "data.chat_template=false"], "never applies")):
        with pytest.raises(ConfigError, match=msg):
            load_config(Config, "recipes/arith_grpo.yaml", over)
