"""Paths a config names: ``~`` is the user's home, as in a shell (a recipe or a quoted override would
otherwise keep a literal ``~`` directory), and an empty path is refused rather than read as the current
directory (``run.dir=`` trained into the working directory)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator

__all__ = ["DirPath", "LocalPath", "expand_home"]


def expand_home(value: Any) -> Any:
    """``~`` or ``~user`` at the start of a path string (or ``Path``) expanded; other values unchanged."""
    if isinstance(value, Path):
        return value.expanduser()
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    return value


def _non_empty(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        raise ValueError("is empty; give a directory (e.g. runs/my-run)")
    return expand_home(value)


LocalPath = Annotated[str, BeforeValidator(expand_home)]
"""A file or directory on this machine (``~`` expanded)."""

DirPath = Annotated[Path, BeforeValidator(_non_empty)]
"""A directory to write (``~`` expanded; empty refused)."""
