"""The reference model's updates (``trainer.ref_sync_every``): after every N-th step the reference moves toward
the policy, ``reference <- alpha x policy + (1 - alpha) x reference``.

TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment") updates DPO's reference
this way (soft, ``alpha`` < 1) and TRL's ``sync_ref_model`` does it for DPO and GRPO; ProRL (Liu et al. 2025,
NVIDIA, "Prolonged Reinforcement Learning") resets the reference to the policy (``alpha = 1``) when the KL term
starts to dominate a long run. The reference is a worker group of its own (its ranks gather the actor's full
weights and mix them in) or, with ``trainer.tri_model``, the actor's own copy. Its weights are then state: every
checkpoint holds them (``extra["reference"]``) and a resumed run loads them.
"""

from __future__ import annotations

import time
from typing import Any

from relayrl.cluster import WorkerGroup
from relayrl.workflows.trainer_workers import PolicyWorker, ReferenceWorker

__all__ = ["ReferenceSync"]


class ReferenceSync:
    """``after_step`` mixes the policy into the reference every ``every`` steps; ``state``/``load`` carry the
    reference's weights through checkpoints. ``reference=None``: the actor's tri-model copy."""

    def __init__(self, every: int, alpha: float, actor: WorkerGroup, reference: WorkerGroup | None,
                 phases: Any = None) -> None:
        self.every, self.alpha, self.actor, self.reference, self.phases = every, alpha, actor, reference, phases

    def after_step(self, step: int) -> dict[str, float]:
        """After step ``step``: a sync when it is due (``reference/synced`` 1 and ``timing/ref_sync_s``)."""
        if not self.every or step % self.every:
            return {}
        t0 = time.perf_counter()
        if self.reference is None:  # the actor's own copy, in its layout
            self.actor.all(PolicyWorker.mix_reference, self.alpha)
        else:
            named = self.actor.all_rank0(PolicyWorker.named_weights)  # (every rank gathers; rank 0 holds them)
            if self.phases is not None:
                self.phases.wake(self.reference)  # (trainer.offload: its weights back on the device to mix)
            self.reference.all(ReferenceWorker.mix_weights, named, self.alpha)
            if self.phases is not None:
                self.phases.idle(self.reference)
        return {"reference/synced": 1.0, "timing/ref_sync_s": time.perf_counter() - t0}

    def state(self) -> dict | None:
        """The reference's weights for a checkpoint (None when it never moves)."""
        if not self.every:
            return None
        if self.reference is None:
            return self.actor.all_rank0(PolicyWorker.reference_state)
        return self.reference.all_rank0(ReferenceWorker.state)

    def load(self, state: dict | None) -> None:
        """The reference where a checkpoint left it (``state`` None: a checkpoint without one, saved by a run
        whose reference never moved: it is the starting model, as loaded)."""
        if not self.every or state is None:
            return
        if self.reference is None:
            self.actor.all(PolicyWorker.load_reference_state, state)
        else:
            self.reference.all(ReferenceWorker.load_state, state)
