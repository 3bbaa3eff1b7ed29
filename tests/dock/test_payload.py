"""``payload_bytes``: the bytes of tensors and arrays inside nested containers, without pickling."""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from relayrl.dock import Receipt, payload_bytes


@dataclass
class Micro:
    ids: torch.Tensor
    extra: dict


class Pair(NamedTuple):
    a: torch.Tensor
    b: np.ndarray


def test_counts_tensors_and_arrays_in_nested_containers():
    t = torch.zeros(3, 4)  # 48 bytes
    assert payload_bytes(t) == 48
    assert payload_bytes(np.zeros(5, dtype=np.int16)) == 10
    assert payload_bytes(torch.zeros(2, dtype=torch.bfloat16)) == 4
    nested = {"a": [t, (torch.ones(2, dtype=torch.int64),)], "b": {"c": np.ones(2)}, "name": "x", "n": 3}
    assert payload_bytes(nested) == 48 + 16 + 16
    assert payload_bytes(Micro(ids=torch.zeros(4, dtype=torch.int32), extra={"v": [torch.zeros(1)]})) == 16 + 4
    assert payload_bytes(Pair(torch.zeros(1), np.zeros(1))) == 4 + 8
    assert payload_bytes({1, 2.0, None, "s", b"bytes"}) == 0 and payload_bytes(object()) == 0


def test_views_count_their_own_elements_and_repeats_count_once():
    flat = torch.zeros(100)
    rows = list(flat.split([10, 90]))
    assert payload_bytes(rows) == 400  # views: their elements, not the shared storage twice
    assert payload_bytes([flat[:10]]) == 40
    t = torch.zeros(8)
    assert payload_bytes([t, t, {"again": t}]) == 32  # pickling would send it once
    loop: list = [t]
    loop.append(loop)
    assert payload_bytes(loop) == 32  # cycles end


def test_a_receipt_is_metadata_only():
    """A write receipt (row indexes and lengths) is what a worker returns instead of its samples: it counts 0,
    also inside the containers a group call returns."""
    r = Receipt("p", 1, np.arange(4, dtype=np.int64), {"x": (None, np.ones(4, dtype=np.int64))})
    assert payload_bytes(r) == 0 and payload_bytes([(r, {"group": 3})]) == 0
    assert payload_bytes([r, np.ones(2, dtype=np.int64)]) == 16
