"""One row of a user dataset -> a :class:`~relayrl.data.tasks.Problem`, or a :class:`DatasetError` naming the row
and what is wrong: the prompt (text or chat messages, a system prompt put first), the ground truth (text, a number,
or for a user reward function a :class:`~relayrl.data.truth.GroundTruth`; cut by ``answer_regex``), a preference
row's rejected answer, a KTO label, a whole conversation (multi-turn SFT), and TRL's conversational and
implicit-prompt rows. Reading the rows out of a file is :mod:`relayrl.data.datasets`'s."""

from __future__ import annotations

import math
import re
from typing import Any

from relayrl.data.dataset_config import DatasetConfig, key_options
from relayrl.data.errors import DatasetError, missing_field
from relayrl.data.prompts import render_plain, render_prompt
from relayrl.data.tasks import Problem
from relayrl.data.truth import GroundTruth, plain

__all__ = ["CHAT_ROLES", "BadRow", "row_problem"]

_MISSING = object()


def _get(row: dict, key: str) -> Any:
    """``row[key]``; a dotted key walks nested dicts when no field has that literal name."""
    if key in row:
        return row[key]
    if "." not in key:
        return _MISSING
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


class BadRow(str):
    """A row that could not even be parsed; the string says why (yielded in place of the row)."""


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles a message may have."""


def _check_messages(msgs: list, where: str, key: str) -> list[dict[str, str]]:
    if not msgs:
        raise DatasetError(f"{where}: field {key!r} is an empty list of messages")
    out = []
    for j, m in enumerate(msgs, start=1):
        if not isinstance(m, dict):
            raise DatasetError(f"{where}: field {key!r} message {j} is {type(m).__name__}; expected {{'role', 'content'}}")
        for part in ("role", "content"):
            if part not in m:
                raise DatasetError(f"{where}: field {key!r} message {j} has no {part!r} (keys: {', '.join(map(str, m)) or 'none'})")
            if not isinstance(m[part], str):
                raise DatasetError(
                    f"{where}: field {key!r} message {j} {part!r} is {type(m[part]).__name__}; expected a string"
                )
        dropped = next((k for k, v in m.items() if k not in ("role", "content") and v is not None), None)
        if dropped is not None:
            raise DatasetError(f"{where}: field {key!r} message {j} has key {dropped!r}, which relayrl does not render "
                               f"(a message is its role and content), so the model would not see it; drop the key "
                               f"or write it into the content")
        if m["role"] not in CHAT_ROLES:
            raise DatasetError(f"{where}: field {key!r} message {j} has role {m['role']!r}; expected one of "
                               f"{', '.join(CHAT_ROLES)}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise DatasetError(f"{where}: field {key!r} message {j} is an empty assistant turn (nothing to learn "
                               f"or compare against)")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def row_problem(row: Any, rowno: int, cfg: DatasetConfig, tokenizer, label: str | None = None) -> Problem:
    if isinstance(row, BadRow):
        raise DatasetError(str(row))
    where = f"{label or cfg.label} row {rowno}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object with fields, got {type(row).__name__}")
    if cfg.messages_key is not None:
        return _conversation_problem(row, rowno, where, cfg)
    prompt = _get(row, cfg.prompt_key)
    answer = _get(row, cfg.answer_key)
    if prompt is _MISSING and _is_messages(answer):  # TRL's implicit prompt: whole conversations
        prompt = _implicit_prompt(row, answer, where, cfg)
    for key, value in ((cfg.prompt_key, prompt), (cfg.answer_key, answer)):
        if value is _MISSING:
            raise DatasetError(f"{where}: {missing_field(key, row, key_options(cfg).get(key))}")
        if value is None:
            raise DatasetError(f"{where}: field {key!r} is null")
    meta: dict[str, Any] = {"row": rowno, "source": str(cfg.path or cfg.hf_name)}
    if isinstance(prompt, str) and not prompt.strip():
        raise DatasetError(f"{where}: field {cfg.prompt_key!r} is an empty string")
    if isinstance(prompt, str) and cfg.system_prompt is None:
        text = prompt
    elif isinstance(prompt, (list, str)):
        messages = (_check_messages(prompt, where, cfg.prompt_key) if isinstance(prompt, list)
                    else [{"role": "user", "content": prompt}])
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        meta["messages"] = messages
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            text = render_prompt(tokenizer, Problem("", "", {"messages": messages}), None)
        else:
            text = render_plain(messages)
    else:
        raise DatasetError(
            f"{where}: field {cfg.prompt_key!r} is {type(prompt).__name__}; expected a string or a list of "
            "{'role', 'content'} messages"
        )
    asked = [m for m in (prompt, meta.get("messages")) if isinstance(m, list)]  # (as given, and with the system prompt)
    answer = _ground_truth(_reply(answer, asked, where, cfg.answer_key), where, cfg)
    if cfg.answer_regex is not None:
        answer = _cut_answer(answer, cfg.answer_regex, where, cfg.answer_key)
    if cfg.rejected_key is not None:
        rejected = _rejected_answer(row, asked, where, cfg)
        if rejected.strip() == answer.strip():  # (both as trained: cut by answer_regex alike)
            raise DatasetError(f"{where}: the rejected answer equals the chosen one ({rejected!r}"
                               f"{'' if rejected == answer else f' against {answer!r}, apart from spaces'})")
        meta["rejected"] = rejected
    if cfg.label_key is not None:
        meta["label"] = _label(row, where, cfg.label_key, key_options(cfg).get(cfg.label_key))
    extra = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.answer_key, cfg.rejected_key,
                                                       cfg.label_key)}
    if extra:
        meta["extra"] = extra
    # what a user reward function gets: the row as it was, its prompt under "prompt" (messages, or the text)
    meta["fields"] = {**{k: v for k, v in row.items() if k != cfg.prompt_key}, "prompt": meta.get("messages", prompt)}
    return Problem(text, answer, meta)


def _rejected_answer(row: dict, asked: list[list], where: str, cfg: DatasetConfig) -> str:
    """A preference row's rejected answer as it is trained: its text (a reply after one of the prompt's
    message lists ``asked``, as the chosen one), cut by ``answer_regex`` as the chosen answer is, so the two
    sides of a pair are compared and trained alike (a rejected answer without a match is refused, as a chosen
    one is)."""
    key = cfg.rejected_key
    value = _get(row, key)
    if value is _MISSING:  # (named as a missing chosen answer is, with the option that names the field)
        missing = missing_field(key, row, key_options(cfg).get(key))
        raise DatasetError(f"{where}: {missing.replace(f'field {key!r}', f'field {key!r} (the rejected answer)', 1)}")
    text = _answer_text(_reply(value, asked, where, key), where, key)
    return text if cfg.answer_regex is None else _cut_answer(text, cfg.answer_regex, where, key)


_LABELS = {"true": True, "false": False, "1": True, "0": False}


def _label(row: dict, where: str, key: str, option: str | None = None) -> bool:
    """A row's desirable / undesirable label: a bool, 1 / 0, or the strings 'true' / 'false' / '1' / '0'.
    ``option``: the config key that names the field, named when the row lacks it."""
    value = _get(row, key)
    if value is _MISSING:
        raise DatasetError(f"{where}: {missing_field(key, row, option)} (the label: true for a desirable "
                           f"completion, false for an undesirable one)")
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _LABELS:
        return _LABELS[value.strip().lower()]
    raise DatasetError(f"{where}: field {key!r} is {value!r}; expected a boolean label (true for a desirable "
                       f"completion, false for an undesirable one; 1/0 and 'true'/'false' are read too)")


def _is_messages(value: Any) -> bool:
    """Whether a field holds chat messages: a list of dicts, one at least with a ``role`` (a list of other
    records -- a verl ground truth of test cases ``[{"input": ..., "output": ...}]`` -- is a value)."""
    return (isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)
            and any("role" in m for m in value))


def _implicit_prompt(row: dict, chosen: list, where: str, cfg: DatasetConfig) -> list:
    """The prompt of a row with no prompt field whose answer is a whole conversation (TRL's "implicit prompt"
    preference rows: ``chosen`` and ``rejected`` each a conversation ending in the assistant's reply): the
    messages before that reply, which the rejected conversation must share."""
    msgs = _check_messages(chosen, where, cfg.answer_key)
    if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
        raise DatasetError(f"{where}: field {cfg.prompt_key!r} is missing and field {cfg.answer_key!r} is not a "
                           f"conversation ending in an assistant reply, from which to take the prompt")
    rejected = _get(row, cfg.rejected_key) if cfg.rejected_key is not None else _MISSING
    if isinstance(rejected, list):
        other = _check_messages(rejected, where, cfg.rejected_key)
        if other[:-1] != msgs[:-1]:
            raise DatasetError(f"{where}: fields {cfg.answer_key!r} and {cfg.rejected_key!r} are conversations "
                               f"that differ before their last reply; with no {cfg.prompt_key!r} field the prompt "
                               f"is what they share")
    return msgs[:-1]


def _reply(value: Any, prompts: list[list], where: str, key: str) -> Any:
    """An answer given as chat messages (TRL's conversational rows: ``[{"role": "assistant", ...}]``, or the
    whole conversation, one of the prompt's message lists ``prompts`` first) as the text of its one assistant
    reply; anything else as it is."""
    if not _is_messages(value):
        return value
    msgs = _check_messages(value, where, key)
    for p in prompts:
        if msgs[:len(p)] == [{"role": m["role"], "content": m["content"]} for m in p]:
            msgs = msgs[len(p):]
            break
    if len(msgs) != 1 or msgs[0]["role"] != "assistant":
        got = ", ".join(m["role"] for m in msgs) or "nothing"
        raise DatasetError(f"{where}: field {key!r} holds messages; relayrl takes one assistant reply after the "
                           f"prompt (got {got} after it)")
    return msgs[0]["content"]


def _answer_text(value: Any, where: str, key: str) -> str:
    """An answer field as text: a non-empty string, or a finite number."""
    if value is None:
        raise DatasetError(f"{where}: field {key!r} is null")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field {key!r} is {type(value).__name__}; expected a string or a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise DatasetError(f"{where}: field {key!r} is {value}, not an answer")
    if isinstance(value, str) and not value.strip():
        raise DatasetError(f"{where}: field {key!r} must be a non-empty string, got {value!r} (there is no answer "
                           f"to train on or verify against)")
    return value if isinstance(value, str) else str(value)


def _ground_truth(value: Any, where: str, cfg: DatasetConfig) -> str:
    """A row's answer: its text (:func:`_answer_text`), or with ``cfg.raw_answers`` a number, list, dict or
    boolean as a :class:`GroundTruth` (a number as its text); a list, dict or boolean read for anything else,
    or cut by ``answer_regex``, is refused with the fix."""
    value, key = plain(value), cfg.answer_key
    if not isinstance(value, (bool, list, dict)):
        text = _answer_text(value, where, key)
        return GroundTruth.of(value) if cfg.raw_answers and not isinstance(value, str) else text
    if cfg.raw_answers and cfg.answer_regex is None:
        return GroundTruth.of(value)
    if cfg.raw_answers:
        raise DatasetError(f"{where}: field {key!r} is {type(value).__name__}; answer_regex "
                           f"{cfg.answer_regex!r} cuts the answer out of text: set data.answer_regex=null to "
                           f"score the value as the file has it")
    inner = next((k for k, v in value.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)),
                 None) if isinstance(value, dict) else None
    point = "" if inner is None else f", or set data.answer_key={key}.{inner} (a text or number inside it)"
    kind = type(value).__name__
    raise DatasetError(f"{where}: field {key!r} is {kind}; expected a string or a number (relayrl's built-in "
                       f"verifiers compare text, and workflows sft, dpo, kto and rm train on it): score a {kind} "
                       f"ground truth with a reward function of yours, which gets it as the file has it (a verl "
                       f"compute_score's ground_truth), reward.verifier=user reward.user_fn=FILE.py:compute_score "
                       f"with workflow grpo{point}")


def _cut_answer(text: str, pattern: str, where: str, key: str) -> str:
    """The answer inside a worked solution: ``pattern``'s first group (or whole match), stripped."""
    m = re.search(pattern, text)
    if m is None:
        tail = text if len(text) <= 80 else "..." + text[-77:]
        raise DatasetError(f"{where}: field {key!r} ({tail!r}) has no match for answer_regex {pattern!r}")
    cut = (m.group(1) if m.re.groups else m.group(0)).strip()
    if not cut:
        raise DatasetError(f"{where}: answer_regex {pattern!r} matched an empty answer in field {key!r}")
    return cut


def _conversation_problem(row: dict, rowno: int, where: str, cfg: DatasetConfig) -> Problem:
    """A whole conversation (multi-turn SFT): ``meta["conversation"]`` holds every message; the prompt is the
    conversation up to its first assistant turn and the answer that turn (what evaluation compares)."""
    msgs = _get(row, cfg.messages_key)
    if not isinstance(msgs, list):
        raise DatasetError(f"{where}: field {cfg.messages_key!r} must be a list of {{'role', 'content'}} messages, got "
                           f"{'nothing' if msgs is _MISSING else type(msgs).__name__}")
    messages = _check_messages(msgs, where, cfg.messages_key)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise DatasetError(f"{where}: field {cfg.messages_key!r} needs a user turn followed by an assistant turn to "
                           f"train on")
    return Problem(render_plain(messages[:first]), messages[first]["content"],
                   {"row": rowno, "source": str(cfg.path or cfg.hf_name), "messages": messages[:first], "conversation": messages})
