"""Resharding flow, first half: full tensors out of a (possibly sharded) trainer.

Seed 001's 3D-HybridEngine regroups the training layout (p-t-d) into a
generation layout (p_g-t_g-d_g-d) with all-gathers only inside micro
data-parallel groups, so each device ends up holding exactly its generation
shard and no redundant copy (zero-redundancy resharding). Seed 000's
allgather-swap gathers into a temporary buffer, selects the generation slices,
and swaps the training weights to host memory.

relayrl departs from both: its generation engines take *full* (unsharded)
weights and there is no tensor-parallel generation layout yet, so resharding
reduces to "gather every tensor in full". `gather_full_state` does that for
FSDP2 trainers (parameters are ``DTensor``s: ``full_tensor()`` all-gathers
them) and is a no-op for plain tensors, so the relay works unchanged behind
FSDP2. The memory cost is the full model once per training rank (no
zero-redundancy regrouping); the training state can be moved to host
meanwhile with `relayrl.weights.offload` (the "swap" of allgather-swap).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

__all__ = ["gather_full_state"]

# Local shard bytes gathered by one collective (the full bucket is world x this). Small: on two CPU ranks a
# 395 MiB model gathered in 0.87-1.0 s with 4 MiB buckets, 1.3-1.4 s with 16, 2.3-2.5 s with 256 (the extra
# copies of a large flat buffer cost more than the collectives saved), and 1.0-1.5 s a tensor at a time.
BUCKET_BYTES = 4 << 20


def gather_full_state(named_weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES,
                      keep: bool = True) -> list[tuple[str, torch.Tensor]] | None:
    """``[(name, full tensor), ...]``: the full value of each DTensor, the tensor itself otherwise.

    With DTensors this is a collective: every rank of each tensor's device mesh must call it with the same
    names in the same order. FSDP2's parameters (``Shard(0)`` on a one-dimensional mesh) are gathered in
    buckets, one all-gather per ``bucket_bytes`` of local shards, instead of one per tensor
    (``DTensor.full_tensor()``, which the other layouts still take): a model's few hundred collectives cost
    more in latency than in bytes (on two CPU ranks, 50 tensors of the demo model took 0.1-0.15 s apart).
    Plain tensors are returned as they are (no copy), detached from autograd. ``keep=False``: this rank takes
    part in the collectives and drops each bucket once gathered (None is returned), so it holds one bucket at a
    time instead of the full model (the ranks whose copy nobody reads: all but the relay's sender).
    """
    from torch.distributed.tensor import DTensor

    items = list(named_weights)
    out: list[torch.Tensor | None] = [None] * len(items)
    buckets: dict[tuple, list[int]] = {}  # same mesh, dtype and device: one flat buffer
    for i, (name, t) in enumerate(items):
        if isinstance(t, DTensor):
            if _row_sharded(t):
                buckets.setdefault((id(t.device_mesh), t.dtype, t.device), []).append(i)
            else:
                full = t.full_tensor()  # (a collective: every rank calls it)
                out[i] = full if keep else None
        elif isinstance(t, torch.Tensor):
            out[i] = t
        else:
            raise TypeError(f"weight {name!r}: expected a torch.Tensor or DTensor, got {type(t).__name__}")
    for idx in buckets.values():  # the same order on every rank: the names' order
        start, size = 0, 0
        for j, i in enumerate(idx):  # sizes every rank agrees on (its slot's, not its own shard's rows)
            t = items[i][1]
            size += -(-t.shape[0] // t.device_mesh.size()) * math.prod(t.shape[1:]) * t.element_size()
            if size >= bucket_bytes or j == len(idx) - 1:
                for i_, full in zip(idx[start:j + 1], _gather_rows([items[k][1] for k in idx[start:j + 1]])):
                    out[i_] = full if keep else None
                start, size = j + 1, 0
    return [(name, t.detach()) for (name, _), t in zip(items, out)] if keep else None


def _row_sharded(t) -> bool:
    from torch.distributed.tensor import Shard

    return (t.device_mesh.ndim == 1 and len(t.placements) == 1 and isinstance(t.placements[0], Shard)
            and t.placements[0].dim == 0 and t.dim() > 0)


def _gather_rows(tensors: list) -> list[torch.Tensor]:
    """Full values of DTensors sharded by rows on one mesh, with one all-gather. A rank's shard of ``n`` rows
    is ``torch.chunk``'s: rows ``[r c, min((r + 1) c, n))`` with ``c = ceil(n / world)``, so each rank packs its
    shards into slots of ``c`` rows, and the rows past ``n`` are dropped after the gather."""
    import torch.distributed as dist

    mesh = tensors[0].device_mesh
    world = mesh.size()
    rank = mesh.get_local_rank()
    shapes = [t.shape for t in tensors]
    widths = [math.prod(s[1:]) for s in shapes]  # elements per row
    rows = [-(-s[0] // world) for s in shapes]
    for t, shape, c in zip(tensors, shapes, rows):
        if t.to_local().shape[0] != max(0, min(c, shape[0] - rank * c)):
            raise RuntimeError(f"a row-sharded tensor of shape {tuple(shape)} holds {t.to_local().shape[0]} rows on "
                               f"rank {rank} of {world}, not torch.chunk's split")
    slot = sum(c * w for c, w in zip(rows, widths))
    local = tensors[0].to_local()
    send = torch.zeros(slot, dtype=local.dtype, device=local.device)
    at = 0
    for t, c, w in zip(tensors, rows, widths):
        part = t.to_local().contiguous().reshape(-1)
        send[at:at + part.numel()] = part
        at += c * w
    recv = torch.empty(world * slot, dtype=send.dtype, device=send.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name before torch 2.13
    gather(recv, send, group=mesh.get_group())
    recv = recv.view(world, slot)
    full, at = [], 0
    for shape, c, w in zip(shapes, rows, widths):
        pieces = [recv[r, at:at + max(0, min(c, shape[0] - r * c)) * w] for r in range(world)]
        full.append(torch.cat(pieces).view(shape))
        at += c * w
    return full
