"""Resharding flow, first half: full tensors out of a (possibly sharded) trainer.

HybridFlow's 3D-HybridEngine (§5) regroups the training layout (p-t-d) into a
generation layout (p_g-t_g-d_g-d) with all-gathers only inside micro
data-parallel groups, so each device ends up holding exactly its generation
shard and no redundant copy (zero-redundancy resharding). MindSpeed RL's
allgather-swap gathers into a temporary buffer, selects the generation slices,
and swaps the training weights to host memory.

relayrl departs from both: its generation engines take *full* (unsharded)
weights and there is no tensor-parallel generation layout yet, so resharding
reduces to "gather every tensor in full". `gather_full_state` does that for
FSDP2 trainers (parameters are ``DTensor``s: ``full_tensor()`` all-gathers
them) and is a no-op for plain tensors, so the relay works unchanged behind
FSDP2. `stream_full_state` yields the full tensors one gathered bucket at a
time, so a relay that packs or loads each bucket before the next is gathered
holds one bucket more than the trainer's shards, not the model (verl's
``layered_summon`` streams per layer the same way); `gather_full_state` keeps
the whole list for checkpoints and exports. The training state can be moved
to host meanwhile with `relayrl.weights.offload` (the "swap" of allgather-swap).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

__all__ = ["WeightStream", "gather_full_state", "stream_full_state"]

# Local shard bytes gathered by one collective (the full bucket is world x this). Small: on two CPU ranks a
# 395 MiB model gathered in 0.87-1.0 s with 4 MiB buckets, 1.3-1.4 s with 16, 2.3-2.5 s with 256 (the extra
# copies of a large flat buffer cost more than the collectives saved), and 1.0-1.5 s a tensor at a time.
BUCKET_BYTES = 4 << 20


@dataclass(frozen=True)
class WeightStream:
    """Weights to relay produced one at a time: what they are now, their values on demand.

    `relayrl.weights.WeightRelay` packs it into its buffers tensor by tensor and an engine's
    ``update_weights`` loads ``values`` as they come, so nobody holds the full (or merged) model at once."""

    held: Sequence[tuple[str, torch.Tensor]]
    """``(name, tensor)`` standing for each relayed weight: its name, full shape and dtype (DTensor shards and a
    LoRA layer's base weight serve: their data is not read)."""
    values: Iterator[tuple[str, torch.Tensor]] | None = None
    """The relayed ``(name, full tensor)`` pairs, read once (e.g. `stream_full_state`; a collective then);
    None: ``held`` are the full values themselves."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The values (read once when ``values`` is a stream)."""
        return iter(self.held if self.values is None else self.values)


@torch.no_grad()  # (wraps each step of the generator: the caller's grad mode is left alone between yields)
def stream_full_state(named_weights: Iterable[tuple[str, torch.Tensor]],
                      bucket_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` in the names' order, gathered one bucket at a time: the full value of each
    DTensor, the tensor itself otherwise. A generator: it reads ``named_weights`` lazily (a LoRA merge can
    produce each layer's rows only when its bucket is due) and holds at most one gathered bucket, so a
    consumer that drops each tensor once it has copied it (packs it, loads it into an engine) never holds the
    whole model: the streaming half of verl's ``layered_summon`` and NeMo RL's refit buckets.

    With DTensors this is a collective: every rank of each tensor's device mesh must run the generator to
    its end over the same names in the same order (ranks whose copy nobody reads drop what it yields).
    FSDP2's parameters (``Shard(0)`` on a one-dimensional mesh) are gathered in buckets, one all-gather per
    ``bucket_bytes`` of local shards, instead of one per tensor (``DTensor.full_tensor()``, which the other
    layouts still take): a model's few hundred collectives cost more in latency than in bytes (on two CPU
    ranks, 50 tensors of the demo model took 0.1-0.15 s apart). A bucket is a run of consecutive row-sharded
    tensors on one mesh, dtype and device; any other tensor closes it. Sizes are the slots every rank agrees
    on (``ceil(rows / world)`` rows each, not a rank's own shard), so the ranks cut buckets alike. Plain
    tensors are yielded as they are (no copy), detached from autograd. ``bucket_bytes``: default
    `BUCKET_BYTES` (read when the stream starts).
    """
    from torch.distributed.tensor import DTensor

    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    run: list[tuple[str, torch.Tensor]] = []  # row-sharded tensors waiting for one all-gather
    run_key, size = None, 0
    for i, (name, t) in enumerate(named_weights):
        if isinstance(t, DTensor) and _row_sharded(t):
            key = (id(t.device_mesh), t.dtype, t.device)
            if run and key != run_key:
                yield from _flush(run)
                size = 0
            run_key = key
            run.append((name, t))
            size += -(-t.shape[0] // t.device_mesh.size()) * math.prod(t.shape[1:]) * t.element_size()
            if size >= bucket_bytes:
                yield from _flush(run)
                size = 0
            continue
        yield from _flush(run)
        size = 0
        if isinstance(t, DTensor):
            yield name, t.full_tensor()  # (a collective: every rank calls it)
        elif isinstance(t, torch.Tensor):
            yield name, t.detach()
        else:
            raise TypeError(f"weight {name!r}: expected a torch.Tensor or DTensor, got {type(t).__name__} (entry {i})")
    yield from _flush(run)


def _flush(run: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Gather ``run`` (emptied) with one all-gather and yield its full tensors, dropping each once yielded."""
    if not run:
        return
    names = [n for n, _ in run]
    full = _gather_rows([t for _, t in run])
    run.clear()
    full.reverse()
    for name in names:
        yield name, full.pop()


def gather_full_state(named_weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int | None = None,
                      keep: bool = True) -> list[tuple[str, torch.Tensor]] | None:
    """``[(name, full tensor), ...]``: `stream_full_state` kept whole, for the callers that need every tensor
    at once (checkpoints, ``save_pretrained``, tests); the relay streams instead. ``keep=False``: this rank
    takes part in the collectives and drops each bucket once gathered (None is returned), holding one bucket
    at a time (the ranks whose copy nobody reads). A collective, as `stream_full_state` is.
    """
    stream = stream_full_state(named_weights, bucket_bytes)
    if keep:
        return list(stream)
    deque(stream, maxlen=0)
    return None


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
