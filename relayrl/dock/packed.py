"""The packed form of a column, as the storage units hold it: imports numpy, never torch.

A storage unit in its own process (a Ray actor, or a unit process of
``backend="process"``) stores packed columns and hands them back; it never
looks inside a row. So the unit's process needs neither torch nor the rest
of the dock: a unit starts in about half a second instead of the ~5 s and
~200 MB that importing torch costs a process (on a 2-core machine). A
column's dtype therefore travels by name; the driver and the ranks, which
build and read the tensors, turn it into a ``torch.dtype`` when they ask
(``ColumnSchema.dtype``). ``columns.py`` packs and unpacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ColumnSchema:
    """Dtype and per-row shape of a column, fixed by its first write.

    Attributes:
        dtype_name: the element dtype's name in torch (``"bfloat16"``); ``dtype`` is the ``torch.dtype``.
        tail: row shape after the ragged dim 0 (``()`` for 1-D rows).
        scalar: rows are 0-d tensors (``tail`` is then ``()``).
    """

    dtype_name: str
    tail: tuple[int, ...]
    scalar: bool

    @classmethod
    def of(cls, dtype: torch.dtype, tail: tuple[int, ...], scalar: bool) -> ColumnSchema:
        return cls(str(dtype).removeprefix("torch."), tail, scalar)

    @property
    def dtype(self) -> torch.dtype:
        import torch  # (asked only where rows are built or read, which import torch anyway)

        return getattr(torch, self.dtype_name)

    def describe(self) -> str:
        if self.scalar:
            shape = "[]"
        elif self.tail:
            shape = "[L, " + ", ".join(map(str, self.tail)) + "]"
        else:
            shape = "[L]"
        return f"torch.{self.dtype_name} rows of shape {shape}"


@dataclass(frozen=True)
class PackedColumn:
    """Rows of one column packed for transfer.

    Attributes:
        flat: ``[sum(lengths), *tail]`` (or ``[n]`` for scalars), numpy; on the
            way back from a unit, possibly a list of such buffers to read back to
            back (the unit does not join them: unpacking copies once anyway).
        lengths: ``[n]`` int64, row lengths along dim 0 (1 for scalars).
        schema: the column's schema, used to rebuild rows.
    """

    flat: np.ndarray | list[np.ndarray]
    lengths: np.ndarray
    schema: ColumnSchema
