"""Peak memory of a phase: device memory on a GPU, the process's resident set on a CPU.

``memory/<phase>_peak_gb`` metrics come from here. On CUDA the figure is
``torch.cuda.max_memory_allocated`` since the phase began (tensors only: the
caching allocator's reserve is not counted). On a CPU it is the kernel's
high-water mark of the resident set (``VmHWM``), reset at the start of a phase
through ``/proc/self/clear_refs``; where that reset is refused (a warning says
so, once per process) the figure is the process's peak since an earlier point,
which over-states the phase, never under-states it. A resident set holds everything the process has touched (the
interpreter, libraries, data), so on a CPU compare phases or runs with each
other, not with a model's size alone.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

__all__ = ["reset_peak", "peak_gb", "current_gb"]

_GB = float(1 << 30)
_CLEAR_REFS = Path("/proc/self/clear_refs")
_warned = False  # the refused reset was reported (once per process)


def _status_kb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak(device: torch.device | str) -> bool:
    """Start a new peak for ``device`` (its memory now becomes the peak). False when the kernel refused to
    reset a CPU process's peak: the first refusal in a process warns that the CPU peaks count from an
    earlier point (see the module docstring)."""
    global _warned
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        _CLEAR_REFS.write_text("5")  # 5: reset the peak resident set size
    except OSError as e:
        if not _warned:
            _warned = True
            warnings.warn(f"relayrl: the peak resident set of this process could not be reset ({_CLEAR_REFS}: "
                          f"{e.strerror or e}); its memory/<phase>_peak_gb figures count from an earlier point "
                          f"and may over-state a phase", RuntimeWarning, stacklevel=2)
        return False
    return True


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
