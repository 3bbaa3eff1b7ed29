"""Dispatch and collect: how `WorkerGroup.split` cuts data over ranks and
gathers results back.

These are HybridFlow's DP-style transfer protocol (§4.1: a
dispatch function splits a batch over data-parallel ranks, a collect function
gathers their outputs in rank order) written as two pure functions. Departure:
HybridFlow binds a protocol to a method with a `@register` decorator; here the
call site picks `all` / `split` / `one` explicitly, and only this contiguous
split/concat protocol exists (3D protocols belong to engines).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


def chunk_sizes(length: int, n: int) -> list[int]:
    """Sizes of `n` contiguous chunks of `length` items; the first `length % n`
    chunks get one extra item (as `torch.tensor_split`). Chunks may be empty."""
    if n < 1:
        raise ValueError(f"n={n} ranks must be >= 1")
    base, extra = divmod(length, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def split_items(items: Any, n: int) -> list[Any]:
    """Cut `items` into `n` contiguous chunks, one per rank, in rank order.

    Accepts a list or tuple (chunks are lists), a tensor `[B, ...]` or numpy
    array (cut along dim 0), or any object with a `split(n)` method that returns
    exactly `n` chunks.
    """
    if isinstance(items, (list, tuple)):
        out, start = [], 0
        for size in chunk_sizes(len(items), n):
            out.append(list(items[start:start + size]))
            start += size
        return out
    if isinstance(items, torch.Tensor):
        if items.dim() == 0:
            raise ValueError("split items: a 0-d tensor cannot be split over ranks")
        return list(torch.tensor_split(items, n, dim=0))
    if isinstance(items, np.ndarray):
        return list(np.array_split(items, n, axis=0))
    split = getattr(items, "split", None)
    if not callable(split):
        raise TypeError(
            f"split items of type {type(items).__name__} cannot be split: pass a list, a tensor, an array "
            "or an object with a split(n) method returning n chunks"
        )
    chunks = list(split(n))
    if len(chunks) != n:
        raise ValueError(f"{type(items).__name__}.split({n}) returned {len(chunks)} chunks; it must return exactly {n}")
    return chunks


def gather_split(results: list[Any]) -> Any:
    """Join per-rank results (rank order) of a split call into one value.

    Lists are concatenated, tensors and arrays concatenated along dim 0, objects
    whose type has a `concat` classmethod are joined with `type.concat(results)`;
    anything else (None, dicts, scalars) comes back as the per-rank list.
    """
    if not results:
        return results
    first = results[0]
    if all(isinstance(r, list) for r in results):
        return [x for r in results for x in r]
    if all(isinstance(r, torch.Tensor) for r in results) and first.dim() > 0:
        return torch.cat(results, dim=0)
    if all(isinstance(r, np.ndarray) for r in results) and first.ndim > 0:
        return np.concatenate(results, axis=0)
    concat = getattr(type(first), "concat", None)
    if callable(concat) and all(type(r) is type(first) for r in results):
        return concat(results)
    return list(results)
