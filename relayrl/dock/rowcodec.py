"""Rows of dock columns as one safetensors payload: the wire format of the dock's service API.

A column of variable-length rows travels ragged, as the dock stores it: its
rows concatenated (``<col>.values``, ``[sum L_i, *tail]``) and their lengths
(``<col>.lengths``, ``[n]``); a column of scalars as one ``[n]`` tensor. The
payload's metadata (strings) carries the column kinds and a JSON object of the
call's fields (partition, indexes, lease). safetensors rather than pickle: a
service must not execute what a client sends.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import torch

__all__ = ["encode_rows", "decode_rows", "RowCodecError"]


class RowCodecError(ValueError):
    """A payload that is not a dock row payload (the message says what is wrong)."""


def _as_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu")
    return torch.as_tensor(v)


def encode_rows(columns: Mapping[str, Sequence[Any]], meta: Mapping[str, Any] | None = None) -> bytes:
    """``columns`` maps a name to one tensor (``[L_i, *tail]``) or scalar per row; ``meta`` is JSON-able."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    n = None
    for name, rows in columns.items():
        if "." in name:
            raise RowCodecError(f"column {name!r}: names may not contain '.'")
        rows = [_as_tensor(r) for r in rows]
        if n is not None and len(rows) != n:
            raise RowCodecError(f"column {name!r} has {len(rows)} rows, the others {n}")
        n = len(rows)
        if rows and all(r.dim() == 0 for r in rows):
            tensors[name] = torch.stack(rows).contiguous()
            kinds[name] = "scalar"
        else:
            if any(r.dim() == 0 for r in rows):
                raise RowCodecError(f"column {name!r} mixes scalars and tensors")
            tensors[f"{name}.values"] = torch.cat(rows).contiguous() if rows else torch.zeros(0)
            tensors[f"{name}.lengths"] = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
            kinds[name] = "ragged"
    if not tensors:  # safetensors needs a tensor; a row-less payload (a lease's metadata only) carries a marker
        tensors["__empty__"] = torch.zeros(0)
    return save(tensors, metadata={"kinds": json.dumps(kinds), "meta": json.dumps(dict(meta or {}))})


def decode_rows(payload: bytes) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any]]:
    """Inverse of :func:`encode_rows`: (columns as lists of row tensors, meta)."""
    from safetensors.torch import load

    if not payload:
        raise RowCodecError("the payload is empty")
    try:
        tensors = load(payload)
        header_len = int.from_bytes(payload[:8], "little")
        header = json.loads(payload[8:8 + header_len])
        info = header.get("__metadata__") or {}
        kinds = json.loads(info["kinds"])
        meta = json.loads(info["meta"])
    except Exception as e:  # noqa: BLE001 - any malformed payload is the sender's error
        raise RowCodecError(f"not a dock row payload (safetensors with kinds and meta): {e}") from None
    out: dict[str, list[torch.Tensor]] = {}
    for name, kind in kinds.items():
        if kind == "scalar":
            out[name] = list(tensors[name].unbind(0))
        elif kind == "ragged":
            values, lengths = tensors[f"{name}.values"], tensors[f"{name}.lengths"]
            if int(lengths.sum()) != values.shape[0] or (lengths < 0).any():
                raise RowCodecError(f"column {name!r}: lengths do not add up to the values")
            out[name] = list(torch.split(values, lengths.tolist())) if len(lengths) else []
        else:
            raise RowCodecError(f"column {name!r}: unknown kind {kind!r}")
    if not isinstance(meta, dict):
        raise RowCodecError("the payload's meta is not a JSON object")
    return out, meta
