"""The error of a dataset that cannot be used (shared by the file readers and the ``datasets`` source)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relayrl.config.eval_flags import eval_flag
from relayrl.errors import UserError

__all__ = ["DatasetError", "missing_field", "missing_column", "duplicate_column"]


class DatasetError(UserError, ValueError):
    """A dataset file that cannot be used, with the file, the row and the reason."""


_CONVERSATIONS = ("messages", "conversations", "conversation", "chat")


def _nested_keys(row: Mapping, key: str) -> str:
    """``; PARENT holds: ...`` for a dotted ``key`` whose leading parts reach a dict of ``row`` that lacks
    the next part (``reward_model.groundtruth``: what ``reward_model`` has); else ``""``."""
    parts, cur, walked = key.split("."), row, []
    for part in parts[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, Mapping):
            break
        cur, walked = nxt, [*walked, part]
    if not walked:
        return ""
    return f"; {'.'.join(walked)} holds: {', '.join(map(str, cur)) or 'nothing'}"


def missing_field(key: str, names, option: str | None = None) -> str:
    """``field KEY is missing (columns present: ...)``, the option that names the field (``option``, e.g.
    ``data.answer_key``, with its ``relayrl eval`` flag where it has one), and the likely fix when a column holds
    whole conversations: they are read with ``data.messages_key`` (SFT). ``names``: the columns, or the row itself
    (a dict: a dotted key's typo then also says what its parent field holds)."""
    row = names if isinstance(names, Mapping) else None
    nested = _nested_keys(row, key) if row is not None and "." in key else ""
    names = [str(n) for n in names]
    text = f"field {key!r} is missing (columns present: {', '.join(names) or 'none'}{nested})"
    chats = [n for n in names if n in _CONVERSATIONS]
    if chats:
        return text + f"; rows of whole conversations: set data.messages_key={chats[0]} (workflow sft)"
    if row is not None and len(row) == 1 and _holds_rows(next(iter(row.values()))):
        (under,) = row
        return text + (f"; this object holds its rows in a list under {under!r}: rewrite the file as JSON lines "
                       f"(one row per line), e.g. jq -c '.{under}[]' FILE > rows.jsonl")
    if option is not None:
        flag = eval_flag(option)
        return text + f"; {option}{f' ({flag} for relayrl eval)' if flag else ''} names the field to read"
    return text


def _holds_rows(value: Any) -> bool:
    """Whether ``value`` looks like a dataset's rows (a list of objects that are not chat messages)."""
    return (isinstance(value, list) and bool(value) and all(isinstance(x, Mapping) for x in value)
            and not any("role" in x for x in value))


def _holds_messages(arrow_type) -> bool:
    """Whether a column of ``arrow_type`` holds chat messages: a list of records with a ``role`` field."""
    import pyarrow as pa

    return ((pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type))
            and pa.types.is_struct(arrow_type.value_type) and arrow_type.value_type.get_field_index("role") >= 0)


def missing_column(schema, keys: tuple[str, ...], options: Mapping[str, str] | None = None,
                   implicit: tuple[str, str] | None = None) -> str | None:
    """The :func:`missing_field` message of the first of ``keys`` that no column of the Arrow ``schema`` holds
    (a dotted key: its first part), or None when every key has one. ``implicit``: ``(prompt_key, answer_key)``,
    the prompt not required when the answer column holds chat messages, since a row without a prompt field then
    takes its prompt from the answer's conversation (TRL's implicit prompt), as a JSONL row does; a Parquet or
    Arrow column has one type, so the schema tells it for every row."""
    names = list(schema.names)
    for key in keys:
        if key in names or key.split(".", 1)[0] in names:
            continue
        if implicit is not None and key == implicit[0] and implicit[1] in names \
                and _holds_messages(schema.field(implicit[1]).type):
            continue
        return missing_field(key, names, (options or {}).get(key))
    return None


def duplicate_column(names) -> str | None:
    """``column NAME appears N times ...`` for the first column name a columnar source (a Parquet or Arrow
    schema) holds more than once, whose row dict would keep one of them unsaid; None when the names are unique."""
    names = [str(n) for n in names]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is None:
        return None
    return (f"column {twice!r} appears {names.count(twice)} times (a row keeps only one of them, and which one "
            f"the file does not say); rename or drop the others")
