"""On-disk format of a checkpoint and its verified loading.

See `relayrl.checkpoint.manager` for the layout and the atomic save. Loading
checks the manifest (every file present, size and sha256 match) and, when
given, the model's expected tensor shapes; every failure raises
`CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from relayrl.errors import UserError

FORMAT = "relayrl-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
REQUIRED_FILES = (MODEL_FILE, "trainer_state.json", "rng.pt")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SCRATCH_DIR = re.compile(r"^\.(?:tmp|trash)-step-(\d+)-(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model."""


def missing_resume(mode: str | Path) -> CheckpointError | None:
    """The refusal of a ``run.resume`` that is neither mode nor an existing path (a typo of a mode, a
    checkpoint that was moved), None when it is one of them."""
    if str(mode) in ("never", "auto") or Path(mode).exists():
        return None
    return CheckpointError(f"run.resume={mode}: no such checkpoint (the path does not exist); run.resume is never, "
                           "auto, or the path of a checkpoint (RUN_DIR/checkpoints/step-N) or of a run's checkpoints "
                           "directory")


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{mpath}: step is {step!r}, not an int >= 0; the manifest was edited or is damaged")
    m = _STEP_DIR.match(path.name)
    if m and int(m.group(1)) != step:
        raise CheckpointError(
            f"{mpath}: says step {step} but its directory is {path.name} (step {int(m.group(1))}); the manifest was "
            f"edited or copied from another checkpoint. Restore it, or resume from another checkpoint"
        )
    return manifest


def verify_checkpoint(path: Path, *, hashes: bool = True) -> dict[str, Any]:
    """Check every file in the manifest exists with the recorded size (and sha256), and that the step agrees
    in the manifest, the directory name and ``trainer_state.json``. Returns the manifest."""
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
    tpath = path / "trainer_state.json"
    try:
        state_step = json.loads(tpath.read_text(encoding="utf-8")).get("step", manifest["step"])
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{tpath}: corrupted, not a JSON object ({exc})") from exc
    if state_step != manifest["step"]:
        raise CheckpointError(
            f"{path / MANIFEST}: says step {manifest['step']} but {tpath.name} says step {state_step}; the "
            f"checkpoint's files disagree (was the manifest edited?). Resume from another checkpoint"
        )
    return manifest


def check_fits(fpath: Path, state: Mapping[str, torch.Tensor], expected: Mapping[str, Any]) -> None:
    """Refuse (``CheckpointError`` naming ``fpath``) a model state with missing, unexpected or differently shaped
    tensors against ``expected`` ({name: shape} of the model it is for, see `shapes_of`)."""
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
        check_fits(mpath, model_state, expected_shapes)
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
