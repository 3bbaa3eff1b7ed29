"""Helpers of the streaming-relay tests (importable by spawned ranks): a policy rank that measures the bytes of
gathered (and LoRA-merged) tensors alive at once while it relays, and hands out its own shards so the driver
can build the full weights without the gather code under test."""
from __future__ import annotations

import weakref

import torch

from relayrl.workflows.rollout_worker import RolloutWorker
from relayrl.workflows.trainer_workers import PolicyWorker


class LiveBytes:
    """Bytes of the storages handed to `add` that are still alive; `peak` is the most seen at one time.
    A storage is tracked through a weak reference to its Python object, which torch keeps as long as the
    storage lives (views and ``detach()`` share it), so a tensor counts until its memory is really freed."""

    def __init__(self) -> None:
        self.refs: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    def add(self, tensors) -> None:
        self.refs = {k: (r, n) for k, (r, n) in self.refs.items() if r() is not None}
        for t in tensors:
            s = t.untyped_storage()
            self.refs[id(s)] = (weakref.ref(s), s.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))


class MeteredPolicyWorker(PolicyWorker):
    """A `PolicyWorker` whose relay gathers ``gather_bytes`` of local shards per all-gather, and whose rank
    process counts the gathered tensors (and merged LoRA rows) alive at once, for every gather from now on (the
    rank is a process of its own: its module functions are wrapped for good)."""

    def __init__(self, *args, gather_bytes: int, **kwargs) -> None:
        from relayrl.models import lora
        from relayrl.weights import gather

        gather.BUCKET_BYTES = gather_bytes
        super().__init__(*args, **kwargs)
        self.gathered, self.merged = LiveBytes(), LiveBytes()
        gather_rows, merged_rows = gather._gather_rows, getattr(lora, "_merged_rows", None)

        def metered_gather(tensors):
            out = gather_rows(tensors)
            self.gathered.add(out)
            return out

        def metered_merge(*a):
            out = merged_rows(*a)
            self.merged.add([out.to_local()])
            return out

        gather._gather_rows = metered_gather
        if merged_rows is not None:
            lora._merged_rows = metered_merge

    def peaks(self) -> tuple[int, int]:
        """(gathered, merged-row) peak bytes of the relays so far."""
        return self.gathered.peak, self.merged.peak

    def shards(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """This rank's rows of every relayed weight and whether they are a shard (else the whole tensor), by
        name; LoRA: of the base weights."""
        from torch.distributed.tensor import DTensor

        from relayrl.models import lora

        named = self.engine.named_weights() if self.peft_model is None else lora.base_weights(self.engine.model)
        return {n: (_local(t).clone(), isinstance(t, DTensor)) for n, t in named}

    def adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """LoRA: per adapted layer, this rank's rows of ``A`` and of ``B``, and the scale."""
        from peft.tuners.lora import LoraLayer

        return {prefix: (_local(m.lora_A["default"].weight).clone(), _local(m.lora_B["default"].weight).clone(),
                         float(m.scaling["default"]))
                for prefix, m in self.engine.model.named_modules() if isinstance(m, LoraLayer)}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach()


class ProbeRolloutWorker(RolloutWorker):
    """A rollout rank that shows its engine's weights and version."""

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}

    def version(self) -> int:
        return self.engine.weight_version
