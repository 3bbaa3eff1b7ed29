"""Vectorised building blocks: group statistics and masked discounted scans.

Group statistics use ``torch.unique(return_inverse=True)`` plus ``index_add_``
and ``scatter_reduce`` so that groups are identified by id (any integers, in
any order, of any sizes) and no Python loop runs over rows.

The discounted reverse scan ``y[t] = x[t] + c * y[t+1]`` runs over *valid*
tokens only: masked positions are skipped (they neither receive nor break the
recursion). It compacts each row's valid tokens to the left, then scans in
blocks of ``block`` positions with one small matrix product per block, so the
Python loop runs ``T / block`` times instead of ``T`` times.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

LOG_CLAMP = 20.0
"""Bound on a log-ratio (or log-prob difference) before it is exponentiated: e^20 ~ 5e8 stays finite in
bfloat16 and float32, and a ratio that large is clipped or capped by every loss anyway."""


def pad_right(seqs, value: float = 0.0) -> Tensor:
    """Stack 1-D tensors (a sequence of unpadded rows) into ``[B, max_len]``, padded on the right."""
    width = max((int(s.numel()) for s in seqs), default=0)
    if not seqs:
        return torch.empty(0, 0)
    return torch.stack([torch.nn.functional.pad(s, (0, width - s.numel()), value=value) for s in seqs])


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense index ``[N]`` in ``0..G-1`` for arbitrary group ids, and ``G``."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1
    return inverse, num_groups


def group_sum_count(x: Tensor, index: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """Per-group sum ``[G]`` and member count ``[G]`` (count in ``x``'s dtype)."""
    sums = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, index, x)
    counts = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(
        0, index, torch.ones_like(x)
    )
    return sums, counts


def group_mean_std(x: Tensor, index: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-member group mean ``[N]``, unbiased group std ``[N]`` and group size ``[N]``.

    A group of one member has std 0 (not NaN). A group whose members are all equal has exactly their value as
    its mean and std 0: ``sum / n`` of eight float32 rewards of 0.7 is not 0.7, and the residue's std of about
    6e-8 made GRPO's ``(r - mean) / (std + 1e-6)`` 0.056 for every member of such a group, not 0.
    """
    sums, counts = group_sum_count(x, index, num_groups)
    lo, hi = group_min_max(x, index, num_groups)
    mean = torch.where((lo == hi)[index], x, (sums / counts)[index])
    dev = x - mean
    sq = torch.zeros_like(sums).index_add_(0, index, dev * dev)
    var = sq / (counts - 1.0).clamp(min=1.0)
    return mean, var.sqrt()[index], counts[index]


def group_min_max(x: Tensor, index: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """Per-group minimum ``[G]`` and maximum ``[G]``."""
    init_min = torch.full((num_groups,), float("inf"), dtype=x.dtype, device=x.device)
    init_max = torch.full((num_groups,), float("-inf"), dtype=x.dtype, device=x.device)
    gmin = init_min.scatter_reduce(0, index, x, reduce="amin", include_self=True)
    gmax = init_max.scatter_reduce(0, index, x, reduce="amax", include_self=True)
    return gmin, gmax


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (0 when there are none)."""
    m = mask.to(x.dtype)
    xm = torch.where(m > 0, x, torch.zeros((), dtype=x.dtype, device=x.device)) * m
    if dim is None:
        return xm.sum() / m.sum().clamp(min=1.0)
    return xm.sum(dim=dim) / m.sum(dim=dim).clamp(min=1.0)


def masked_max(x: Tensor, keep: Tensor, empty: float = 0.0) -> Tensor:
    """Largest ``x`` where ``keep`` is true, ``empty`` when nothing is kept; no host read (``x[keep].max()``
    would wait for the device to count the kept entries)."""
    low = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    best = torch.where(keep, x, low).max()
    return torch.where(keep.any(), best, torch.full((), empty, dtype=x.dtype, device=x.device))


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` with mean/std over valid positions; 0 where masked."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    n = m.sum()
    var = (((x - mean) * m) ** 2).sum() / (n - 1.0).clamp(min=1.0)
    return (x - mean) / (var.sqrt() + eps) * m


def _compact(x: Tensor, valid: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Move each row's valid entries to the left: ``[B, T] -> [B, L]``."""
    rank = valid.long().cumsum(dim=1) - 1
    length = int(valid.sum(dim=1).max().item()) if valid.any() else 0
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(valid)
    where = (rows[valid], rank[valid])
    out = torch.zeros(x.shape[0], max(length, 1), dtype=x.dtype, device=x.device)
    out[where] = x[valid]
    return out, where


def _reverse_scan(x: Tensor, c: float, block: int = 64) -> Tensor:
    """``y[:, t] = x[:, t] + c * y[:, t+1]`` for ``x [B, L]`` (blocked, stable)."""
    B, L = x.shape
    k = min(block, L)
    pos = torch.arange(k, device=x.device)
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)  # i - j
    c_t = torch.tensor(c, dtype=x.dtype, device=x.device)
    # W[i, j] = c^(i-j) for i >= j: y_local[j] = sum_i x[i] * W[i, j].
    weights = torch.where(diff >= 0, c_t ** diff.clamp(min=0).to(x.dtype), torch.zeros_like(c_t))
    carry_pow = c_t ** (k - pos).to(x.dtype)  # c^(block_end - j)
    out = torch.empty_like(x)
    carry = torch.zeros(B, dtype=x.dtype, device=x.device)
    for end in range(L, 0, -k):
        start = max(0, end - k)
        n = end - start
        local = x[:, start:end] @ weights[:n, :n]
        local = local + carry.unsqueeze(1) * carry_pow[k - n :]
        out[:, start:end] = local
        carry = local[:, 0]
    return out


def masked_discounted_returns(x: Tensor, mask: Tensor, c: float) -> Tensor:
    """Reverse discounted sum of ``x [B, T]`` over valid tokens, skipping masked ones.

    ``y[t] = x[t] + c * y[next valid t']``; 0 at masked positions.
    """
    valid = mask.bool()
    compact, where = _compact(x, valid)
    scanned = _reverse_scan(compact, c)
    out = torch.zeros_like(x)
    out[valid] = scanned[where]
    return out


def masked_next_values(values: Tensor, mask: Tensor) -> Tensor:
    """For each valid token, the value at the next valid token of its row (0 after the last)."""
    valid = mask.bool()
    compact, where = _compact(values, valid)
    shifted = torch.zeros_like(compact)
    shifted[:, :-1] = compact[:, 1:]
    out = torch.zeros_like(values)
    out[valid] = shifted[where]
    return out
