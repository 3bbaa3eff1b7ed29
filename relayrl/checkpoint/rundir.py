"""A run directory belongs to one run.

Two runs mixed in one directory are worse than either alone: a fresh run
(``run.resume=never``) that starts in a directory holding another run's
checkpoints restarts ``metrics.jsonl`` but leaves the old checkpoints, so a
later ``run.resume=auto`` resumes the other run without a word. Hence:

* :func:`check_run_dir` — before anything is loaded or written, refuse a
  ``run.dir`` that a run would damage: one that is, lies inside or holds a
  model directory the run reads (``model.path``, ``trainer.init_from``, ...),
  one whose ``config.json`` is not a relayrl run config (a Hugging Face model
  directory's, say), and one that holds a previous run a fresh start would
  overwrite (the same refusal as :func:`claim_run_dir`, made early).
* :func:`claim_run_dir` — a fresh run refuses a directory that holds a
  previous run: complete checkpoints, or, for a run that never wrote one, its
  ``metrics.jsonl``, ``model/``, run ``config.json`` or an unfinished
  checkpoint (``run.resume=auto`` with no complete checkpoint is a fresh start
  too). The message names what is there and the ways out (resume it, choose
  another ``run.dir``, or ``run.overwrite=true``, which moves the previous run
  aside to ``RUN_DIR.replaced-<time>`` rather than deleting anything).
* :func:`hold_run_dir` — one run at a time: two runs started at the same
  moment in one directory both pass the checks above, so the run takes an
  exclusive ``flock`` on ``RUN_DIR/.relayrl.lock`` before it claims the
  directory, holds it until the run ends (:func:`release_run_dir`, or its
  process's end), and a second run is refused with the holder's pid, host and
  start time (the kernel drops the lock of a process that died, so a stale
  lock file never blocks).
* :func:`check_fingerprint` — a resumed run compares the checkpoint's saved
  config with its own on the keys that define the run (:data:`FINGERPRINT`:
  workflow, seed, model, data, advantage estimator) and says which differ.
  Keys one may change between sessions of a run (``trainer.steps``,
  ``eval.*``, ``run.save_every``, the cluster's size, ...) are not compared.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relayrl.checkpoint.format import _STEP_DIR, MANIFEST, CheckpointError, missing_resume
from relayrl.errors import UserError

__all__ = ["FINGERPRINT", "RUN_CONFIG_KEYS", "RunDirError", "check_run_dir", "claim_run_dir", "config_differences",
           "check_fingerprint", "hold_run_dir", "is_run_config", "lock_holder", "release_run_dir", "rerun_note",
           "saved_config"]

LOCK_FILE = ".relayrl.lock"
_HELD: dict[Path, Any] = {}  # run directories this process holds: {resolved path: open lock file}

FINGERPRINT: tuple[str, ...] = (
    "workflow", "run.seed", "model.path", "model.tiny", "model.dtype", "trainer.init_from",
    # the training data: which rows, and what a row's prompt and ground truth are
    "data.task", "data.task_options", "data.path", "data.hf_name", "data.hf_config", "data.hf_split", "data.format",
    "data.prompt_key", "data.answer_key", "data.answer_regex", "data.system_prompt", "data.chat_template",
    "model.chat_template", "data.rejected_key", "data.label_key", "data.messages_key", "data.max_prompt_tokens",
    "data.max_rows", "data.shuffle", "data.chat_template_kwargs",
    "algorithm.advantage", "model.lora.enabled", "model.lora.r", "model.lora.alpha", "model.lora.target_modules",
    "model.lora.target_parameters",
)
"""Dotted config keys that must match between a checkpoint and the run that resumes it (``model.lora.alpha``:
the same adapter weights scaled by another ``alpha / r`` are another model). The held-out set (``data.eval_*``,
``data.hf_eval_split``) may change, as ``eval.*`` may; so may ``data.long_prompts``: a run that ran with
either choice trains the same rows with the other (fail runs only when no row is too long, and then drop
drops none)."""


RUN_CONFIG_KEYS: frozenset[str] = frozenset({"workflow", "run", "model", "trainer"})
"""Top-level keys every relayrl run config (``RUN_DIR/config.json``) has; a Hugging Face model's
``config.json`` has none of them but ``model_type``."""


class RunDirError(UserError, RuntimeError):
    """A run directory that already holds another run, or that a run would damage."""


def _checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(c.name for c in root.iterdir() if _STEP_DIR.match(c.name) and (c / MANIFEST).is_file())


def is_run_config(path: Path) -> bool:
    """True when ``path`` is a JSON object with every key of :data:`RUN_CONFIG_KEYS` (a relayrl run config)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and RUN_CONFIG_KEYS <= data.keys() and "model_type" not in data


