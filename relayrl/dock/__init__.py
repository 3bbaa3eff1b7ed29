"""Sample dock: a partitioned columnar store with per-stage controllers and streaming loaders.

MindSpeed RL's transfer dock and AsyncFlow's TransferQueue (AsyncFlow §3); see
``dock.py`` and ``controller.py`` for what is implemented and what changed.

    dock = Dock(units=2, backend="local", lease_s=30.0)
    dock.open_partition("step-0", rows=2048)
    idx = dock.put("step-0", {"prompt_ids": [...], "response_ids": [...]})
    dock.put("step-0", {"ref_logprobs": [...]}, indexes=idx)
    for batch in dock.stream("step-0", stage="update", columns=["response_ids", "ref_logprobs"], batch_size=256):
        batch["response_ids"]   # one unpadded 1-D tensor per row
        batch.ack()
    dock.close_partition("step-0")

A worker in another process (``backend="process"`` on one machine, or
``backend="ray"``) writes straight to the units: ``slots =
dock.reserve("step-0", 128)`` in the driver, ``receipt = slots.write({...})``
in the worker, ``dock.publish(receipt)`` in the driver; and reads straight
from them: ``reader = dock.reader("step-0", idx, ["response_ids"])`` in the
driver, ``reader.read()`` in the worker. Only names, row indexes and these
handles cross the driver (``payload_bytes`` counts what does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl._lazy import lazy_getattr

from .config import (DockConfig, DockError, DockWriteError, LeaseLostError, PartitionClosedError, StageSpec,
                     UnitLostError, UnitLostWriteError)

if TYPE_CHECKING:
    from .dock import Dock
    from .loader import Batch, StreamLoader, balance_shards
    from .payload import payload_bytes
    from .slots import Receipt, RowReader, Slots

# Imported when first asked for: a storage unit's process imports ``relayrl.dock.units`` (this package first)
# and must not import torch (``packed.py``).
_LAZY = {"Dock": "dock", "Batch": "loader", "StreamLoader": "loader", "balance_shards": "loader",
         "payload_bytes": "payload", "Receipt": "slots", "RowReader": "slots", "Slots": "slots"}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "Batch",
    "Dock",
    "DockConfig",
    "DockError",
    "DockWriteError",
    "LeaseLostError",
    "PartitionClosedError",
    "Receipt",
    "RowReader",
    "Slots",
    "StageSpec",
    "StreamLoader",
    "UnitLostError",
    "UnitLostWriteError",
    "balance_shards",
    "payload_bytes",
]
