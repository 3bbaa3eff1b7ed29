"""The error of a dataset that cannot be used (shared by the file readers and the ``datasets`` source)."""

from __future__ import annotations

from collections.abc import Mapping

from relayrl.config.eval_flags import eval_flag
from relayrl.errors import UserError

__all__ = ["DatasetError", "missing_field"]


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
    nested = _nested_keys(names, key) if isinstance(names, Mapping) and "." in key else ""
    names = [str(n) for n in names]
    text = f"field {key!r} is missing (columns present: {', '.join(names) or 'none'}{nested})"
    chats = [n for n in names if n in _CONVERSATIONS]
    if chats:
        return text + f"; rows of whole conversations: set data.messages_key={chats[0]} (workflow sft)"
    if option is not None:
        flag = eval_flag(option)
        return text + f"; {option}{f' ({flag} for relayrl eval)' if flag else ''} names the field to read"
    return text
