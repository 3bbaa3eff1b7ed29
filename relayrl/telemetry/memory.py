"""Peak memory of a phase: device memory on a GPU, the process's resident set on a CPU.

``memory/<phase>_peak_gb`` metrics come from here. On CUDA the figure is
``torch.cuda.max_memory_allocated`` since the phase began (tensors only: the
caching allocator's reserve is not counted). On a CPU it is the kernel's
high-water mark of the resident set (``VmHWM``), reset at the start of a phase
through ``/proc/self/clear_refs``; where that reset is refused the figure is
the process's peak since an earlier point, which over-states the phase, never
under-states it. A resident set holds everything the process has touched (the
interpreter, libraries, data), so on a CPU compare phases or runs with each
other, not with a model's size alone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

__all__ = ["reset_peak", "peak_gb", "current_gb"]

_GB = float(1 << 30)


def _status_kb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak(device: torch.device | str) -> None:
    """Start a new peak for ``device`` (its memory now becomes the peak)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # refused: the peak then counts from an earlier point (see above)
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size


def peak_gb(device: torch.device | str) -> float:
    """Peak memory since :func:`reset_peak`, in GiB."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / _GB
    return _status_kb("VmHWM") * 1024 / _GB


def current_gb(device: torch.device | str) -> float:
    """Memory in use now, in GiB (allocated tensors on CUDA, the resident set on a CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / _GB
    return _status_kb("VmRSS") * 1024 / _GB
