"""Loss aggregation: how a ``[B, T]`` matrix of per-token losses becomes a scalar.

Modes (config names) and where they come from:

* ``"token-mean"`` -- sum over every valid token of the batch divided by the
  number of valid tokens. DAPO's token-level policy-gradient loss (Yu et al.
  2025, DAPO eq. 12): long responses weigh in proportion to their length.
* ``"seq-mean-token-mean"`` -- mean over tokens inside each sequence, then mean
  over sequences. The original GRPO objective (Shao et al. 2024, DAPO eq. 5).
* ``"seq-mean-token-sum"`` -- sum over tokens inside each sequence, then mean
  over sequences.
* ``"seq-mean-token-sum-norm"`` -- sum over tokens inside each sequence divided
  by a constant (the maximum response length), then mean over sequences.
  Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training").

Micro-batching and data parallelism (Periodic Asynchrony §3): the full-batch loss
is a sum over rows divided by a batch-wide count. Splitting the rows into
micro-batches (or data-parallel ranks) and normalising each part by the
**global** count (``global_tokens`` / ``global_seqs``) makes the parts add up
exactly to the full-batch loss, so accumulated gradients equal the full-batch
gradient. With data parallelism the gradients must then be *summed* across
ranks; a framework that averages them (DDP/FSDP) needs the loss multiplied by
the world size. Normalising by the local count instead (the default when the
global counts are not given) is only exact when every part has the same count.

Departures from the papers: sequences with no valid token (fully masked rows,
e.g. after DAPO overlong filtering) are not counted as sequences, so they do not
dilute the sequence mean; an all-masked batch gives a loss of exactly zero
rather than NaN.
"""

from __future__ import annotations

from typing import Literal

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim
from relayrl.algorithms.names import AGG_MODES  # re-exported

Tensor = torch.Tensor


def normalized_by(mode: str) -> Literal["tokens", "seqs"]:
    """The global count ``mode`` divides by: ``"tokens"`` (``global_tokens``) for ``"token-mean"``,
    ``"seqs"`` (``global_seqs``) for the ``seq-mean-*`` modes. A loss is linear in ``1 / count``, which lets a
    streamed update run with unit counts and rescale its gradients once the count is known."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    return "tokens" if mode == "token-mean" else "seqs"


def count_tokens_and_seqs(mask: Tensor) -> tuple[int, int]:
    """Valid-token and valid-sequence counts of ``mask [B, T]``.

    A sequence counts when it has at least one valid token. Sum these over
    micro-batches (and all-reduce them over data-parallel ranks) to get the
    ``global_tokens`` / ``global_seqs`` to pass to :func:`aggregate`.
    """
    check_ndim("mask", mask, 2)
    m = mask.bool()
    return int(m.sum().item()), int(m.any(dim=1).sum().item())


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    constant: float | None = None,
) -> Tensor:
    """Reduce per-token ``values [B, T]`` over valid positions of ``mask [B, T]``.

    Args:
        values: ``[B, T]`` per-token losses (any float dtype; gradients flow).
        mask: ``[B, T]`` 1 on valid response tokens (bool, int or float).
        mode: one of :data:`AGG_MODES`.
        global_tokens: valid tokens in the whole batch (all micro-batches and
            ranks) for ``"token-mean"``; defaults to this call's count.
        global_seqs: valid sequences in the whole batch for the ``seq-mean-*``
            modes; defaults to this call's count.
        constant: the normaliser of ``"seq-mean-token-sum-norm"`` (Dr.GRPO uses
            the maximum generation length); defaults to ``T``. Pass it
            explicitly when micro-batches are padded to different lengths.

    Returns:
        A scalar tensor. Values at masked positions never contribute, even if
        they are ``inf`` or ``NaN``.
    """
    check_ndim("values", values, 2)
    check_batch(values=values, mask=mask)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    m = as_float_mask(mask, values)
    masked = torch.where(m > 0, values, torch.zeros((), dtype=values.dtype, device=values.device)) * m
    tokens_per_seq = m.sum(dim=1)

    if mode == "token-mean":
        denom = _count(global_tokens, "global_tokens", tokens_per_seq.sum())
        return masked.sum() / denom

    seq_count = _count(global_seqs, "global_seqs", (tokens_per_seq > 0).sum())
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / tokens_per_seq.clamp(min=1.0)
        return per_seq.sum() / seq_count
    if mode == "seq-mean-token-sum":
        return masked.sum() / seq_count
    # seq-mean-token-sum-norm (Dr.GRPO)
    norm = float(values.shape[1]) if constant is None else float(constant)
    if norm <= 0:
        raise ValueError(f"constant must be > 0 for seq-mean-token-sum-norm, got {constant}")
    return masked.sum() / (seq_count * norm)


def _count(given: int | float | None, name: str, local: Tensor) -> Tensor | float:
    """The normaliser: the caller's global count, or the local one (>= 1)."""
    if given is None:
        return local.clamp(min=1.0)
    if given < 0:
        raise ValueError(f"{name} must be >= 0, got {given}")
    return float(max(given, 1))
