"""Weight relay between worker groups: the actor's weights into every rollout rank.

Colocated in one process (the embedded default), the rollout engine copies the
actor's tensors in place: no serialization. Across processes or Ray actors
the weights travel as packed buckets with a cached layout
(:class:`relayrl.weights.WeightRelay`), not one message per tensor.
"""

from __future__ import annotations

from relayrl.cluster import WorkerGroup

__all__ = ["relay_weights"]


def relay_weights(actor: WorkerGroup, rollout: WorkerGroup, *, version: int) -> None:
    """Make every rollout rank hold the actor's current weights, tagged ``version``."""
    named = actor.one("named_weights")
    rollout.all("update_weights", named, version)
