"""A run directory belongs to one run.

Two runs mixed in one directory are worse than either alone: a fresh run
(``run.resume=never``) that starts in a directory holding another run's
checkpoints restarts ``metrics.jsonl`` but leaves the old checkpoints, so a
later ``run.resume=auto`` resumes the other run without a word. Hence:

* :func:`claim_run_dir` — a fresh run refuses a directory that holds a
  previous run's checkpoints, naming it and the ways out (resume it, choose
  another ``run.dir``, or ``run.overwrite=true``, which moves the previous run
  aside to ``RUN_DIR.replaced-<time>`` rather than deleting anything).
* :func:`check_fingerprint` — a resumed run compares the checkpoint's saved
  config with its own on the keys that define the run (:data:`FINGERPRINT`:
  workflow, seed, model, data, advantage estimator) and says which differ.
  Keys one may change between sessions of a run (``trainer.steps``,
  ``eval.*``, ``run.save_every``, the cluster's size, ...) are not compared.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relayrl.checkpoint.format import _STEP_DIR, MANIFEST, CheckpointError
from relayrl.errors import UserError

__all__ = ["FINGERPRINT", "RunDirError", "claim_run_dir", "config_differences", "check_fingerprint",
           "saved_config"]

FINGERPRINT: tuple[str, ...] = (
    "workflow", "run.seed", "model.path", "model.tiny", "model.dtype", "trainer.init_from",
    "data.task", "data.task_options", "data.path", "data.prompt_key", "data.answer_key", "algorithm.advantage",
    "model.lora.enabled", "model.lora.r", "model.lora.alpha", "model.lora.target_modules",
)
"""Dotted config keys that must match between a checkpoint and the run that resumes it (``model.lora.alpha``:
the same adapter weights scaled by another ``alpha / r`` are another model)."""


class RunDirError(UserError, RuntimeError):
    """A run directory that already holds another run."""


def _checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(c.name for c in root.iterdir() if _STEP_DIR.match(c.name) and (c / MANIFEST).is_file())


def claim_run_dir(run_dir: Path, resume: str, overwrite: bool) -> str | None:
    """Make sure a run starting in ``run_dir`` does not mix with a previous run there.

    With ``resume=auto``, or a path to one of ``run_dir``'s own checkpoints, the previous run is the one
    being continued; nothing to check. With "never", or a path to another run's checkpoint (a new run that
    starts from it), a directory holding complete checkpoints is refused (:class:`RunDirError`), unless
    ``overwrite``: then it is renamed to ``RUN_DIR.replaced-YYYYmmdd-HHMMSS`` and a sentence saying so is
    returned (None when nothing was moved).
    """
    run_dir = Path(run_dir)
    if resume == "auto":
        return None
    if resume != "never":
        own = (run_dir / "checkpoints").resolve()
        src = Path(resume).resolve()
        if src == own or own in src.parents:
            return None
    found = _checkpoints(run_dir)
    if not found:
        return None
    if not overwrite:
        listed = ", ".join(found[-3:]) + (f" and {len(found) - 3} older" if len(found) > 3 else "")
        what = "a fresh run" if resume == "never" else f"a run resumed from another run's checkpoint ({resume})"
        raise RunDirError(
            f"run.dir={run_dir} already holds a run with checkpoints ({listed}); {what} there would mix "
            f"the two. Resume it with run.resume=auto, choose a new run.dir (e.g. run.dir={run_dir}-2), or set "
            f"run.overwrite=true to move the old run aside"
        )
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
    os.rename(run_dir, aside)
    return f"run.overwrite=true: moved the previous run in {run_dir} to {aside} (delete it when no longer needed)"


def _at(config: Mapping[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return "<unset>"
        node = node[part]
    return node


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                       keys: Sequence[str] = FINGERPRINT) -> list[str]:
    """``key: checkpoint X, now Y`` for each of ``keys`` whose value differs (JSON-dumped configs)."""
    out = []
    for key in keys:
        a, b = _at(saved, key), _at(current, key)
        if a != b:
            out.append(f"{key}: checkpoint {a!r}, now {b!r}")
    return out


def saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The run config saved in a checkpoint (``config.json``), or None when it has none."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupted, not valid JSON ({exc})") from exc


def check_fingerprint(checkpoint: Path, saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Refuse to resume ``checkpoint`` when its saved config differs from ``current`` on :data:`FINGERPRINT`."""
    if saved is None:
        return  # a checkpoint saved without its config (older runs): nothing to compare
    # a key the saved config lacks was added to relayrl after the checkpoint was written: nothing to compare
    keys = tuple(k for k in FINGERPRINT if _at(saved, k) != "<unset>")
    if any(_at(current, k) not in (None, "<unset>") for k in ("trainer.init_from", "model.path")):
        keys = tuple(k for k in keys if k != "model.tiny")  # the tiny default's shape is not used then
    diff = config_differences(saved, current, keys)
    if diff:
        raise CheckpointError(
            f"{checkpoint} belongs to a run with another configuration:\n  " + "\n  ".join(diff)
            + "\nset these keys back to resume it, or start a new run with run.resume=never in another run.dir "
            "(or set run.resume_check=false to resume with the new values anyway)"
        )
