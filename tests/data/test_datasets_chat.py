"""Chat templates applied through the tokenizer (the tiny ChatML tokenizer) when prompts are encoded."""

import copy
import json

import pytest

from relayrl.data.datasets import DatasetConfig, DatasetError, encode_prompt, load_problems, render_prompt
from relayrl.data.tasks import Problem

MESSAGES = [{"role": "system", "content": "Add the numbers."}, {"role": "user", "content": "12+30="}]
CHATML = "<|im_start|>system\nAdd the numbers.<|im_end|>\n<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def chat_file(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"prompt": MESSAGES, "answer": 42}) + "\n" + json.dumps({"prompt": "7+1=", "answer": "8"}) + "\n")
    return f


def test_auto_applies_template_only_to_chat_prompts(chat_file, tiny_tokenizer):
    chat, text = load_problems(DatasetConfig(path=chat_file))
    assert chat.meta["messages"] == MESSAGES and chat.answer == "42"
    assert render_prompt(tiny_tokenizer, chat) == CHATML
    ids = encode_prompt(tiny_tokenizer, chat)
    assert ids == tiny_tokenizer(CHATML, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == CHATML  # special tokens are single tokens and round-trip
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert encode_prompt(tiny_tokenizer, text) == tiny_tokenizer("7+1=")["input_ids"]


def test_forced_on_and_off(chat_file, tiny_tokenizer):
    chat, text = load_problems(DatasetConfig(path=chat_file))
    wrapped = tiny_tokenizer.decode(encode_prompt(tiny_tokenizer, text, chat_template=True))
    assert wrapped == "<|im_start|>user\n7+1=<|im_end|>\n<|im_start|>assistant\n"
    plain = encode_prompt(tiny_tokenizer, chat, chat_template=False)
    assert tiny_tokenizer.decode(plain) == "system: Add the numbers.\nuser: 12+30="


def test_load_with_tokenizer_renders_chat_prompt_text(chat_file, tiny_tokenizer):
    chat, text = load_problems(DatasetConfig(path=chat_file), tokenizer=tiny_tokenizer)
    assert chat.prompt == CHATML
    assert text.prompt == "7+1="


def test_tokenizer_without_template_is_a_clear_error(chat_file, tiny_tokenizer):
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    chat, _ = load_problems(DatasetConfig(path=chat_file), tokenizer=bare)
    assert chat.prompt == "system: Add the numbers.\nuser: 12+30="
    with pytest.raises(DatasetError, match="chat_template=True but tokenizer .* has no chat template"):
        encode_prompt(bare, Problem("1+1=", "2"), chat_template=True)
    with pytest.raises(DatasetError, match=r"the prompt is chat messages \(the row.s, or its text with "
                                           r"data.system_prompt.s message\) but .* set data.chat_template=false"):
        encode_prompt(bare, chat)
    assert encode_prompt(bare, chat, chat_template=False) == bare(chat.prompt)["input_ids"]


def _rows(tmp_path, rows, **cfg):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_problems(DatasetConfig(path=str(path), **cfg))


USER = [{"role": "user", "content": "2+2?"}]


def test_conversational_answers_as_trl_writes_them(tmp_path):
    """TRL's conversational rows: a prompt-completion pair, an explicit-prompt preference pair, and an
    implicit-prompt one (whole conversations, the prompt their shared start)."""
    p = _rows(tmp_path, [{"prompt": USER, "completion": [{"role": "assistant", "content": "4"}]}],
              answer_key="completion")[0]
    assert p.answer == "4" and p.meta["messages"] == USER
    p = _rows(tmp_path, [{"prompt": USER, "chosen": [{"role": "assistant", "content": "4"}],
                          "rejected": [{"role": "assistant", "content": "5"}]}],
              answer_key="chosen", rejected_key="rejected")[0]
    assert (p.answer, p.meta["rejected"]) == ("4", "5")
    p = _rows(tmp_path, [{"chosen": [*USER, {"role": "assistant", "content": "4"}],
                          "rejected": [*USER, {"role": "assistant", "content": "5"}]}],
              answer_key="chosen", rejected_key="rejected")[0]
    assert (p.answer, p.meta["rejected"], p.meta["messages"]) == ("4", "5", USER)
    # a whole conversation under the answer, the prompt given too (and a system prompt added to it)
    p = _rows(tmp_path, [{"prompt": USER, "answer": [*USER, {"role": "assistant", "content": "4"}]}],
              system_prompt="Be brief.")[0]
    assert p.answer == "4" and p.meta["messages"][0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("row, cfg, says", [
    ({"chosen": [*USER, {"role": "assistant", "content": "4"}],
      "rejected": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "5"}]},
     {"answer_key": "chosen", "rejected_key": "rejected"}, "conversations that differ before their last reply"),
    ({"prompt": USER, "answer": [{"role": "assistant", "content": "4"}, {"role": "user", "content": "sure?"}]}, {},
     "one assistant reply after the prompt (got assistant, user after it)"),
    ({"chosen": USER}, {"answer_key": "chosen"}, "not a conversation ending in an assistant reply"),
])
def test_conversational_answers_relayrl_cannot_take_name_the_row(tmp_path, row, cfg, says):
    with pytest.raises(DatasetError, match="row 1") as e:
        _rows(tmp_path, [row], **cfg)
    assert says in str(e.value)


