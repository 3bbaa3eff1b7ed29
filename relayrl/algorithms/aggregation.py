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
* ``"prompt-mean-token-mean"`` -- mean over the tokens of each prompt group (the
  rows sampled from one prompt, a GRPO group), then mean over groups:
  ``1/|G| sum_g (1 / sum_{i in g} |y_i|) sum_{i in g} sum_t l_{i,t}``. ScaleRL's
  "prompt-level" average (Khatri et al. 2025, "The Art of Scaling Reinforcement
  Learning Compute for LLMs", §3.2): every prompt weighs the same, and inside a
  prompt every token does. It needs each row's group: ``group_tokens [B]``, the
  valid tokens of the row's whole group (:func:`group_token_counts`).

Micro-batching and data parallelism (Periodic Asynchrony §3): the full-batch loss
is a sum over rows divided by a batch-wide count. Splitting the rows into
micro-batches (or data-parallel ranks) and normalising each part by the
**global** count (``global_tokens`` / ``global_seqs``) makes the parts add up
exactly to the full-batch loss, so accumulated gradients equal the full-batch
gradient. With data parallelism the gradients must then be *summed* across
ranks; a framework that averages them (DDP/FSDP) needs the loss multiplied by
the world size. Normalising by the local count instead (the default when the
global counts are not given) is only exact when every part has the same count.

The prompt-level mode splits the same way once each row carries its group's
token count, taken where the groups are whole: a token of group ``g`` weighs
``1 / group_tokens``, and the parts divide by the global number of groups
(``global_groups``). The groups are counted row by row, each row adding its
share of its group's tokens (:func:`count_groups`), so a group whose rows fall
into several micro-batches or ranks is still counted once, and the count adds
up over parts like the others. A mini-batch holding part of a group counts that
part's share (a fraction): its loss weighs every token as the full batch does.

Departures from the papers: sequences with no valid token (fully masked rows,
e.g. after DAPO overlong filtering) are not counted as sequences, so they do not
dilute the sequence mean; an all-masked batch gives a loss of exactly zero
rather than NaN. Likewise a prompt group with no valid token (every response
cut by the overlong filter) is not counted as a group.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim
from relayrl.algorithms.names import AGG_MODES, GROUP_AGG_MODES  # re-exported

Tensor = torch.Tensor


def normalized_by(mode: str) -> Literal["tokens", "seqs", "groups"]:
    """The global count ``mode`` divides by: ``"tokens"`` (``global_tokens``) for ``"token-mean"``,
    ``"seqs"`` (``global_seqs``) for the ``seq-mean-*`` modes, ``"groups"`` (``global_groups``) for
    ``"prompt-mean-token-mean"``. A loss is linear in ``1 / count``, which lets a streamed update run with unit
    counts and rescale its gradients once the count is known."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    return "tokens" if mode == "token-mean" else "groups" if mode in GROUP_AGG_MODES else "seqs"


def group_token_counts(tokens: Sequence[float] | Tensor, groups: Sequence[int] | Tensor) -> Tensor:
    """``[N]`` float64: for each row, the valid tokens of its whole prompt group.

    Args:
        tokens: ``[N]`` valid (loss-masked) response tokens of each row.
        groups: ``[N]`` the prompt-group id of each row (rows of a group share it).

    Computed over rows that hold every row of each of their groups that is trained (a step's batch, a chunk
    of whole groups); the result travels with the rows as the ``group_tokens`` of :func:`aggregate`.
    """
    n = torch.as_tensor(tokens, dtype=torch.float64).reshape(-1)
    g = torch.as_tensor(groups, dtype=torch.long).reshape(-1)
    if n.shape != g.shape:
        raise ValueError(f"tokens has {n.numel()} rows but groups has {g.numel()}")
    if n.numel() == 0:
        return n
    if bool((n < 0).any()):
        raise ValueError(f"tokens must be >= 0; row {int((n < 0).nonzero()[0])} has {float(n[n < 0][0])}")
    ids, inverse = torch.unique(g, return_inverse=True)
    totals = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, n)
    return totals[inverse]


def count_groups(mask: Tensor, group_tokens: Tensor) -> float:
    """The prompt groups among the rows of ``mask [B, T]``, each row counting its share of its group's tokens
    (``group_tokens [B]``, :func:`group_token_counts`): a whole group counts 1, a group with no valid token 0,
    part of a group its share. Sum it over micro-batches (and ranks) to get ``global_groups``."""
    check_ndim("mask", mask, 2)
    check_ndim("group_tokens", group_tokens, 1)
    tokens = mask.to(torch.float64).sum(dim=1)
    return float((tokens / group_tokens.to(torch.float64).clamp(min=1.0)).sum())


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
    group_tokens: Tensor | None = None,
    global_groups: float | None = None,
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
        group_tokens: ``[B]`` the valid tokens of each row's whole prompt group
            (:func:`group_token_counts`); required by ``"prompt-mean-token-mean"``.
        global_groups: prompt groups in the whole batch for
            ``"prompt-mean-token-mean"`` (:func:`count_groups` summed over the
            parts; may be fractional in a mini-batch holding part of a group);
            defaults to this call's count.

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
    if mode in GROUP_AGG_MODES:
        if group_tokens is None:
            raise ValueError(f"{mode} weighs every prompt group the same: pass group_tokens, the valid tokens of "
                             f"each row's whole group ([B], group_token_counts)")
        check_ndim("group_tokens", group_tokens, 1)
        if group_tokens.shape[0] != values.shape[0]:
            raise ValueError(f"group_tokens has {group_tokens.shape[0]} rows but values has {values.shape[0]}")
        per_group_tokens = group_tokens.to(device=values.device, dtype=values.dtype).clamp(min=1.0)
        per_row = masked.sum(dim=1) / per_group_tokens  # a row's share of its group's token mean
        local = (tokens_per_seq / per_group_tokens).sum()  # the groups here, each row adding its share
        if global_groups is None:
            return per_row.sum() / torch.where(local > 0, local, torch.ones_like(local))
        if global_groups < 0:
            raise ValueError(f"global_groups must be >= 0, got {global_groups}")
        return per_row.sum() / (float(global_groups) if global_groups > 0 else 1.0)

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
