"""The error of a dataset that cannot be used (shared by the file readers and the ``datasets`` source)."""

from __future__ import annotations

from relayrl.errors import UserError

__all__ = ["DatasetError", "missing_field"]


class DatasetError(UserError, ValueError):
    """A dataset file that cannot be used, with the file, the row and the reason."""


_CONVERSATIONS = ("messages", "conversations", "conversation", "chat")


def missing_field(key: str, names) -> str:
    """``field KEY is missing (columns present: ...)``, and the likely fix when a column holds whole
    conversations: they are read with ``data.messages_key`` (SFT)."""
    names = [str(n) for n in names]
    text = f"field {key!r} is missing (columns present: {', '.join(names) or 'none'})"
    chats = [n for n in names if n in _CONVERSATIONS]
    if chats:
        return text + f"; rows of whole conversations: set data.messages_key={chats[0]} (workflow sft)"
    return text