def _traces(run_dir: Path) -> list[str]:
    """The files of a run that wrote no complete checkpoint: what a fresh start in ``run_dir`` would overwrite."""
    from relayrl.telemetry.sinks import METRICS_FILE

    found = []
    metrics = run_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        with open(metrics, "rb") as f:
            records = sum(1 for line in f if line.strip())
        if records:
            found.append(f"metrics.jsonl with {records} record{'s' if records != 1 else ''}")
    if (run_dir / "model").is_dir():
        found.append("model/")
    if (run_dir / "config.json").is_file() and is_run_config(run_dir / "config.json"):
        found.append("config.json")
    root = run_dir / "checkpoints"
    if root.is_dir():
        found += [f"unfinished checkpoints/{c.name}" for c in sorted(root.iterdir())
                  if _STEP_DIR.match(c.name) and not (c / MANIFEST).is_file()]
    return found


def _previous_run(run_dir: Path, resume: str) -> RunDirError | None:
    """The refusal a run starting in ``run_dir`` with ``resume`` meets without ``run.overwrite``, or None when
    there is no previous run to mix with or to overwrite (see :func:`claim_run_dir`)."""
    if resume not in ("never", "auto"):
        own = (run_dir / "checkpoints").resolve()
        src = Path(resume).resolve()
        if src == own or own in src.parents:
            return None
    found = _checkpoints(run_dir)
    if found and resume == "auto":
        return None  # the run being continued
    ways = (f"choose a new run.dir (e.g. run.dir={run_dir}-2), or set run.overwrite=true to move the old run "
            f"aside (to {run_dir}.replaced-<time>)")
    what = "a fresh run" if resume == "never" else f"a run resumed from another run's checkpoint ({resume})"
    if found:
        listed = ", ".join(found[-3:]) + (f" and {len(found) - 3} older" if len(found) > 3 else "")
        return RunDirError(f"run.dir={run_dir} already holds a run with checkpoints ({listed}); {what} there "
                           f"would mix the two. Resume it with run.resume=auto, {ways}")
    traces = _traces(run_dir)
    if not traces:
        return None
    held = f"run.dir={run_dir} already holds a run that wrote no complete checkpoint ({', '.join(traces)})"
    if resume == "auto":
        return RunDirError(f"{held}, so run.resume=auto has nothing to resume, and starting over there would "
                           f"overwrite that run. To start over, {ways}")
    return RunDirError(f"{held}; {what} there would overwrite it. To keep it, {ways}")


def _model_conflict(run_dir: Path, models: Mapping[str, str | Path | None]) -> RunDirError | None:
    """A run.dir that is, lies inside or holds one of the model directories ``{key: path}`` the run reads."""
    here = run_dir.resolve()
    for key, value in models.items():
        if not value:
            continue
        model = Path(value).resolve()
        if here == model:
            where = f"run.dir={run_dir} is {key}={value}"
        elif model in here.parents:
            where = f"run.dir={run_dir} lies inside {key}={value}"
        elif here in model.parents:
            return RunDirError(
                f"{key}={value} lies inside run.dir={run_dir}: the run writes into run.dir (its config.json, "
                f"metrics, model/) and run.overwrite=true would move it aside, model and all; choose a run.dir "
                f"that does not hold the model (e.g. run.dir={run_dir}-2)"
            )
        else:
            continue
        return RunDirError(f"{where}: the run would write its config.json, metrics and model/ into the model "
                           f"directory; choose a run.dir outside it (e.g. run.dir=runs/<name>)")
    return None


def check_run_dir(run_dir: Path, resume: str, overwrite: bool,
                  models: Mapping[str, str | Path | None] | None = None) -> None:
    """Refuse, writing nothing, a ``run_dir`` that a run starting there would damage (:class:`RunDirError`).

    ``models`` maps config keys to the model directories the run reads (``{"model.path": ..., ...}``; None
    values are skipped): ``run_dir`` may neither be, lie inside nor hold one of them. A ``config.json`` in
    ``run_dir`` that is not a relayrl run config (:func:`is_run_config`) is refused, ``overwrite`` or not: the
    directory is not a run. Without ``overwrite``, a previous run there is refused as :func:`claim_run_dir`
    refuses it, before the model and the data are loaded.
    """
    run_dir = Path(run_dir)
    _not_a_file(run_dir)
    missing = missing_resume(resume)  # (first: the refusals below would read it as another run's checkpoint)
    if missing is not None:
        raise missing
    conflict = _model_conflict(run_dir, models or {})
    if conflict is not None:
        raise conflict
    foreign = _foreign_config(run_dir)
    if foreign is not None:
        raise foreign
    busy = _in_use(run_dir)  # (first: resuming a live run, or moving it aside, is not a way out)
    if busy is not None:
        raise RunDirError(busy)
    rewind = _rewind(run_dir, resume)
    if rewind is not None:
        raise rewind
    if not overwrite:
        refusal = _previous_run(run_dir, resume)
        if refusal is not None:
            raise refusal


