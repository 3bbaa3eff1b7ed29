"""The error of a dataset that cannot be used (shared by the file readers and the ``datasets`` source)."""

from __future__ import annotations

from relayrl.errors import UserError

__all__ = ["DatasetError"]


class DatasetError(UserError, ValueError):
    """A dataset file that cannot be used, with the file, the row and the reason."""
