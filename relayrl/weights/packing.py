"""Tensor packing: named weights <-> one flat contiguous buffer per bucket.

NeMo RL's first refit optimisation: `torch.cat` the many small parameter
tensors into a few large buffers, move those, and let the receiver cut views
back out by (offset, shape, dtype). Here:

* `pack` writes into preallocated buffers (`allocate_buffers`, or buffers from
  an earlier call), so the hot path allocates nothing; when every tensor of a
  bucket is contiguous and on the buffer's device the bucket is one
  ``torch.cat(..., out=buffer)`` (one kernel on CUDA), otherwise per-tensor
  ``copy_`` (e.g. device -> pinned host staging, non-blocking, synchronised
  before returning).
* `unpack` returns zero-copy views into the buffers.
* `to_wire` / `from_wire` view a host buffer as a ``uint8`` numpy array and
  back, so it crosses Ray's object store without a copy (numpy is zero-copy
  on ``ray.get``, torch tensors are not) and any dtype (bf16 included) survives.

Departure from the seed: no CUDA IPC handles; a process boundary is crossed
by host buffers (pickled over a pipe for local ranks, the Ray object store
for Ray actors).
"""
from __future__ import annotations

import warnings
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from relayrl.weights.layout import BucketLayout

__all__ = ["allocate_buffers", "pack", "pack_stream", "unpack", "to_wire", "from_wire", "check_buffers"]


def allocate_buffers(layout: BucketLayout, device: str | torch.device = "cpu",
                     pin_memory: bool = False) -> list[torch.Tensor]:
    """One uninitialised flat buffer per bucket: ``[bucket.numel]`` of ``bucket.dtype`` on ``device``.

    ``pin_memory`` (host buffers only) makes host<->device copies asynchronous.
    """
    device = torch.device(device)
    pin = bool(pin_memory) and device.type == "cpu"
    return [torch.empty(b.numel, dtype=b.dtype, device=device, pin_memory=pin) for b in layout.buckets]


def check_buffers(buffers: Sequence[torch.Tensor], layout: BucketLayout, arg: str = "buffers") -> None:
    """Raise unless ``buffers[i]`` is a flat contiguous ``[bucket.numel]`` tensor of the bucket's dtype."""
    if len(buffers) != len(layout.buckets):
        raise ValueError(f"{arg}: {len(buffers)} buffers but layout {layout.key} has {len(layout.buckets)} buckets")
    for i, (buf, b) in enumerate(zip(buffers, layout.buckets)):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{arg}[{i}]: expected a torch.Tensor, got {type(buf).__name__}")
        if buf.dtype != b.dtype or buf.dim() != 1 or buf.numel() != b.numel or not buf.is_contiguous():
            raise ValueError(f"{arg}[{i}]: expected a contiguous [{b.numel}] {b.dtype} buffer for bucket {i}, "
                             f"got {tuple(buf.shape)} {buf.dtype}")


def _by_name(named_weights: Sequence[tuple[str, torch.Tensor]], layout: BucketLayout) -> dict[str, torch.Tensor]:
    tensors = dict(named_weights)
    if len(tensors) != layout.num_tensors or len(named_weights) != layout.num_tensors:
        known = set(layout.names)
        missing = [n for n in layout.names if n not in tensors]
        extra = [n for n in tensors if n not in known]
        raise ValueError(f"named_weights do not match layout {layout.key}: missing {missing[:5]}, "
                         f"not in layout {extra[:5]} ({len(named_weights)} given, {layout.num_tensors} expected)")
    for s in layout.slots():
        t = tensors.get(s.name)
        if t is None:
            raise ValueError(f"named_weights: layout {layout.key} has {s.name!r} but the weights do not")
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise ValueError(f"weight {s.name!r}: layout {s.shape} {s.dtype} != given {tuple(t.shape)} {t.dtype}")
    return tensors


