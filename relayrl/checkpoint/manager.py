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

Loading and verification live in `relayrl.checkpoint.format`, the resume
policy in `relayrl.checkpoint.resume`. Only rank 0 should save;
torch.load of optimizer/scheduler/rng uses `weights_only=True`, while
`extra.pt` (arbitrary objects) is loaded with full unpickling and so must
come from a trusted directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from relayrl.checkpoint.atomic import fsync_dir as _fsync_dir
from relayrl.checkpoint.atomic import fsync_file as _fsync_file
from relayrl.checkpoint.atomic import disk_full, pid_alive
from relayrl.checkpoint.format import (
    _SCRATCH_DIR,
    _STEP_DIR,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MODEL_FILE,
    LoadedCheckpoint,
    _sha256,
    load_checkpoint,
)
from relayrl.checkpoint.rng import capture_rng_state
from relayrl.dock.payload import payload_bytes

log = logging.getLogger(__name__)


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
        if pid == os.getpid() or not pid_alive(pid):
            shutil.rmtree(child, ignore_errors=True)


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
        except BaseException as e:
            full = disk_full(e, self.root, f"the checkpoint of step {step}", need=payload_bytes(
                (tensors, optimizer_state, extra)), keep=self.keep) if isinstance(e, Exception) else None
            shutil.rmtree(tmp, ignore_errors=True)
            if full is not None:
                raise full from e
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
             map_location: str | torch.device = "cpu", verify_hashes: bool = True) -> LoadedCheckpoint:
        """`load_checkpoint(path, ...)`."""
        return load_checkpoint(path, expected_shapes=expected_shapes, map_location=map_location,
                               verify_hashes=verify_hashes)
