"""Atomic, verified training checkpoints with keep-last-K pruning.

Layout of one checkpoint, `ROOT/step-000012/`:

    model.safetensors   weights (safetensors; tied/shared tensors saved as copies)
    optimizer.pt        optimizer.state_dict()          (torch.save; optional)
    scheduler.pt        lr_scheduler.state_dict()       (torch.save; optional)
    trainer_state.json  step, data position, task-generator state, ... (JSON)
    rng.pt              capture_rng_state(): Python, NumPy, torch CPU/CUDA, named generators
    config.json         the resolved run config (optional)
    extra.pt            anything else, e.g. the dock's unfinished partitions (optional)
    manifest.json       written last: format version, step, size and sha256 of every file

Atomicity: everything is written and fsync'ed inside `ROOT/.tmp-step-000012-<pid>/`,
the manifest last, then the directory is renamed to its final name (a single
`rename(2)`, atomic on POSIX filesystems) and the parent directory fsync'ed. A
process killed at any point leaves either the previous checkpoints untouched
plus a `.tmp-*` directory (removed by the next save), or the new complete one.
Old checkpoints are pruned by renaming them to `.trash-*` first, so an
interrupted prune never leaves a half-deleted `step-*` directory.

Loading verifies the manifest (every file present, size and sha256 match) and,
when given, the model's expected tensor shapes; every failure raises
`CheckpointError` naming the file and the problem. Only rank 0 should save;
torch.load of optimizer/scheduler/rng uses `weights_only=True`, while
`extra.pt` (arbitrary objects) is loaded with full unpickling and so must
come from a trusted directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from relayrl.checkpoint.rng import capture_rng_state

log = logging.getLogger(__name__)

FORMAT = "relayrl-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
REQUIRED_FILES = (MODEL_FILE, "trainer_state.json", "rng.pt")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SCRATCH_DIR = re.compile(r"^\.(?:tmp|trash)-step-(\d+)-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """Everything one checkpoint holds, on `map_location` (CPU by default)."""

    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None
    trainer_state: dict[str, Any]
    rng_state: dict[str, Any]
    config: dict[str, Any] | None = None
    extra: Any = None


def shapes_of(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a module's state_dict (or of a state dict), for `expected_shapes`."""
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    return {k: tuple(v.shape) for k, v in state.items()}


# ----------------------------------------------------------------------------- file helpers


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _find_unjsonable(value: Any, where: str) -> str | None:
    """Path (like trainer_state['data']['pos']) of the first value json cannot encode."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where} key {k!r} (JSON keys must be str)"
            bad = _find_unjsonable(v, f"{where}[{k!r}]")
            if bad:
                return bad
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = _find_unjsonable(v, f"{where}[{i}]")
            if bad:
                return bad
        return None
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if value == value and abs(value) != float("inf") else f"{where} = {value} (non-finite)"
    return f"{where} of type {type(value).__name__}"


def _prepare_model_state(model_state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, detached tensors; a tensor sharing storage with an earlier one is cloned."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, int]] = set()
    for key, value in model_state.items():
        if not isinstance(key, str):
            raise TypeError(f"model_state key {key!r} is not a str")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model_state['{key}'] is a {type(value).__name__}, not a torch.Tensor")
        t = value.detach()
        if hasattr(t, "full_tensor"):  # a DTensor shard: gather the full tensor
            t = t.full_tensor()
        t = t.to("cpu").contiguous()
        storage = (t.device.type, t.untyped_storage().data_ptr())
        if storage in seen:
            t = t.clone()  # tied weights: safetensors refuses shared storage
        elif t.numel() > 0:
            seen.add(storage)
        out[key] = t
    return out


def _remove_scratch(root: Path) -> None:
    """Delete `.tmp-*`/`.trash-*` dirs left by processes that are no longer alive (or by us)."""
    for child in root.iterdir():
        m = _SCRATCH_DIR.match(child.name)
        if not m or not child.is_dir():
            continue
        pid = int(m.group(2))
        alive = False
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        if not alive:
            shutil.rmtree(child, ignore_errors=True)


# ----------------------------------------------------------------------------- verification and load


def _read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    if not mpath.exists():
        raise CheckpointError(f"{mpath}: missing; the checkpoint is incomplete (was its save interrupted?)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{mpath}: corrupted, not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a relayrl checkpoint manifest (format is {manifest.get('format')!r})")
    version = manifest.get("version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath}: checkpoint format version {version} is incompatible; this relayrl reads version {FORMAT_VERSION}"
        )
    missing = [f for f in REQUIRED_FILES if f not in manifest.get("files", {})]
    if missing:
        raise CheckpointError(f"{mpath}: manifest lists no {missing}; the checkpoint is incompatible")
    return manifest


def verify_checkpoint(path: Path, *, hashes: bool = True) -> dict[str, Any]:
    """Check every file in the manifest exists with the recorded size (and sha256). Returns the manifest."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name, meta in manifest["files"].items():
        fpath = path / name
        if not fpath.is_file():
            raise CheckpointError(f"{fpath}: missing (listed in {MANIFEST})")
        size = fpath.stat().st_size
        if size != meta["size"]:
            what = "truncated" if size < meta["size"] else "larger than written"
            raise CheckpointError(f"{fpath}: {what}: {size} bytes, manifest says {meta['size']}")
        if hashes and _sha256(fpath) != meta["sha256"]:
            raise CheckpointError(f"{fpath}: corrupted: sha256 differs from the one in {MANIFEST}")
    return manifest


