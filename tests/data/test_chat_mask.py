"""Multi-turn SFT trains only the assistant turns: the mask from the chat template against a hand-built one."""

from __future__ import annotations

import json

import pytest

from relayrl.data.chat import ChatMaskError, assistant_mask, conversation_ids

CONVERSATION = [
    {"role": "system", "content": "Add numbers."},
    {"role": "user", "content": "12+30="},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "and 5+5="},
    {"role": "assistant", "content": "10"},
]


def hand_built(tok):
    """ChatML by hand: each piece tokenized on its own, 1 on the assistant's reply and its closing tokens."""
    ids, mask = [], []

    def piece(text, m):
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(t)
        mask.extend([m] * len(t))

    for msg in CONVERSATION:
        piece("<|im_start|>", 0)
        piece(msg["role"] + "\n", 0)
        a = int(msg["role"] == "assistant")
        piece(msg["content"], a)
        piece("<|im_end|>", a)
        piece("\n", a)
    return ids, mask


def test_prefix_mask_matches_the_hand_built_one(tiny_tokenizer):
    ids, mask = assistant_mask(tiny_tokenizer, CONVERSATION)
    want_ids, want_mask = hand_built(tiny_tokenizer)
    assert ids == want_ids and mask == want_mask
    trained = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "42<|im_end|>\n10<|im_end|>\n"


def test_generation_markers_give_the_same_mask_where_the_template_has_them(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids, mask = assistant_mask(tok, CONVERSATION)
    assert (ids, mask) == hand_built(tiny_tokenizer)


def test_conversation_row_starts_at_the_first_assistant_token(tiny_tokenizer):
    prompt, (resp, mask) = conversation_ids(tiny_tokenizer, CONVERSATION)
    ids, full = hand_built(tiny_tokenizer)
    assert prompt + resp == ids and mask == full[len(prompt):] and mask[0] == 1 and sum(full[:len(prompt)]) == 0


def test_no_assistant_turn_is_refused(tiny_tokenizer):
    with pytest.raises(ChatMaskError, match="no assistant"):
        assistant_mask(tiny_tokenizer, CONVERSATION[:2])


def test_sft_loads_conversations_and_trains_only_assistant_tokens(tmp_path, tiny_dir):
    from relayrl.config.schema import Config
    from relayrl.workflows.sft import masked_batch
    from relayrl.workflows.session import Session

    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(4)) + "\n")
    cfg = Config(workflow="sft", run={"dir": str(tmp_path / "run")}, model={"path": str(tiny_dir)},
                 data={"task": None, "path": str(path), "messages_key": "messages"}, eval={"size": 2},
                 reward={"verifier": "exact"})
    s = Session(cfg, log=lambda m: None)
    p = s.prompts.take(1)[0]
    assert p.answer == "42" and p.meta["conversation"] == CONVERSATION
    from relayrl.data.chat import conversation_ids as rows

    batch = masked_batch([rows(s.tokenizer, p.meta["conversation"])])
    assert batch.num_tokens == sum(hand_built(s.tokenizer)[1])
    with pytest.raises(ValueError, match="messages_key"):
        Config(workflow="grpo", data={"task": None, "path": str(path), "messages_key": "messages"},
               reward={"verifier": "exact"})


UNSTABLE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% if loop.last %} END{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A template that marks the last message: a prefix of the conversation is not rendered as the start of the whole."""


def test_conversations_are_checked_before_training_naming_the_row(tmp_path, tiny_dir):
    """A conversation the template cannot mask is refused when the session loads its training rows (the 4 not
    held out): a DatasetError naming the file and the row, not a ChatMaskError traceback in the first step."""
    from relayrl.config.schema import Config
    from relayrl.data.errors import DatasetError
    from relayrl.workflows.session import Session

    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(6)) + "\n")
    cfg = Config(workflow="sft", run={"dir": str(tmp_path / "run")},
                 model={"path": str(tiny_dir), "chat_template": UNSTABLE},
                 data={"task": None, "path": str(path), "messages_key": "messages"}, eval={"size": 2},
                 reward={"verifier": "exact"})
    with pytest.raises(DatasetError, match=r"chats.jsonl: 4 bad rows.*\n  chats.jsonl row 1: the chat template "
                                           r"renders the conversation up to message 3 differently"):
        Session(cfg, log=lambda m: None)


def test_a_template_that_renders_no_assistant_token_is_refused(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    with pytest.raises(ChatMaskError, match="renders none of the assistant's tokens"):
        conversation_ids(tok, CONVERSATION)


def test_the_turn_end_a_rollout_would_not_stop_at_is_named(tiny_tokenizer):
    """The tiny template closes a turn with <|im_end|>, its EOS is <|endoftext|>: a model trained on its
    conversations ends a reply where the rollout does not stop, unless rollout.stop_strings names it."""
    from relayrl.data.chat import unstopped_turn_end

    line = unstopped_turn_end(tiny_tokenizer, {}, ())
    assert "ends an assistant turn with '<|im_end|>'" in line and "rollout.stop_strings=['<|im_end|>']" in line
    assert unstopped_turn_end(tiny_tokenizer, {}, ("<|im_end|>",)) is None
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = tok.chat_template.replace("<|im_end|>", "<|endoftext|>")
    assert unstopped_turn_end(tok, {}, ()) is None  # the turn ends at the EOS


def test_a_session_on_chat_rows_names_the_turn_end_to_stop_at(tmp_path, tiny_dir):
    from relayrl.config.schema import Config
    from relayrl.workflows.session import Session

    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(6)) + "\n")
    lines: list[str] = []
    for stops in ([], ["<|im_end|>"]):
        cfg = Config(workflow="sft", run={"dir": str(tmp_path / f"run{len(stops)}")}, model={"path": str(tiny_dir)},
                     data={"task": None, "path": str(path), "messages_key": "messages"}, eval={"size": 2},
                     reward={"verifier": "exact"}, rollout={"stop_strings": stops})
        Session(cfg, log=lines.append)
    assert sum("rollout.stop_strings=['<|im_end|>']" in line for line in lines) == 1


def test_a_turn_end_the_generation_config_lists_is_not_named(tmp_path, tiny_model, tiny_tokenizer, eos_listed):
    """An instruct checkpoint lists its turn end among generation_config.json's eos ids (Gemma-it's
    <end_of_turn>, beside the tokenizer's <eos>): the engines stop there, so the run names no fix."""
    from relayrl.config.schema import Config
    from relayrl.data.chat import unstopped_turn_end
    from relayrl.workflows.session import Session

    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert unstopped_turn_end(tiny_tokenizer, {}, (), eos={end}) is None
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(6)) + "\n")
    lines: list[str] = []
    cfg = Config(workflow="sft", run={"dir": str(tmp_path / "run")},
                 model={"path": str(eos_listed(tiny_model, tiny_tokenizer, end))},
                 data={"task": None, "path": str(path), "messages_key": "messages"}, eval={"size": 2},
                 reward={"verifier": "exact"})
    Session(cfg, log=lines.append)
    assert not any("rollout.stop_strings" in line for line in lines)