def test_a_message_key_besides_role_and_content_is_refused_not_dropped(tmp_path):
    """A message is rendered from its role and content only: a tool call (or any other non-null key) would be
    left out of what the model sees and learns, so the row is refused naming the key; a null one (Arrow gives
    every message of a column the keys of all) is no content, and passes."""
    call = {"role": "assistant", "content": "Let me add.", "tool_calls": [{"function": {"name": "add"}}]}
    with pytest.raises(DatasetError, match=r"row 1: field 'messages' message 2 has key 'tool_calls', which relayrl "
                                           r"does not render"):
        _rows(tmp_path, [{"messages": [*USER, call]}], messages_key="messages")
    with pytest.raises(DatasetError, match=r"row 1: field 'chosen' message 1 has key 'tool_calls'"):
        _rows(tmp_path, [{"prompt": USER, "chosen": [call], "rejected": [{"role": "assistant", "content": "5"}]}],
              answer_key="chosen", rejected_key="rejected")
    p = _rows(tmp_path, [{"prompt": [{"role": "user", "content": "2+2?", "tool_calls": None}], "answer": "4"}])[0]
    assert p.meta["messages"] == USER


def test_a_chat_row_and_a_text_row_of_the_same_plain_text_encode_apart(tmp_path, tiny_dir):
    """The run encodes each prompt once and caches it: a chat row and a text row whose plain text agrees
    (``system: ...\\nuser: ...``) must not share the cache entry, nor two chat rows offering other tools."""
    from relayrl.config.loader import load_run_config
    from relayrl.data.datasets import prompt_identity
    from relayrl.workflows.problems import RunProblems

    chat = Problem("system: Add the numbers.\nuser: 12+30=", "42", {"messages": MESSAGES})
    text = Problem(chat.prompt, "42")
    tools = Problem(chat.prompt, "42", {"messages": MESSAGES, "tools": [{"name": "add"}]})
    assert len({prompt_identity(p) for p in (chat, text, tools)}) == 3
    assert prompt_identity(text) == text.prompt
    cfg = load_run_config("arith_grpo", [f"trainer.init_from={tiny_dir}"])
    run = RunProblems(cfg, training=False, log=lambda _: None)
    tok = run.tokenizer
    assert run.encode(text) == tok(text.prompt)["input_ids"]
    assert run.encode(chat) == tok(CHATML, add_special_tokens=False)["input_ids"]
    assert run.encode(text) == tok(text.prompt)["input_ids"]  # (from the cache)


def test_a_prompt_ending_with_the_assistant_s_words_is_continued(tiny_tokenizer):
    """(A prefill was closed with an end of turn and a new assistant turn opened after it; TRL continues it.)"""
    msgs = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "The answer is"}]
    text = render_prompt(tiny_tokenizer, Problem("", "3", {"messages": msgs}))
    assert text == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\nThe answer is"
    assert text == tiny_tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    asked = render_prompt(tiny_tokenizer, Problem("", "3", {"messages": msgs[:1]}))
    assert asked == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"  # a user turn still gets its reply
