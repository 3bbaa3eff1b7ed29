"""The receiving end of the weight relay: buckets + a cached layout -> engine weights.

NeMo RL's third refit optimisation is *minimal metadata*: dtypes, shapes and
offsets never change between steps, so the receiver caches them and each
refit carries only the buffers, a layout key and the version. A receiver that
has not seen a key answers ``{"status": "need_layout"}`` and the sender sends
the layout to that receiver alone (NeMo RL's per-receiver messages instead of
one broadcast carrying everyone's metadata).

Checks happen before any weight is copied, so a bad refit leaves the engine
untouched: the layout's names and shapes against the engine's (once per layout
key), and the version against the engine's current one (never go back).
Dtypes may differ (e.g. fp32 trainer -> bf16 generator); ``copy_`` casts.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, MutableMapping

import torch

from relayrl.weights.layout import BucketLayout
from relayrl.weights.packing import from_wire, unpack
from relayrl.weights.shm import SharedBucket, open_shared

__all__ = [
    "BucketPayload",
    "LayoutMismatchError",
    "StaleVersionError",
    "WeightReceiverMixin",
    "check_receiver",
    "check_version",
    "receive_buckets",
    "receiver_shapes",
]


class LayoutMismatchError(ValueError):
    """The receiver's parameter names or shapes differ from the sender's layout."""


class StaleVersionError(ValueError):
    """A push carried a version lower than the receiver already holds."""


@dataclass(frozen=True)
class BucketPayload:
    """What one refit sends to each rank: buffers plus minimal metadata."""

    key: str
    """`BucketLayout.key` of the layout the buffers follow."""
    version: int
    """Weight version the receiver moves to."""
    buffers: tuple[Any, ...]
    """One per bucket: a ``uint8`` numpy array (`to_wire`), a flat tensor, a `SharedBucket` handle,
    or a Ray ``ObjectRef`` to an array."""
    layout: BucketLayout | None = None
    """The full layout, only on the first push of a key to a receiver (else ``None``)."""


def receiver_shapes(engine: Any) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors an engine accepts, or ``None`` when it cannot tell.

    Uses ``engine.weight_shapes()`` when the engine has it, else the
    parameters and buffers of ``engine.model`` (an ``nn.Module``).
    """
    if callable(getattr(engine, "weight_shapes", None)):
        return {n: tuple(s) for n, s in dict(engine.weight_shapes()).items()}
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        shapes.update({n: tuple(b.shape) for n, b in model.named_buffers()})
        return shapes
    return None


def check_receiver(engine: Any, layout: BucketLayout, who: str = "receiver") -> None:
    """Raise `LayoutMismatchError` naming each differing tensor and both shapes.

    Every layout tensor must exist in the engine with the same shape; the
    engine may hold more (e.g. non-persistent buffers, tied heads).
    """
    shapes = receiver_shapes(engine)
    if shapes is None:
        return  # the engine's own update_weights is the only check left
    bad = []
    for slot in layout.slots():
        have = shapes.get(slot.name)
        if have is None:
            bad.append(f"{slot.name!r}: layout shape {slot.shape}, {who} has no such tensor")
        elif have != slot.shape:
            bad.append(f"{slot.name!r}: layout shape {slot.shape} != {who} shape {have}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise LayoutMismatchError(f"{who} does not match weight layout {layout.key}: " + "; ".join(bad[:5]) + more)


def check_version(engine: Any, version: int, who: str = "receiver") -> None:
    """Raise `StaleVersionError` if ``version`` is below ``engine.weight_version``."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version={version!r} must be an int")
    current = getattr(engine, "weight_version", None)
    if current is not None and version < current:
        raise StaleVersionError(f"{who} holds weight version {current}; refusing to go back to version {version}")


def _resolve(buffers: Iterable[Any], cache: MutableMapping[Any, Any]) -> list[Any]:
    out = [open_shared(b, cache) if isinstance(b, SharedBucket) else b for b in buffers]
    ray = sys.modules.get("ray")
    if ray is not None:
        refs = [i for i, b in enumerate(out) if isinstance(b, ray.ObjectRef)]
        if refs:
            values = ray.get([out[i] for i in refs])  # numpy from the object store: zero-copy
            for i, v in zip(refs, values):
                out[i] = v
    return out


def receive_buckets(engine: Any, buffers: Iterable[Any], layout_key_or_layout: str | BucketLayout, version: int,
                    cache: MutableMapping[Any, Any]) -> dict[str, Any]:
    """Load packed buckets into ``engine`` with a cached layout.

    Args:
        engine: has ``update_weights(named_tensors, version)``; optionally
            ``weight_version``, ``device`` and ``weight_shapes()`` / ``model``.
        buffers: one per bucket (see `BucketPayload.buffers`).
        layout_key_or_layout: the layout itself (cached under its key) or just its key.
        version: the version the engine moves to; lower than its current one raises.
        cache: the receiver's own dict, kept between calls (layouts by key, checked keys).
    Returns:
        ``{"status": "ok", "version", "bytes"}``, or ``{"status": "need_layout", "key"}``
        when the key is unknown (nothing was loaded; send the layout).
    """
    if isinstance(layout_key_or_layout, BucketLayout):
        layout = layout_key_or_layout
        cache[layout.key] = layout
    elif isinstance(layout_key_or_layout, str):
        layout = cache.get(layout_key_or_layout)
        if layout is None:
            return {"status": "need_layout", "key": layout_key_or_layout}
    else:
        raise TypeError(f"layout_key_or_layout must be a BucketLayout or its key, got {type(layout_key_or_layout).__name__}")
    check_version(engine, version)
    if (layout.key, "checked") not in cache:
        check_receiver(engine, layout)
        cache[(layout.key, "checked")] = True
    raw = _resolve(buffers, cache)
    if len(raw) != len(layout.buckets):
        raise ValueError(f"buffers: {len(raw)} given, layout {layout.key} has {len(layout.buckets)} buckets")
    device = getattr(engine, "device", None)
    tensors = []
    for arr, b in zip(raw, layout.buckets):
        t = from_wire(arr, b.dtype, b.numel)
        if device is not None and t.device != torch.device(device):
            t = t.to(device, non_blocking=True)  # one host->device copy per bucket
        tensors.append(t)
    engine.update_weights(unpack(tensors, layout), version)
    return {"status": "ok", "version": version, "bytes": layout.nbytes}


class WeightReceiverMixin:
    """Gives a rollout `Worker` a ``receive_weights(payload)`` method for `WeightRelay.push_to_group`.

    The worker keeps its generation engine in the attribute named by
    ``relay_engine_attr`` (default ``"engine"``). Use as
    ``class RolloutWorker(WeightReceiverMixin, Worker): ...``.
    """

    relay_engine_attr: str = "engine"

    def receive_weights(self, payload: BucketPayload) -> dict[str, Any]:
        if not isinstance(payload, BucketPayload):
            raise TypeError(f"receive_weights: payload must be a BucketPayload, got {type(payload).__name__}")
        engine = getattr(self, self.relay_engine_attr, None)
        if engine is None:
            raise AttributeError(f"{type(self).__name__} has no engine attribute {self.relay_engine_attr!r} "
                                 "(set relay_engine_attr to the attribute holding the generation engine)")
        cache: Mapping = self.__dict__.setdefault("_relay_layout_cache", {})
        return receive_buckets(engine, payload.buffers, payload.layout or payload.key, payload.version, cache)
