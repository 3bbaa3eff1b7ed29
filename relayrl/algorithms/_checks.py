"""Input validation and metric helpers shared by the algorithm functions.

Every public function in :mod:`relayrl.algorithms` validates its tensors here so
that a wrong shape or an empty batch fails with a message naming the argument
and both shapes, instead of a broadcast silently producing a wrong loss.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

Tensor = torch.Tensor


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
    caller pays one synchronisation per call rather than one per metric.
    """
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        with torch.no_grad():
            stacked = torch.stack([metrics[k].detach().reshape(()).double() for k in keys])
            for k, v in zip(keys, stacked.cpu().tolist()):
                out[k] = float(v)
    return {k: out[k] for k in metrics}