def _check_shapes(fpath: Path, state: Mapping[str, torch.Tensor], expected: Mapping[str, Any]) -> None:
    def short(keys: list[str]) -> str:
        return str(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")

    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [
        f"'{k}': checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k])}"
        for k in sorted(set(state) & set(expected))
        if tuple(state[k].shape) != tuple(expected[k])
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {short(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {short(unexpected)}")
    if mismatched:
        problems.append("shape mismatch " + "; ".join(mismatched[:8]) + (" ..." if len(mismatched) > 8 else ""))
    if problems:
        raise CheckpointError(f"{fpath}: does not fit the model: " + "; ".join(problems))


def _torch_load(fpath: Path, map_location: str | torch.device, weights_only: bool = True) -> Any:
    try:
        return torch.load(fpath, map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # pickle/zip errors come in many types
        raise CheckpointError(f"{fpath}: cannot be read ({type(exc).__name__}: {exc})") from exc


def load_checkpoint(
    path: Path,
    *,
    expected_shapes: Mapping[str, Any] | None = None,
    map_location: str | torch.device = "cpu",
    verify_hashes: bool = True,
) -> LoadedCheckpoint:
    """Verify and load one checkpoint directory.

    Args:
        path: a `step-*` directory written by `CheckpointManager.save`.
        expected_shapes: {tensor name: shape} of the model to load into
            (see `shapes_of`); any missing, unexpected or differently shaped
            tensor is refused.
        map_location: where tensors are placed.
        verify_hashes: also compare sha256 (reads every file once more).
    """
    path = Path(path)
    manifest = verify_checkpoint(path, hashes=verify_hashes)
    files = manifest["files"]
    mpath = path / MODEL_FILE
    try:
        model_state = load_file(mpath, device=str(map_location))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{mpath}: cannot be read as safetensors ({exc})") from exc
    if expected_shapes is not None:
        _check_shapes(mpath, model_state, expected_shapes)
    tpath = path / "trainer_state.json"
    try:
        trainer_state = json.loads(tpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{tpath}: corrupted, not valid JSON ({exc})") from exc
    config = None
    if "config.json" in files:
        cpath = path / "config.json"
        try:
            config = json.loads(cpath.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{cpath}: corrupted, not valid JSON ({exc})") from exc
    return LoadedCheckpoint(
        path=path,
        step=int(manifest["step"]),
        model_state=model_state,
        optimizer_state=_torch_load(path / "optimizer.pt", map_location) if "optimizer.pt" in files else None,
        scheduler_state=_torch_load(path / "scheduler.pt", map_location) if "scheduler.pt" in files else None,
        trainer_state=trainer_state,
        rng_state=_torch_load(path / "rng.pt", "cpu"),
        config=config,
        extra=_torch_load(path / "extra.pt", map_location, weights_only=False) if "extra.pt" in files else None,
    )


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
    """Saves `ROOT/step-NNNNNN/` checkpoints atomically and keeps the newest `keep`."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (checkpoints to retain), got {keep}")
        self.root = Path(root)
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every directory with a manifest, oldest first (not hash-verified)."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / MANIFEST).is_file():
                found.append((int(m.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        done = self.complete()
        return done[-1][1] if done else None

    def save(
        self,
        step: int,
        *,
        model_state: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any] | None,
        scheduler_state: Mapping[str, Any] | None,
        trainer_state: Mapping[str, Any],
        rng_state: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        extra: Any = None,
    ) -> Path:
        """Write the checkpoint of `step` atomically, then prune; returns its directory.

        Args:
            model_state: name -> tensor (any device; DTensors are gathered).
            optimizer_state, scheduler_state: `state_dict()`s, or None.
            trainer_state: JSON-able dict (data position, counters, ...); "step"
                is filled in, and must equal `step` if given.
            rng_state: from `capture_rng_state(extra_generators)`; None captures
                the global generators now.
            config: the resolved run config (JSON-able).
            extra: any picklable object (e.g. unfinished dock partitions).
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        trainer_state = dict(trainer_state)
        if trainer_state.setdefault("step", step) != step:
            raise ValueError(f"trainer_state['step'] is {trainer_state['step']} but save() was called with step {step}")
        for name, value in (("trainer_state", trainer_state), ("config", config)):
            bad = _find_unjsonable(value, name) if value is not None else None
            if bad:
                raise TypeError(f"{bad} cannot be written as JSON; convert it (or put it in `extra`)")
        tensors = _prepare_model_state(model_state)
        if rng_state is None:
            rng_state = capture_rng_state()

        self.root.mkdir(parents=True, exist_ok=True)
        _remove_scratch(self.root)
        tmp = self.root / f".tmp-step-{step:06d}-{os.getpid()}"
        tmp.mkdir()
        try:
            files: dict[str, dict[str, Any]] = {}

            def record(name: str) -> None:
                _fsync_file(tmp / name)
                files[name] = {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}

            save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt", "step": str(step)})
            record(MODEL_FILE)
            for name, obj in (("optimizer.pt", optimizer_state), ("scheduler.pt", scheduler_state),
                              ("rng.pt", rng_state), ("extra.pt", extra)):
                if obj is not None:
                    torch.save(obj, tmp / name)
                    record(name)
            for name, obj in (("trainer_state.json", trainer_state), ("config.json", config)):
                if obj is not None:
                    (tmp / name).write_text(json.dumps(obj, indent=1), encoding="utf-8")
                    record(name)
            manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "created": time.time(), "files": files}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
            _fsync_file(tmp / MANIFEST)
            _fsync_dir(tmp)
            final = self.step_dir(step)
            if final.exists():  # re-saving a step: move the old one aside first
                old = self.root / f".trash-step-{step:06d}-{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        log.info("saved checkpoint %s", final)
        return final

    def prune(self) -> list[Path]:
        """Delete complete checkpoints beyond the newest `keep`; returns what was removed."""
        removed = []
        for step, path in self.complete()[: -self.keep]:
            trash = self.root / f".trash-step-{step:06d}-{os.getpid()}"
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(path)
        return removed

    def load(self, path: Path, *, expected_shapes: Mapping[str, Any] | None = None,
             map_location: str | torch.device = "cpu") -> LoadedCheckpoint:
        """`load_checkpoint(path, ...)`."""
        return load_checkpoint(path, expected_shapes=expected_shapes, map_location=map_location)


# ----------------------------------------------------------------------------- resume policy


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
            raise CheckpointError(
                f"{dirs[-1][1] / MANIFEST}: missing, so the newest checkpoint is incomplete; delete "
                f"{dirs[-1][1]} to resume from an older one, or set resume to an explicit checkpoint path"
            )
        latest = manager.latest()
        if latest is None:
            scratch = [c for c in (root.iterdir() if root.is_dir() else []) if _SCRATCH_DIR.match(c.name)]
            note = f" (ignored {len(scratch)} unfinished save(s))" if scratch else ""
            return ResumePlan(None, f"resume=auto: no checkpoint under {root}{note}; starting from step 0")
        manifest = verify_checkpoint(latest, hashes=False)
        return ResumePlan(latest, f"resume=auto: resuming from {latest} (step {manifest['step']})")
    path = Path(mode)
    if not path.exists():
        raise CheckpointError(f"{path}: resume path does not exist")
    if not (path / MANIFEST).exists():
        inner = CheckpointManager(path).latest() if path.is_dir() else None
        if inner is None:
            raise CheckpointError(f"{path / MANIFEST}: missing; {path} is neither a checkpoint nor a directory of them")
        path = inner
    manifest = verify_checkpoint(path, hashes=False)
    return ResumePlan(path, f"resuming from {path} (step {manifest['step']})")
