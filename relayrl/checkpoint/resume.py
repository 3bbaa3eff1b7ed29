"""Resume policy: where a run starts (scratch, newest checkpoint, or an explicit one).

A run never silently starts from scratch when a resume was asked for: an
explicit path that holds no complete checkpoint raises, and "auto" refuses a
newest `step-*` directory whose manifest is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from relayrl.checkpoint.format import (_SCRATCH_DIR, _STEP_DIR, MANIFEST, CheckpointError, missing_resume,
                                       verify_checkpoint)
from relayrl.checkpoint.manager import CheckpointManager


@dataclass(frozen=True)
class ResumePlan:
    """What a run should start from, and a sentence saying why (print it)."""

    path: Path | None
    """Checkpoint to load; None means start from scratch."""
    message: str


def resume_from(root: Path, mode: Literal["auto", "never"] | str | Path) -> ResumePlan:
    """Decide where a run starts.

    * "never": from scratch.
    * "auto": from the newest complete checkpoint under `root`, or from scratch
      if there is none (the message says so); refuses when the newest
      `step-*` directory has no manifest (something removed files from it).
    * a path: that checkpoint directory, or the newest one under a checkpoint
      root; a path that does not hold one raises CheckpointError. The files'
      presence and sizes are verified here, hashes at load.
    """
    root = Path(root)
    if isinstance(mode, str) and mode == "never":
        return ResumePlan(None, "resume disabled (resume=never); starting from step 0")
    if isinstance(mode, str) and mode == "auto":
        manager = CheckpointManager(root)
        dirs = sorted(
            (int(m.group(1)), c) for c in (root.iterdir() if root.is_dir() else []) if (m := _STEP_DIR.match(c.name))
        )
        if dirs and not (dirs[-1][1] / MANIFEST).is_file():
            newest, older = dirs[-1][1], manager.latest()
            aside = root / f"damaged-{newest.name}"
            way = (f"To resume from {older.name}, the newest checkpoint before it, move it out of the way: mv "
                   f"{newest} {aside} (then run.resume=auto again)" if older is not None else
                   f"No complete checkpoint precedes it; move it out of the way (mv {newest} {aside}) to start over")
            raise CheckpointError(f"{newest / MANIFEST}: missing, so the newest checkpoint is incomplete. {way}")
        latest = manager.latest()
        if latest is None:
            scratch = [c for c in (root.iterdir() if root.is_dir() else []) if _SCRATCH_DIR.match(c.name)]
            note = f" (ignored {len(scratch)} unfinished save(s))" if scratch else ""
            return ResumePlan(None, f"resume=auto: no checkpoint under {root}{note}; starting from step 0")
        manifest = verify_newest(root, latest, hashes=False)
        return ResumePlan(latest, f"resume=auto: resuming from {latest} (step {manifest['step']})")
    path = Path(mode)
    if (missing := missing_resume(path)) is not None:
        raise missing
    if not (path / MANIFEST).exists():
        inner = CheckpointManager(path).latest() if path.is_dir() else None
        if inner is None:
            raise CheckpointError(f"{path / MANIFEST}: missing; {path} is neither a checkpoint nor a directory of "
                                  f"them{_run_dir_hint(path)}")
        path = inner
    manifest = verify_checkpoint(path, hashes=False)
    return ResumePlan(path, f"resuming from {path} (step {manifest['step']})")


def verify_newest(root: Path, path: Path, *, hashes: bool = True) -> dict:
    """``verify_checkpoint(path)`` of ``root``'s newest checkpoint, for ``resume=auto``; a damaged one is refused
    with the way on (``resume=PATH`` refuses the run's older checkpoints while a later one stands): move it out
    of the way, naming the checkpoint before it."""
    try:
        return verify_checkpoint(path, hashes=hashes)
    except CheckpointError as e:
        older = [p for _, p in CheckpointManager(root).complete() if p != Path(path)]
        if not older:
            raise
        aside = Path(root) / f"damaged-{Path(path).name}"
        raise CheckpointError(f"{e}. To resume from {older[-1].name}, the newest checkpoint before it, move it out "
                              f"of the way: mv {path} {aside} (then run.resume=auto again)") from None


def _run_dir_hint(path: Path) -> str:
    """``; PATH is a run directory: ...`` when ``path`` holds checkpoints under ``checkpoints/``, else ``""``."""
    newest = CheckpointManager(path / "checkpoints").latest() if (path / "checkpoints").is_dir() else None
    if newest is None:
        return ""
    return (f"; {path} is a run directory: run.resume={newest.parent} resumes its newest checkpoint ({newest.name}), "
            f"or run.resume=auto with run.dir={path}")
