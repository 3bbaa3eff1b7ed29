"""What every worker role shares: the device a role's ``model.device`` names, its torch CPU threads, the
peak-memory probe the pipeline reads per phase. (A call every rank of a sharded group must make, rank 0
answering, is the group's own ``group.all_rank0``.)

The roles themselves are in :mod:`relayrl.workflows.trainer_workers` (actor, critic, reward model,
reference) and :mod:`relayrl.workflows.rollout_worker` (the rollout).
"""

from __future__ import annotations

import os

import torch

from relayrl.cluster import Worker
from relayrl.telemetry import memory

__all__ = ["resolve_device", "set_threads", "MemoryProbe"]


def resolve_device(name: str, worker_device: torch.device | None = None) -> torch.device:
    """``auto`` -> the worker's device (cuda when the pool has GPUs), else cpu."""
    if name == "auto":
        if worker_device is not None:
            return worker_device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but torch sees no CUDA device; use model.device=cpu or auto")
    return torch.device(name)


def set_threads(threads: int, worker: Worker | None = None) -> None:
    """``threads`` torch CPU threads; 0 on a CPU rank of a multi-rank group: the cores shared out over its ranks."""
    if threads == 0 and worker is not None and getattr(worker, "world_size", 1) > 1 and worker.device.type == "cpu":
        threads = max(1, (os.cpu_count() or 1) // worker.world_size)
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class MemoryProbe:
    """Peak memory of the worker's device (GPU) or process (CPU) since the last reset, for
    ``memory/<phase>_peak_gb`` (:mod:`relayrl.telemetry.memory`)."""

    def _memory_device(self) -> torch.device:
        engine = getattr(self, "engine", None)
        return getattr(engine, "device", None) or torch.device("cpu")

    def memory_reset(self) -> None:
        memory.reset_peak(self._memory_device())

    def memory_peak_gb(self) -> float:
        return memory.peak_gb(self._memory_device())


