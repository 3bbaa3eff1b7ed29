"""Helpers of the weight-relay tests: a tiny Qwen2, a stand-in tokenizer, a rollout worker
(importable by spawned ranks and Ray actors)."""
from __future__ import annotations

import torch

from relayrl.cluster import Worker
from relayrl.weights import WeightReceiverMixin, gather_full_state

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


class StubTokenizer:
    """What NativeGenerationEngine reads from a tokenizer."""

    eos_token_id = 1
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def tiny_model(seed: int, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides})).eval()


def tiny_engine(seed: int, **overrides):
    from relayrl.engines.generation.native import NativeGenerationEngine

    return NativeGenerationEngine(tiny_model(seed, **overrides), StubTokenizer())


class RolloutWorker(WeightReceiverMixin, Worker):
    """A rank holding a generation engine; records whether each payload carried the layout."""

    def __init__(self, seed: int = 100) -> None:
        self.engine = tiny_engine(seed + self.rank)
        self.layout_flags: list[bool] = []

    def receive_weights(self, payload):
        self.layout_flags.append(payload.layout is not None)
        return super().receive_weights(payload)

    def flags(self) -> list[bool]:
        return list(self.layout_flags)

    def weights(self) -> dict:
        return {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}

    def version(self) -> int:
        return self.engine.weight_version

    def forget_layouts(self) -> None:
        """Act like a restarted rank: drop the cached layouts."""
        self.__dict__.pop("_relay_layout_cache", None)

    def gather_sharded(self, full: torch.Tensor) -> tuple[bool, bool]:
        """Shard ``full`` over the group's ranks as a DTensor, gather it back; (was DTensor, equal)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        d = distribute_tensor(full, mesh, [Shard(0)])
        (_, out), = gather_full_state([("w", d)])
        return isinstance(d, DTensor) and d.to_local().shape[0] < full.shape[0], bool(torch.equal(out, full))

    def gather_many(self, fulls: dict, bucket_bytes: int, rank0_only: bool = False) -> dict[str, bool] | None:
        """Shard each of ``fulls`` by rows (a name ending in ``.replicated``: replicated; ``.plain``: a plain
        tensor), gather them in one call: name -> equal to the original (dtype and shape included).
        ``rank0_only``: the other ranks gather without keeping (``keep=False``) and return what they got."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        named = [(n, t if n.endswith(".plain") else
                  distribute_tensor(t, mesh, [Replicate() if n.endswith(".replicated") else Shard(0)]))
                 for n, t in fulls.items()]
        got = gather_full_state(named, bucket_bytes=bucket_bytes, keep=not rank0_only or self.rank == 0)
        if got is None:
            return None
        assert [n for n, _ in got] == list(fulls)
        return {n: t.dtype == fulls[n].dtype and torch.equal(t, fulls[n]) for n, t in got}


class ShardedSender(Worker):
    """A trainer rank whose weights are row-sharded DTensors over the group (as FSDP2's), packing them for a
    relay that skips the driver; counts its pack calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.set_seed(0)

    def set_seed(self, seed: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (self.world_size,))
        self.named = [(n, distribute_tensor(p.detach(), mesh, [Shard(0)]))
                      for n, p in tiny_model(seed).named_parameters()]

    def pack_weights_into(self, handles, key, bucket_bytes):
        from relayrl.weights.shm import pack_into_shared

        self.calls += 1
        full = gather_full_state(self.named)
        if self.rank != 0:
            return None
        return pack_into_shared(full, handles, key, bucket_bytes, self.__dict__.setdefault("_shm", {}))

    def pack_calls(self) -> int:
        return self.calls
