"""A training engine's forward pass as the loss sees it: the response-aligned record of one micro-batch's pass
(:class:`Forward`) and the per-row fields laid out beside it (:func:`pad_field`, :func:`with_loss_mask`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from relayrl.engines.training.base import LOSS_MASK_FIELD
from relayrl.models.packing import to_device

__all__ = ["Forward", "pad_field", "with_loss_mask"]


def pad_field(values: list, rows: list[int], width: int, device) -> torch.Tensor:
    """A per-row field of the batch for the pass's ``rows``: 1-D per-token values as ``[B, width]`` (zeros past
    each row's end), scalars as ``[B]``; float32 unless the values are floating point."""
    first = values[rows[0]]
    if isinstance(first, torch.Tensor) and first.dim() == 1:
        out = torch.zeros(len(rows), width, dtype=first.dtype if first.is_floating_point() else torch.float32)
        for j, i in enumerate(rows):
            v = values[i]
            out[j, : v.numel()] = v
        return to_device(out, device)
    return to_device(torch.tensor([float(values[i]) for i in rows], dtype=torch.float32), device)


class Forward(NamedTuple):
    """One micro-batch's pass, response-aligned: tensors ``[B, T]`` with ``B = len(rows)``."""

    logprobs: torch.Tensor
    """Log-probs of the response tokens (a critic: values), with grad in a training pass."""
    mask: torch.Tensor
    """Float, 1 on valid response tokens."""
    entropy: torch.Tensor | None
    rows: list[int]
    """The batch row of each of the B rows."""
    tokens: int
    """Padded input tokens of the pass."""
    ref: torch.Tensor | None = None
    """The frozen reference's log-probs of the same tokens, from the same packed input (no grad)."""
    sum_sq: torch.Tensor | None = None
    """``sum_v p_v^2`` of each position's distribution (``with_sum_sq``; no grad)."""
    routing_counts: tuple[torch.Tensor, torch.Tensor] | None = None
    """Routing replay: the replayed expert picks the policy's routers would have made, and the replayed picks."""
    recorded_routes: dict[int, torch.Tensor] | None = None
    """``record``: per batch row, the experts the policy's routers chose for its prompt + response tokens."""
    router_aux: torch.Tensor | None = None
    """``balance``: the pass's MoE load-balancing loss (0-d, with grad)."""


def with_loss_mask(f: Forward, fields: dict[str, torch.Tensor]) -> Forward:
    """``f`` with its mask multiplied by the batch's ``loss_mask`` field (environment-written tokens out of
    every loss term and count); ``f`` itself when the batch has none."""
    lm = fields.get(LOSS_MASK_FIELD)
    if lm is None:
        return f
    if lm.shape != f.mask.shape:
        raise ValueError(f"{LOSS_MASK_FIELD} is {tuple(lm.shape)}, the response mask {tuple(f.mask.shape)}: the field "
                         f"must have one value per response token")
    return f._replace(mask=f.mask * lm.to(f.mask.dtype))
