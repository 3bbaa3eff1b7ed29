"""Weight relay between worker groups: the actor's weights into every rollout rank.

Colocated in one process (the embedded default), the rollout engine copies the
actor's tensors in place: no serialization, no packing. Across processes or
Ray actors the weights travel as packed buckets with a cached layout
(:class:`relayrl.weights.WeightRelay`, NeMo RL's refit), one message per rank
instead of one per tensor. Between two multi-process groups on this machine,
the actor's rank 0 packs them straight into the relay's shared-memory buckets
and only the handles pass through the driver (``WeightRelay.push_from_group``).
Everywhere the weights stream: under FSDP2 they are gathered a bucket at a
time and each bucket is packed (or loaded) before the next is gathered, and a
LoRA layer is merged only when its turn comes, so no rank holds the full
gathered or merged model (``PolicyWorker.weight_stream``).
"""

from __future__ import annotations

from relayrl.cluster import WorkerGroup
from relayrl.weights import WeightRelay
from relayrl.workflows.rollout_worker import RolloutWorker
from relayrl.workflows.trainer_workers import PolicyWorker

__all__ = ["relay_weights"]


def relay_weights(actor: WorkerGroup, rollout: WorkerGroup, *, version: int, relay: WeightRelay | None = None,
                  named: list | None = None) -> dict[str, float]:
    """Make every rollout rank hold the actor's current weights (or ``named``, host copies staged earlier),
    tagged ``version``; returns relay metrics."""
    relay = relay or WeightRelay()
    if named is None and not actor.in_driver:  # actor rank 0 packs into the relay's shared memory: the
        metrics = relay.push_from_group(actor, PolicyWorker.pack_weights_into, rollout,
                                       RolloutWorker.receive_weights, version=version)
        if metrics is not None:  # weights skip the driver (None: the groups cannot share host memory)
            return {k: float(v) for k, v in metrics.items()}
    if named is None and actor.in_driver:  # one unsharded rank here: its weights as a stream (LoRA: merged
        named = actor.one(PolicyWorker.weight_stream)  # a layer at a time as they are loaded or packed)
    elif named is None:  # every actor rank takes part (FSDP2 gathers a bucket at a time); rank 0 holds host copies
        named = actor.all_rank0(PolicyWorker.relayed_weights)
    if actor.in_driver and rollout.in_driver:  # the engine loads each tensor as it comes
        nbytes = sum(t.numel() * t.element_size() for _, t in getattr(named, "held", named))
        copied = rollout.all(RolloutWorker.update_weights, named, version)  # (one bool per rank)
        return {"relay/bytes": float(nbytes)} if any(copied) else {}  # (none: it runs on the actor's tensors)
    metrics = relay.push_to_group(named, rollout, RolloutWorker.receive_weights, version=version)
    return {k: float(v) for k, v in metrics.items()}