def _foreign_config(run_dir: Path) -> RunDirError | None:
    """The refusal of a ``run_dir`` whose ``config.json`` is not a relayrl run config (a Hugging Face model's,
    say), or None. One that is not JSON at all beside the run's own complete checkpoints is that run's, torn (an
    older relayrl killed, or out of disk, while it rewrote it): the run writes it again."""
    config = run_dir / "config.json"
    if not config.is_file() or is_run_config(config):
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        if _checkpoints(run_dir):
            return None
        data = None
    kind = data.get("model_type") if isinstance(data, dict) else None
    seen = f" (it has model_type={kind!r}: a Hugging Face model directory)" if kind else ""
    return RunDirError(f"run.dir={run_dir} holds a config.json that is not a relayrl run config{seen}; a run "
                       f"there would overwrite it. Leave that directory alone and choose another run.dir "
                       f"(a new or empty directory, e.g. run.dir=runs/<name>)")


def rerun_note(run_dir: Path, resume: str) -> str | None:
    """After a run failed: how to run the same command again, when ``run_dir`` now holds what it wrote and a
    rerun would be refused (resume=auto, when it saved a checkpoint first); None when a rerun just works."""
    if _previous_run(Path(run_dir), resume) is None:
        return None
    found = _checkpoints(Path(run_dir))
    if found:  # a fresh run that saved a checkpoint before it failed
        return (f"run.dir={run_dir} holds this run's checkpoints up to {found[-1]}: add run.resume=auto to go on "
                f"from there, or run.overwrite=true to start over (it moves them aside to "
                f"{run_dir}.replaced-<time>)")
    return (f"run.dir={run_dir} keeps what this run wrote before it failed; to run the same command again add "
            f"run.overwrite=true (it moves that aside to {run_dir}.replaced-<time>), or choose another run.dir")


def _rewind(run_dir: Path, resume: str) -> RunDirError | None:
    """The refusal of ``run.resume=PATH`` naming one of ``run_dir``'s own checkpoints that is not its newest:
    the run would go on from there beside its later checkpoints (which ``run.resume=auto`` would take next)
    and overwrite its ``model/``. ``run.overwrite`` would move the checkpoint itself aside, so it does not
    apply; a new run.dir keeps both."""
    if resume in ("never", "auto"):
        return None
    src = Path(resume).resolve()
    own = (run_dir / "checkpoints").resolve()
    if own not in src.parents:
        return None
    later = [c for c in _checkpoints(run_dir) if c > src.name]
    if not later:
        return None
    return RunDirError(f"run.resume={resume} is a checkpoint of run.dir={run_dir} itself, which has later ones "
                       f"({', '.join(later[-3:])}); going on from it there would leave them beside a run that "
                       f"went another way, and replace its model/. Resume the newest with run.resume=auto, or "
                       f"branch from this one in a new directory: run.dir={run_dir}-from-{src.name} "
                       f"run.resume={src}")


def _not_a_file(run_dir: Path) -> None:
    for here in (run_dir, *run_dir.parents):
        if here.exists() and not here.is_dir():
            raise RunDirError(f"run.dir={run_dir}: {here} is a file, not a directory; choose another run.dir "
                              f"(e.g. run.dir=runs/<name>)")


