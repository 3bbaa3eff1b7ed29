"""Checkpoints: atomic save / verified load of model, optimizer, scheduler, RNG and data position."""

from relayrl.checkpoint.format import (
    CheckpointError,
    LoadedCheckpoint,
    check_fits,
    load_checkpoint,
    shapes_of,
    verify_checkpoint,
)
from relayrl.checkpoint.manager import CheckpointManager
from relayrl.checkpoint.resume import ResumePlan, resume_from
from relayrl.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "LoadedCheckpoint",
    "ResumePlan",
    "capture_rng_state",
    "check_fits",
    "load_checkpoint",
    "restore_rng_state",
    "resume_from",
    "shapes_of",
    "verify_checkpoint",
]