@torch.no_grad()
def pack(named_weights: Sequence[tuple[str, torch.Tensor]], layout: BucketLayout,
         out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Copy named weights into one flat buffer per bucket.

    Args:
        named_weights: ``[(name, tensor), ...]`` with exactly the layout's names, shapes and dtypes.
        layout: from `build_layout` (on the same weights or weights of equal signature).
        out: buffers to fill (from `allocate_buffers` or an earlier `pack`); ``None`` allocates
            them on the first tensor's device.
    Returns:
        the filled buffers, ``[bucket.numel]`` each (``out`` itself when given).
    """
    tensors = _by_name(named_weights, layout)
    if out is None:
        first = next(iter(tensors.values()), None)
        out = allocate_buffers(layout, first.device if first is not None else "cpu")
    else:
        check_buffers(out, layout, "out")
    cross_device: set[torch.device] = set()
    for bucket, buf in zip(layout.buckets, out):
        parts = [tensors[s.name] for s in bucket.slots]
        if all(p.device == buf.device and p.is_contiguous() for p in parts):
            torch.cat([p.reshape(-1) for p in parts], out=buf)
            continue
        for s, p in zip(bucket.slots, parts):
            buf.narrow(0, s.offset, s.numel).view(s.shape).copy_(p, non_blocking=True)
            if p.device != buf.device:
                cross_device.add(p.device if p.device.type == "cuda" else buf.device)
    for dev in cross_device:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # non-blocking copies into host memory must land before anyone reads it
    return list(out)


@torch.no_grad()
def pack_stream(named_weights: Iterable[tuple[str, torch.Tensor]], layout: BucketLayout,
                out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`pack` from a one-pass stream (`relayrl.weights.gather.stream_full_state`): each tensor is copied into
    its slot as it arrives and not kept, so the caller holds one tensor (one gathered bucket) at a time
    instead of the whole model. The stream may come in any order; every name must match a slot's shape and
    dtype and every slot must be filled exactly once (checked as it goes and at the end: a mismatch raises
    naming the tensor, though slots before it were written).

    Args:
        named_weights: an iterable of ``(name, tensor)``, read once.
        layout: the layout of the stream's names, shapes and dtypes (built from them without their data).
        out: buffers to fill (`allocate_buffers`, shared-memory buckets); returned filled.
    """
    check_buffers(out, layout, "out")
    slots = {s.name: (i, s) for i, b in enumerate(layout.buckets) for s in b.slots}
    filled: set[str] = set()
    cuda: set[torch.device] = set()
    for name, t in named_weights:
        hit = slots.get(name)
        if hit is None:
            raise ValueError(f"weight {name!r} is not in layout {layout.key}")
        i, s = hit
        if name in filled:
            raise ValueError(f"weight {name!r} came twice in the stream for layout {layout.key}")
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise ValueError(f"weight {name!r}: layout {s.shape} {s.dtype} != given {tuple(t.shape)} {t.dtype}")
        buf = out[i]
        buf.narrow(0, s.offset, s.numel).view(s.shape).copy_(t, non_blocking=True)
        if t.device != buf.device and "cuda" in (t.device.type, buf.device.type):
            cuda.add(t.device if t.device.type == "cuda" else buf.device)
        filled.add(name)
    if len(filled) != layout.num_tensors:
        missing = [n for n in layout.names if n not in filled]
        raise ValueError(f"the stream for layout {layout.key} ended without {missing[:5]} "
                         f"({len(missing)} of {layout.num_tensors} tensors missing)")
    for dev in cuda:
        torch.cuda.synchronize(dev)  # non-blocking copies into host memory must land before anyone reads it
    return list(out)


def unpack(buffers: Sequence[torch.Tensor], layout: BucketLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy views ``(name, tensor)`` into packed buffers, bucket by bucket.

    The buffers are checked against the layout before anything is yielded;
    each view has the slot's shape and dtype and shares the buffer's memory.
    """
    check_buffers(buffers, layout)
    return _views(list(buffers), layout)


def _views(buffers: list[torch.Tensor], layout: BucketLayout) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket, buf in zip(layout.buckets, buffers):
        for s in bucket.slots:
            yield s.name, buf.narrow(0, s.offset, s.numel).view(s.shape)


def to_wire(buffer: torch.Tensor) -> np.ndarray:
    """A host buffer as a ``uint8`` numpy array sharing its memory (any dtype, bf16 included)."""
    if buffer.device.type != "cpu":
        raise ValueError(f"to_wire: buffer is on {buffer.device}; pack into host buffers before sending")
    return buffer.view(torch.uint8).numpy()


def from_wire(array: np.ndarray | torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Inverse of `to_wire`: a flat ``[numel]`` tensor of ``dtype`` over the same memory (no copy)."""
    if isinstance(array, torch.Tensor):
        t = array
    elif isinstance(array, np.ndarray):
        with warnings.catch_warnings():  # arrays from ray.get are read-only; we only read them
            warnings.filterwarnings("ignore", message=".*not writable.*")
            t = torch.from_numpy(array)
    else:
        raise TypeError(f"from_wire: expected a numpy array or tensor, got {type(array).__name__}")
    if t.dtype != dtype:
        t = t.reshape(-1).view(torch.uint8).view(dtype)
    if t.numel() != numel:
        raise ValueError(f"from_wire: buffer has {t.numel()} {dtype} elements, the layout expects {numel}")
    return t.reshape(-1)