def hold_run_dir(run_dir: Path) -> None:
    """Take ``run_dir``'s lock for the rest of this process (creating the directory), or refuse
    (:class:`RunDirError`) naming the run that holds it. Taking it again in the same process (an in-process
    restart) is a no-op; after ``run.overwrite=true`` moved the old run aside, take it again for the new one."""
    run_dir = Path(run_dir)
    _not_a_file(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = run_dir.resolve()
    held = _HELD.pop(key, None)
    if held is not None:
        try:
            same = os.path.samestat(os.fstat(held.fileno()), os.stat(key / LOCK_FILE))
        except FileNotFoundError:
            same = False
        if same:
            _HELD[key] = held
            return
        held.close()  # its directory was moved aside
    f = open(key / LOCK_FILE, "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RunDirError(_in_use(run_dir) or f"run.dir={run_dir} is in use by another run") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}) + "\n")
    f.flush()
    _HELD[key] = f


def _in_use(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot be started in now, when another live process holds its lock (the holder, from the
    lock file); None when no other process does (the probe takes the lock and gives it back at once)."""
    holder = lock_holder(run_dir)
    if holder is None:
        return None
    return (f"run.dir={run_dir} is in use by another run ({holder}); wait for it to finish, or choose another "
            f"run.dir (e.g. run.dir={run_dir}-2)")


def lock_holder(run_dir: Path) -> str | None:
    """The live process (not this one) that holds ``run_dir``'s lock, in words: its pid, host, start time and
    the lock's path; None when none does (the probe takes the lock and gives it back at once)."""
    key = Path(run_dir).resolve()
    if key in _HELD or not (key / LOCK_FILE).is_file():
        return None
    with open(key / LOCK_FILE, encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                who = json.loads(f.read())
                holder = f"pid {who['pid']} on {who['host']}, started {who['started']}"
            except (json.JSONDecodeError, KeyError, TypeError):
                holder = "a process that has not yet written its name"
            return f"{holder}; lock {key / LOCK_FILE}"
    return None  # (closing the file gave the probe's lock back)


def release_run_dir(run_dir: Path) -> None:
    """Give up ``run_dir``'s lock if this process holds it (the run is over)."""
    held = _HELD.pop(Path(run_dir).resolve(), None)
    if held is not None:
        held.close()


def claim_run_dir(run_dir: Path, resume: str, overwrite: bool) -> str | None:
    """Make sure a run starting in ``run_dir`` does not mix with, or overwrite, a previous run there.

    With ``resume=auto`` and a complete checkpoint, or a path to one of ``run_dir``'s own checkpoints, the
    previous run is the one being continued; nothing to check. Otherwise (``resume=never``, ``auto`` with no
    complete checkpoint, or a path to another run's checkpoint: a new run that starts from it) a directory
    holding a previous run (complete checkpoints, or a non-empty ``metrics.jsonl``, ``model/``, a run
    ``config.json``, an unfinished checkpoint) is refused (:class:`RunDirError`), unless ``overwrite``: then
    it is renamed to ``RUN_DIR.replaced-YYYYmmdd-HHMMSS`` and a sentence saying so is returned (None when
    nothing was moved). Call :func:`check_run_dir` first: it refuses the directories not to be moved.
    """
    run_dir = Path(run_dir)
    refusal = _previous_run(run_dir, resume)
    if refusal is None:
        return None
    if not overwrite:
        raise refusal
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


UNORDERED = ("model.lora.target_modules", "model.lora.target_parameters")
"""Fingerprint keys whose lists name a set (their order changes nothing)."""


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                       keys: Sequence[str] = FINGERPRINT) -> list[str]:
    """``key: checkpoint X, now Y`` for each of ``keys`` whose value differs (JSON-dumped configs; the keys of
    :data:`UNORDERED` as sets: LoRA's target list in another order is the same adapters)."""
    out = []
    for key in keys:
        a, b = _at(saved, key), _at(current, key)
        same_set = key in UNORDERED and isinstance(a, list) and isinstance(b, list) and sorted(a) == sorted(b)
        if a != b and not same_set:
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
    """Refuse to resume ``checkpoint`` when its saved config differs from ``current`` on :data:`FINGERPRINT`, or
    when it holds a reference model that ``trainer.ref_sync_every`` moved and ``current`` has no syncs (it would
    load the starting model as the reference instead)."""
    if saved is None:
        return  # a checkpoint saved without its config (older runs): nothing to compare
    # a key the saved config lacks was added to relayrl after the checkpoint was written: nothing to compare
    keys = tuple(k for k in FINGERPRINT if _at(saved, k) != "<unset>")
    if any(_at(current, k) not in (None, "<unset>") for k in ("trainer.init_from", "model.path")):
        keys = tuple(k for k in keys if k != "model.tiny")  # the tiny default's shape is not used then
    if _at(saved, "data.task") is None and _at(current, "data.task") is None:
        keys = tuple(k for k in keys if k != "data.task_options")  # (unread without a task; older runs kept them)
    diff = config_differences(saved, current, keys)
    moved = _at(saved, "trainer.ref_sync_every")
    if isinstance(moved, int) and moved > 0 and not _at(current, "trainer.ref_sync_every"):
        # (the checkpoint holds the reference its syncs moved; without them the run would load the starting model)
        diff.append(f"trainer.ref_sync_every: checkpoint {moved}, now 0, which would put the starting model back as "
                    f"the reference in place of the one the checkpoint holds (to stop its updates but keep it, set "
                    f"trainer.ref_sync_every above trainer.steps)")
    if diff:
        raise CheckpointError(
            f"{checkpoint} belongs to a run with another configuration:\n  " + "\n  ".join(diff)
            + "\nset these keys back to resume it, or start a new run with run.resume=never in another run.dir "
            "(or set run.resume_check=false to resume with the new values anyway)"
        )
