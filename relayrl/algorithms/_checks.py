"""Input validation and metric helpers shared by the algorithm functions.

Every public function in :mod:`relayrl.algorithms` validates its tensors here so
that a wrong shape or an empty batch fails with a message naming the argument
and both shapes, instead of a broadcast silently producing a wrong loss.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping

import torch

Tensor = torch.Tensor

_deferred = threading.local()


@contextlib.contextmanager
def deferred_metrics() -> Iterator[None]:
    """Inside: :func:`to_floats` and :func:`metric_value` leave a tensor metric on its device, as a detached
    0-dim float64 tensor, instead of reading it to the host. A training engine runs its passes so, and reads
    every metric of an optimizer step at once (:func:`host_floats`): a read per micro-batch would stop the
    host until the GPU caught up, and leave the GPU idle while the host prepared the next pass. The values
    are the same either way (float64, as the host reads them)."""
    before = getattr(_deferred, "on", False)
    _deferred.on = True
    try:
        yield
    finally:
        _deferred.on = before


def metric_value(v: Tensor | float) -> Tensor | float:
    """One metric as a Python float, or (inside :func:`deferred_metrics`) a tensor's detached float64 value."""
    if not isinstance(v, torch.Tensor):
        return float(v)
    v = v.detach().reshape(()).double()
    return v if getattr(_deferred, "on", False) else float(v)


def host_floats(values: Mapping[str, Tensor | float]) -> dict[str, float]:
    """``values`` as Python floats, the tensors among them read to the host together (one synchronisation)."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    if keys:
        with torch.no_grad():
            stacked = torch.stack([values[k].detach().reshape(()).double() for k in keys])
            out.update(zip(keys, stacked.cpu().tolist()))
    return {k: out[k] for k in values}


def check_nonempty(name: str, t: Tensor) -> None:
    """Raise ``ValueError`` if ``t`` has no rows or no elements."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    if t.numel() == 0:
        raise ValueError(f"empty batch: {name} has shape {tuple(t.shape)}; need at least one row")


def check_ndim(name: str, t: Tensor, ndim: int) -> None:
    """Raise ``ValueError`` unless ``t`` has exactly ``ndim`` dimensions."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_same_shape(**tensors: Tensor | None) -> None:
    """Raise ``ValueError`` naming both arguments if any two shapes differ.

    ``None`` values are skipped, so optional arguments can be passed through.
    """
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != first.shape:
            raise ValueError(
                f"shape mismatch: {first_name} has shape {tuple(first.shape)} "
                f"but {name} has shape {tuple(t.shape)}"
            )


def check_batch(**tensors: Tensor | None) -> None:
    """Non-empty first tensor, and every tensor the same shape as it."""
    first_name, first = next((k, v) for k, v in tensors.items() if v is not None)
    check_nonempty(first_name, first)
    check_same_shape(**tensors)


def check_rows(rows_name: str, rows: Tensor, mask_name: str, mask: Tensor) -> None:
    """``rows`` is ``[N]`` and ``mask`` is ``[N, T]`` with the same ``N``."""
    check_ndim(rows_name, rows, 1)
    check_ndim(mask_name, mask, 2)
    if rows.shape[0] != mask.shape[0]:
        raise ValueError(
            f"shape mismatch: {rows_name} has shape {tuple(rows.shape)} but "
            f"{mask_name} has shape {tuple(mask.shape)}; need {rows_name}.shape[0] == "
            f"{mask_name}.shape[0]"
        )


def as_float_mask(mask: Tensor, like: Tensor) -> Tensor:
    """The mask as the floating dtype of ``like`` (bool/int masks accepted)."""
    dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
    return mask.to(dtype=dtype)


def to_floats(metrics: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Turn tensor metrics into Python floats with one device sync.

    Scalar tensors are stacked and moved to the host together, so a CUDA
    caller pays one synchronisation per call rather than one per metric;
    inside :func:`deferred_metrics`, none (see there).
    """
    if getattr(_deferred, "on", False):
        return {k: metric_value(v) for k, v in metrics.items()}  # type: ignore[misc]
    return host_floats(metrics)
