"""``model.chat_template``: the three forms it takes, refused at config load with the key and the reason, and
on the run's tokenizers (the driver's prompts, the rollout's, the exported model's files)."""

from __future__ import annotations

import json

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config
from relayrl.data.datasets import encode_prompt
from relayrl.data.tasks import Problem
from relayrl.models.chat_template import read_chat_template
from relayrl.models.load import load_tokenizer
from relayrl.models.tiny import CHAT_TEMPLATE

MARKERS = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}<<assistant>>{% endif %}")
"""A template unlike the tiny tokenizer's ChatML one, recognisable in a decoded prompt."""
CHAT = Problem("12+30=", "42", meta={"messages": [{"role": "user", "content": "12+30="}]})


def _error(value: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, [f"model.chat_template={value}"])
    return str(e.value)


def test_a_missing_file_a_directory_without_a_template_and_a_broken_template_are_refused_naming_the_key(tmp_path):
    msg = _error(str(tmp_path / "chatml.jinja"))
    assert f"model.chat_template: '{tmp_path / 'chatml.jinja'}' is no file or directory here, nor a template" in msg
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    msg = _error(str(tmp_path / "tok"))
    assert f"model.chat_template: directory {tmp_path / 'tok'} holds no chat template" in msg
    msg = _error("{% for m in messages %}{{ m['content'] }}")  # no endfor
    assert "model.chat_template: the template does not compile as a Jinja template: Unexpected end of template" in msg
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages | no_such_filter }}")
    assert f"model.chat_template: {bad} does not compile as a Jinja template: No filter named 'no_such_filter'" \
        in _error(str(bad))
    (tmp_path / "empty.j2").write_text("\n")
    assert f"model.chat_template: the template in {tmp_path / 'empty.j2'} is empty" in _error(str(tmp_path / "empty.j2"))
    assert "model.chat_template: is empty" in _error("")


def test_the_three_forms_give_the_template(tmp_path, tiny_dir):
    assert read_chat_template(MARKERS) == MARKERS
    (tmp_path / "markers.jinja").write_text(MARKERS)
    assert read_chat_template(str(tmp_path / "markers.jinja")) == MARKERS
    assert read_chat_template(str(tiny_dir)) == CHAT_TEMPLATE  # its chat_template.jinja
    old = tmp_path / "old"  # a tokenizer saved before chat_template.jinja: the field of tokenizer_config.json
    old.mkdir()
    (old / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ 1 }}"}, {"name": "default", "template": MARKERS}]}))
    assert read_chat_template(str(old)) == MARKERS
    # the generation tag of assistant masks (docs/episodes.md) compiles as transformers compiles it
    masked = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert load_config(Config, None, [f"model.chat_template={masked}"]).model.template() == masked


def test_the_run_renders_chat_prompts_with_it_and_its_saved_tokenizer_keeps_it(tmp_path, tiny_dir):
    tok = load_tokenizer(tiny_dir, chat_template=MARKERS)
    assert tok.decode(encode_prompt(tok, CHAT)) == "<<user>>12+30=\n<<assistant>>"
    assert load_tokenizer(tiny_dir).decode(encode_prompt(load_tokenizer(tiny_dir), CHAT)).startswith("<|im_start|>user")
    tok.save_pretrained(tmp_path / "model")  # what PolicyWorker.save_pretrained writes beside the weights
    again = load_tokenizer(tmp_path / "model")
    assert again.chat_template == MARKERS and encode_prompt(again, CHAT) == encode_prompt(tok, CHAT)


def test_the_session_and_the_rollout_workers_get_it(tmp_path, tiny_dir):
    from relayrl.workflows.heldout import EvalSession
    from relayrl.workflows.roles import rollout_init
    from relayrl.workflows.rollout_worker import RolloutWorker

    (tmp_path / "markers.jinja").write_text(MARKERS)
    cfg = load_config(Config, None, [f"model.path={tiny_dir}", f"model.chat_template={tmp_path / 'markers.jinja'}",
                                     "eval.size=4", "run.threads=1", "model.device=cpu"])
    s = EvalSession(cfg, report_dir=tmp_path / "eval", log=lambda line: None)
    assert s.tokenizer.decode(encode_prompt(s.tokenizer, CHAT)) == "<<user>>12+30=\n<<assistant>>"
    assert RolloutWorker(**rollout_init(cfg, str(tiny_dir))).tokenizer.chat_template == MARKERS


def test_the_checkpoint_fingerprint_holds_it():
    from relayrl.checkpoint.rundir import config_differences

    saved = load_config(Config, None, []).model_dump(mode="json")
    now = load_config(Config, None, [f"model.chat_template={MARKERS}"]).model_dump(mode="json")
    assert config_differences(saved, now) == [f"model.chat_template: checkpoint None, now {MARKERS!r}"]
