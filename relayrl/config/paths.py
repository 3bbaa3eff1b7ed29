"""Paths a config names: ``~`` is the user's home, as in a shell (a recipe or a quoted override would
otherwise keep a literal ``~`` directory), and an empty path is refused rather than read as the current
directory (``run.dir=`` trained into the working directory). A run's saved config names its local paths
absolute (:func:`absolute_paths`), so that it loads as a recipe from any directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator

__all__ = ["DirPath", "LocalPath", "expand_home", "LOCAL_PATH_KEYS", "absolute_paths"]


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


LOCAL_PATH_KEYS = ("run.dir", "run.resume", "model.path", "model.chat_template", "trainer.init_from", "data.path",
                   "data.eval_path", "rollout.weight_dir", "algorithm.distill.teacher", "reward.model",
                   "reward.judge.path")
"""The config keys that may name a file or directory on this machine (``data.eval_path`` a list of them too). The
keys naming a plugin's file (``reward.user_fn``, ``env.name``, ``env.tools``, ``algorithm.advantage``,
``algorithm.policy_loss``: ``file.py:fn``) are made absolute when the config loads (:mod:`relayrl.plugins`)."""


def absolute_paths(config: dict, cwd: str | Path) -> dict:
    """``config`` (a dumped :class:`~relayrl.config.schema.Config`) with each value of :data:`LOCAL_PATH_KEYS`
    that is a relative path naming an existing file or directory under ``cwd`` made absolute; other values (a hub
    name, a chat template's text, ``run.resume=auto``, a path that does not exist) unchanged. A run's
    ``config.json`` written with its paths relative loaded as a recipe from another directory read other files
    (or none: ``dataset file data/x.jsonl does not exist``)."""
    out = dict(config)
    for key in LOCAL_PATH_KEYS:
        *sections, name = key.split(".")
        node = out
        for section in sections:  # (copied on the way down: the caller's dict is not changed)
            if not isinstance(node.get(section), dict):
                break
            node[section] = node = dict(node[section])
        else:
            if name in node:
                value = node[name]
                node[name] = ([_absolute(v, cwd) for v in value] if isinstance(value, list)
                              else _absolute(value, cwd))
    return out


def _absolute(value: Any, cwd: str | Path) -> Any:
    if not isinstance(value, str) or not value or os.path.isabs(value) or value in ("never", "auto"):
        return value
    full = os.path.normpath(os.path.join(cwd, value))
    return full if os.path.exists(full) else value  # (False for a template's text: too long for a path, a NUL)
