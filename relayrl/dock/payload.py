"""``payload_bytes``: how many bytes of sample data an object carries.

Used to measure what crosses the driver (``dock/driver_bytes``, and
``WorkerGroup.bytes_by_method``): with the dock as the data plane, a call
should carry names, row indexes and handles, not tensors. The count walks the
object instead of pickling it, so it is cheap enough to run on every call.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

_ATOMS = (type(None), bool, int, float, complex, str, bytes)


def payload_bytes(obj: Any) -> int:
    """Bytes of the torch tensors and numpy arrays inside ``obj``.

    Walks lists, tuples (named tuples too), sets, dict values and dataclass
    fields, to any depth; other objects count 0, and so do objects whose class sets ``METADATA = True``
    (the dock's write receipts: row indexes and lengths, not sample data). A tensor counts
    ``numel * element_size`` (its own elements, not the storage it views); an
    object reached twice counts once, as pickling would send it once.
    """
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")  # nothing to count if never imported
    tensor = torch.Tensor if torch is not None else ()
    array = np.ndarray if np is not None else ()
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, _ATOMS) or id(x) in seen or getattr(type(x), "METADATA", False):
            continue
        seen.add(id(x))
        if isinstance(x, tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, array):
            total += x.nbytes
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return total
