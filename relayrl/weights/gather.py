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

from typing import Iterable

import torch

__all__ = ["gather_full_state"]


def gather_full_state(named_weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``[(name, full tensor), ...]``: ``DTensor.full_tensor()`` for DTensors, the tensor itself otherwise.

    With DTensors this is a collective: every rank of each tensor's device mesh
    must call it with the same names in the same order. Plain tensors are
    returned as they are (no copy), detached from autograd.
    """
    from torch.distributed.tensor import DTensor

    out = []
    for name, t in named_weights:
        if isinstance(t, DTensor):
            t = t.full_tensor()
        elif not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r}: expected a torch.Tensor or DTensor, got {type(t).__name__}")
        out.append((name, t.detach()))
    return out
