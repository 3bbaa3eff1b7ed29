"""Swap idle state to host memory and back: optimizer state, and a module's weights.

MindSpeed RL's allgather-swap moves the training-side buffers device -> host (D2H)
while generation runs, so generation gets their device memory (KV cache), and
moves them back (H2D) before the next update. verl's hybrid engine does the
same for its actor and reference. Here:

* `offload_optimizer` / `reload_optimizer`: every non-scalar state tensor of an
  optimizer (Adam: two float32 moments per parameter).
* `offload_module` / `reload_module`: a module's parameters and buffers (the
  actor's or reference's weights while they are idle; the rollout engine's
  while the trainer runs).

Plain tensors are packed into one flat host buffer per dtype (pinned when
CUDA is available, kept and reused across steps) and the owners are pointed at
views of it, so the device tensors are freed; the reload copies each back into
a fresh device tensor, so training continues bitwise as if nothing had moved.
``restore=False`` allocates the parameters without copying (for weights that
are overwritten next anyway, e.g. a rollout engine about to receive new
weights); buffers are still copied. Scalar state (Adam's ``step``) stays where it is.

FSDP2's sharded tensors (``DTensor``) move shard by shard with ``.to``
(their local shard goes to host and back; the mesh is unchanged). Gradients
are not swapped: the training engine frees them after each optimizer step.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from relayrl.weights.layout import BucketLayout, layout_from_signature
from relayrl.weights.packing import allocate_buffers, pack, unpack

__all__ = ["offload_optimizer", "reload_optimizer", "is_offloaded", "offload_module", "reload_module"]

_BUCKET_BYTES = 1 << 62  # one bucket per dtype: state moves in as few copies as there are dtypes


@dataclass
class _HostState:
    layout: BucketLayout
    buffers: list[torch.Tensor]
    devices: dict[str, torch.device]
    offloaded: bool
    dtensor_devices: dict[str, torch.device]


_HOST: "weakref.WeakKeyDictionary[object, _HostState]" = weakref.WeakKeyDictionary()

# (name, tensor, setter): where a swapped tensor lives and how to point its owner at another one
_Entry = tuple[str, torch.Tensor, Callable[[torch.Tensor], None]]


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _optimizer_entries(optimizer: torch.optim.Optimizer) -> list[_Entry]:
    """Every non-scalar state tensor, in param-group order."""
    out: list[_Entry] = []
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for k in sorted(state):
                v = state[k]
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out.append((f"{i}/{k}", v, lambda t, state=state, k=k: state.__setitem__(k, t)))
            i += 1
    return out


def _module_entries(module: nn.Module) -> list[_Entry]:
    """Every parameter and buffer of ``module`` once (tied parameters are one entry)."""
    out: list[_Entry] = []
    seen: set[int] = set()
    for name, p in [*module.named_parameters(), *module.named_buffers()]:
        if id(p) in seen or p.dim() == 0:
            continue
        seen.add(id(p))

        def set_data(t: torch.Tensor, p=p) -> None:
            p.data = t

        out.append((name, p, set_data))
    return out


@torch.no_grad()
def _offload(owner: object, entries: list[_Entry], what: str) -> dict[str, float]:
    if is_offloaded(owner):
        raise RuntimeError(f"{what} is already offloaded; reload it first")
    t0 = time.perf_counter()
    dtensors = [e for e in entries if _is_dtensor(e[1])]
    plain = [e for e in entries if not _is_dtensor(e[1])]
    sig = tuple((name, tuple(t.shape), t.dtype) for name, t, _ in plain)
    rec = _HOST.get(owner)
    if rec is None or rec.layout.signature != sig:
        layout = layout_from_signature(sig, _BUCKET_BYTES)
        rec = _HostState(layout, allocate_buffers(layout, "cpu", pin_memory=torch.cuda.is_available()), {}, False, {})
        _HOST[owner] = rec
    pack([(name, t) for name, t, _ in plain], rec.layout, out=rec.buffers)
    rec.devices = {name: t.device for name, t, _ in plain}
    views = dict(unpack(rec.buffers, rec.layout))
    for name, _, put in plain:
        put(views[name])  # drops the owner's reference to the device tensor
    rec.dtensor_devices = {}
    for name, t, put in dtensors:
        rec.dtensor_devices[name] = t.device
        put(t.to("cpu"))
    rec.offloaded = True
    moved = rec.layout.nbytes + sum(t.to_local().numel() * t.element_size() for _, t, _ in dtensors)
    return {"offload/bytes": float(moved), "offload/tensors": float(len(entries)),
            "offload/time_s": time.perf_counter() - t0}


@torch.no_grad()
def _reload(owner: object, entries: list[_Entry], what: str, device, restore) -> dict[str, float]:
    """``restore``: True (copy every tensor back), or the set of names to copy back (the rest is allocated
    with undefined values)."""
    rec = _HOST.get(owner)
    if rec is None or not rec.offloaded:
        raise RuntimeError(f"{what} is not offloaded; offload it first")
    t0 = time.perf_counter()
    target = None if device is None else torch.device(device)
    cuda_devices = set()
    for name, view, put in entries:
        if name in rec.dtensor_devices:
            put(view.to(target or rec.dtensor_devices[name]))
            continue
        dev = target or rec.devices[name]
        fresh = torch.empty(view.shape, dtype=view.dtype, device=dev)
        if restore is True or name in restore:
            fresh.copy_(view, non_blocking=True)
        put(fresh)
        if dev.type == "cuda":
            cuda_devices.add(dev)
    for dev in cuda_devices:
        torch.cuda.synchronize(dev)  # the host buffers are overwritten by the next offload
    rec.offloaded = False
    return {"offload/bytes": float(rec.layout.nbytes), "offload/tensors": float(len(entries)),
            "offload/time_s": time.perf_counter() - t0}


def is_offloaded(owner: object) -> bool:
    """Whether ``owner`` (an optimizer or a module) was offloaded and not reloaded since."""
    rec = _HOST.get(owner)
    return rec is not None and rec.offloaded


def offload_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Move the optimizer's state tensors into host memory (see the module docstring).

    Returns:
        ``{"offload/bytes", "offload/tensors", "offload/time_s"}``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return _offload(optimizer, _optimizer_entries(optimizer), "optimizer state")


def reload_optimizer(optimizer: torch.optim.Optimizer, device: str | torch.device | None = None) -> dict[str, float]:
    """Copy offloaded optimizer state back into fresh tensors on ``device`` (default: where each came from).
    The host buffers stay allocated for the next offload."""
    return _reload(optimizer, _optimizer_entries(optimizer), "optimizer state", device, True)


def offload_module(module: nn.Module) -> dict[str, float]:
    """Move ``module``'s parameters and buffers into host memory (``p.data`` points at host views)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return _offload(module, _module_entries(module), "module weights")


def reload_module(module: nn.Module, device: str | torch.device | None = None, *,
                  restore: bool = True) -> dict[str, float]:
    """Bring ``module``'s weights back to ``device`` (default: where each came from); ``restore=False``
    allocates the parameters without copying their values (they are about to be overwritten by new
    weights); buffers (e.g. rotary frequencies), which no relay sends, are always copied back."""
    entries = _module_entries(module)
    keep = True if restore else {name for name, _ in module.named_buffers()}
    return _reload(module, entries, "module weights", device, keep)
