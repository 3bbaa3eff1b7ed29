"""Swap training state to host memory while generating, and back for the update.

Seed 000's allgather-swap moves the training-side buffers device -> host (D2H)
after the weights are gathered for generation, so generation gets their
device memory (KV cache), and moves them back (H2D) before the next update.
Here that is applied to the largest piece of training state, the optimizer's
(Adam: two fp32 moments per parameter):

* `offload_optimizer` packs every non-scalar state tensor into one flat host
  buffer per dtype (pinned when CUDA is available, reused across steps), and
  points the optimizer's state at views of those buffers, so the device
  tensors are freed.
* `reload_optimizer` copies each state tensor back into a fresh tensor on the
  device (the original device by default), so training continues bitwise as
  if nothing had moved.

Scalar state (Adam's ``step``) stays where it is. Departures: parameters and
gradients are not swapped (FSDP2's ``CPUOffloadPolicy`` covers those), and
DTensor optimizer state (FSDP2) is rejected with a message rather than
offloaded shard by shard.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from relayrl.weights.layout import BucketLayout, layout_from_signature
from relayrl.weights.packing import allocate_buffers, pack, unpack

__all__ = ["offload_optimizer", "reload_optimizer", "is_offloaded"]

_BUCKET_BYTES = 1 << 62  # one bucket per dtype: state moves in as few copies as there are dtypes


@dataclass
class _HostState:
    layout: BucketLayout
    buffers: list[torch.Tensor]
    devices: dict[str, torch.device]
    offloaded: bool


_HOST: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _HostState]" = weakref.WeakKeyDictionary()


def _entries(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor, dict, str]]:
    """(name, tensor, state dict, key) of every non-scalar state tensor, in param-group order."""
    from torch.distributed.tensor import DTensor

    out = []
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for k in sorted(state):
                v = state[k]
                if isinstance(v, DTensor):
                    raise TypeError(f"optimizer state {i}/{k} is a DTensor (FSDP2); offload it with FSDP2's "
                                    "CPUOffloadPolicy instead of offload_optimizer")
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out.append((f"{i}/{k}", v, state, k))
            i += 1
    return out


def is_offloaded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `offload_optimizer` ran on ``optimizer`` without a `reload_optimizer` since."""
    rec = _HOST.get(optimizer)
    return rec is not None and rec.offloaded


@torch.no_grad()
def offload_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Move the optimizer's state tensors into flat host buffers (see the module docstring).

    Returns:
        ``{"offload/bytes", "offload/tensors", "offload/time_s"}``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_offloaded(optimizer):
        raise RuntimeError("optimizer state is already offloaded; call reload_optimizer(optimizer) first")
    t0 = time.perf_counter()
    entries = _entries(optimizer)
    sig = tuple((name, tuple(t.shape), t.dtype) for name, t, _, _ in entries)
    rec = _HOST.get(optimizer)
    if rec is None or rec.layout.signature != sig:
        layout = layout_from_signature(sig, _BUCKET_BYTES)
        rec = _HostState(layout, allocate_buffers(layout, "cpu", pin_memory=torch.cuda.is_available()), {}, False)
        _HOST[optimizer] = rec
    pack([(name, t) for name, t, _, _ in entries], rec.layout, out=rec.buffers)
    rec.devices = {name: t.device for name, t, _, _ in entries}
    views = dict(unpack(rec.buffers, rec.layout))
    for name, _, state, k in entries:
        state[k] = views[name]  # drops the last reference to the device tensor
    rec.offloaded = True
    return {"offload/bytes": float(rec.layout.nbytes), "offload/tensors": float(len(entries)),
            "offload/time_s": time.perf_counter() - t0}


@torch.no_grad()
def reload_optimizer(optimizer: torch.optim.Optimizer, device: str | torch.device | None = None) -> dict[str, float]:
    """Copy offloaded state back into fresh tensors on ``device`` (default: where each one came from).

    The host buffers stay allocated for the next `offload_optimizer`.

    Returns:
        ``{"offload/bytes", "offload/tensors", "offload/time_s"}`` of the reload.
    """
    rec = _HOST.get(optimizer)
    if rec is None or not rec.offloaded:
        raise RuntimeError("optimizer state is not offloaded; call offload_optimizer(optimizer) first")
    t0 = time.perf_counter()
    entries = _entries(optimizer)
    target = None if device is None else torch.device(device)
    cuda_devices = set()
    for name, view, state, k in entries:
        dev = target or rec.devices[name]
        fresh = torch.empty(view.shape, dtype=view.dtype, device=dev)
        fresh.copy_(view, non_blocking=True)
        state[k] = fresh
        if dev.type == "cuda":
            cuda_devices.add(dev)
    for dev in cuda_devices:
        torch.cuda.synchronize(dev)  # the host buffers are overwritten by the next offload
    rec.offloaded = False
    return {"offload/bytes": float(rec.layout.nbytes), "offload/tensors": float(len(entries)),
            "offload/time_s": time.perf_counter() - t0}
