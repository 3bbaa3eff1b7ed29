"""relayrl.weights: the resharding flow, trainer weights -> generation engines.

NeMo RL's refit (tensor packing into a few flat buckets, per-receiver
messages, minimal metadata with cached layouts), AsyncFlow's and NeMo RL's delayed
parameter update (pack into host memory, apply between generations) and MindSpeed
RL's swap of training state to host memory. Modules:

| module     | what                                                                  |
|------------|-----------------------------------------------------------------------|
| `layout`   | `BucketLayout`: (name, shape, dtype, offset, numel) per bucket + key  |
| `packing`  | `pack` / `pack_stream` / `unpack` / `to_wire` / `from_wire`           |
| `relay`    | `WeightRelay` (push, push_to_group, pack, apply), `PackedWeights`     |
| `receive`  | `receive_buckets`, `WeightReceiverMixin`, mismatch/version errors     |
| `gather`   | `stream_full_state` (FSDP2 a bucket at a time), `WeightStream`, `gather_full_state` |
| `offload`  | `offload_optimizer` / `reload_optimizer`                              |
"""
from relayrl.weights.gather import WeightStream, gather_full_state, stream_full_state
from relayrl.weights.layout import DEFAULT_BUCKET_MB, Bucket, BucketLayout, TensorSlot, build_layout
from relayrl.weights.offload import is_offloaded, offload_optimizer, reload_optimizer
from relayrl.weights.packing import allocate_buffers, from_wire, pack, pack_stream, to_wire, unpack
from relayrl.weights.receive import (
    BucketPayload,
    LayoutMismatchError,
    StaleVersionError,
    WeightReceiverMixin,
    check_receiver,
    receive_buckets,
)
from relayrl.weights.relay import PackedWeights, WeightRelay

__all__ = [
    "DEFAULT_BUCKET_MB",
    "Bucket",
    "BucketLayout",
    "BucketPayload",
    "LayoutMismatchError",
    "PackedWeights",
    "StaleVersionError",
    "TensorSlot",
    "WeightReceiverMixin",
    "WeightRelay",
    "WeightStream",
    "allocate_buffers",
    "build_layout",
    "check_receiver",
    "from_wire",
    "gather_full_state",
    "is_offloaded",
    "offload_optimizer",
    "pack",
    "pack_stream",
    "receive_buckets",
    "reload_optimizer",
    "stream_full_state",
    "to_wire",
    "unpack",
]
