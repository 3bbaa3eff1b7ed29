"""Ragged columns: one tensor per row in memory, one flat buffer + lengths on the wire.

AsyncFlow's TransferQueue (§3) keeps variable-length data unpadded by concatenating
along the sequence dimension and restoring rows from length metadata; this
module does the same. A row value is a tensor of shape ``[L_i, *tail]`` (ragged
on dim 0, ``tail`` fixed per column) or a 0-d tensor (a scalar column). The
packed form is a numpy buffer (numpy, because Ray hands numpy arrays over
without a copy while torch tensors are pickled) of shape ``[sum_i L_i, *tail]``
plus ``lengths: [n]``; for a scalar column the buffer is ``[n]`` (``packed.py``).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from .packed import ColumnSchema, PackedColumn

# torch dtypes numpy cannot hold travel as a same-width integer view.
_VIEW_AS = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _VIEW_AS[getattr(torch, _name)] = torch.uint8


class Rows(NamedTuple):
    """One column of a ``put`` after :func:`normalize_column`."""

    values: list[torch.Tensor]
    """one tensor per row (the caller's tensors, or 0-d views)"""
    schema: ColumnSchema
    lengths: np.ndarray
    """``[n]`` int64 row lengths along dim 0 (1 for scalar rows)"""


def normalize_column(name: str, values: Any, n_rows: int | None) -> Rows:
    """Turn one column of a ``put`` into row tensors, their schema and their lengths.

    Args:
        name: column name (used in error messages).
        values: a list/tuple with one tensor or Python/numpy scalar per row, or a
            tensor ``[n, ...]`` whose slices along dim 0 are the rows.
        n_rows: expected number of rows, or None to accept any.
    Returns:
        ``Rows``; the row tensors are the caller's (no copy) or 0-d views.
    """
    if isinstance(values, torch.Tensor):
        if values.dim() == 0:
            raise ValueError(f"column {name!r}: a 0-d tensor is one value; give a list with one value per row")
        rows = list(values.unbind(0))
    elif isinstance(values, (list, tuple)):
        if len(values) == 0:
            raise ValueError(f"column {name!r}: no rows given")
        types = set(map(type, values))
        if types == {torch.Tensor}:  # the common case, one pass over types only
            rows = list(values)
        elif all(issubclass(t, numbers.Number) and not issubclass(t, np.generic) for t in types):
            rows = list(torch.tensor(values).unbind(0))  # Python floats -> default dtype (float32)
        elif all(issubclass(t, (numbers.Number, np.generic)) for t in types):
            rows = list(torch.as_tensor(np.asarray(values)).unbind(0))
        else:
            rows = []
            for i, v in enumerate(values):
                if isinstance(v, torch.Tensor):
                    rows.append(v)
                elif isinstance(v, np.ndarray):
                    rows.append(torch.from_numpy(v))
                elif isinstance(v, (numbers.Number, np.generic)):
                    rows.append(torch.as_tensor(v))
                else:
                    raise TypeError(f"column {name!r}, row {i}: expected a tensor or a scalar, got {type(v).__name__}")
    else:
        raise TypeError(f"column {name!r}: expected a list with one tensor or scalar per row, got {type(values).__name__}")
    if n_rows is not None and len(rows) != n_rows:
        raise ValueError(f"column {name!r} has {len(rows)} rows but the put has {n_rows}")
    first = rows[0]
    schema = ColumnSchema.of(first.dtype, tuple(first.shape[1:]), first.dim() == 0)
    # One pass over the rows' shapes and dtypes; the slow loop below only names the culprit.
    shapes = [r.shape for r in rows]
    ok = {r.dtype for r in rows} == {schema.dtype}
    if schema.scalar:
        ok = ok and not any(shapes)
        lengths = np.ones(len(rows), dtype=np.int64)
    else:
        dims = set(map(len, shapes))
        ok = ok and dims == {first.dim()} and (not schema.tail or {s[1:] for s in shapes} == {first.shape[1:]})
        lengths = np.array([s[0] for s in shapes], dtype=np.int64) if ok else None
    if not ok:
        for i, r in enumerate(rows):
            if r.dtype != schema.dtype:
                raise TypeError(f"column {name!r}, row {i}: dtype {r.dtype} differs from row 0 ({schema.dtype})")
            if (r.dim() == 0) != schema.scalar or (not schema.scalar and tuple(r.shape[1:]) != schema.tail):
                raise ValueError(f"column {name!r}, row {i}: shape {tuple(r.shape)} does not match row 0 ({schema.describe()})")
    return Rows(rows, schema, lengths)


def row_lengths(rows: Sequence[torch.Tensor], schema: ColumnSchema) -> np.ndarray:
    """Lengths along dim 0 of ``rows``: ``[n]`` int64 (1 for scalar rows)."""
    if schema.scalar:
        return np.ones(len(rows), dtype=np.int64)
    return np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=len(rows))


def pack(rows: Sequence[torch.Tensor], schema: ColumnSchema, lengths: np.ndarray | None = None) -> PackedColumn:
    """Pack row tensors into one flat CPU numpy buffer + lengths (one copy); ``lengths`` if already known."""
    lengths = row_lengths(rows, schema) if lengths is None else lengths
    if schema.scalar:
        flat = torch.stack(list(rows)) if rows else torch.empty(0, dtype=schema.dtype)
    else:
        flat = torch.cat(list(rows)) if rows else torch.empty((0, *schema.tail), dtype=schema.dtype)
    flat = flat.detach().cpu()
    if flat.dtype in _VIEW_AS:
        flat = flat.view(_VIEW_AS[flat.dtype])
    return PackedColumn(flat=flat.numpy(), lengths=lengths, schema=schema)


def flat_tensor(packed: PackedColumn) -> torch.Tensor:
    """The packed buffer as one writable torch tensor of the column's dtype (always a fresh copy:
    buffers from Ray's object store are read-only). ``packed.flat`` may be a list of buffers, which
    are joined by the same copy."""
    flat = packed.flat
    arr = np.concatenate(flat) if isinstance(flat, list) else np.array(flat, copy=True)
    t = torch.from_numpy(arr)
    if packed.schema.dtype in _VIEW_AS:
        t = t.view(packed.schema.dtype)
    return t


def unpack(packed: PackedColumn) -> list[torch.Tensor]:
    """Rows of a packed column: views into one writable flat tensor."""
    flat = flat_tensor(packed)
    if packed.schema.scalar:
        return list(flat.unbind(0))
    return list(flat.split(packed.lengths.tolist()))
