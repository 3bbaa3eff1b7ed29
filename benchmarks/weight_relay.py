"""Refit time: one message per parameter vs packed buckets with a cached layout (NeMo RL's refit).

Workload: synthetic weights with the shapes of a Qwen2-style decoder (24
layers, hidden 576, 9 query / 3 KV heads, FFN 1536, vocab 32000, tied head):
~103M fp32 parameters in ~290 tensors (``--scale`` shrinks hidden/FFN/vocab).
Each refit bumps every tensor's values, then delivers all of them to the
receivers, which copy them into their own preallocated tensors:

* ``per-tensor``: one call per parameter, ``update_weights([(name, t)])``
  in process, or ``group.all(SinkWorker.receive_one, name, array, version)`` to a
  worker group (the tensor as numpy, the fast serialisation path);
* ``packed``: ``WeightRelay.push`` / ``push_to_group`` (buckets of
  ``--bucket-mb``, layout sent on the first refit only, then the key);
  to local ranks the buckets go as ``/dev/shm`` handles (the ``(pickle)``
  row sends the packed bytes over the pipes instead).

Targets: in process; a 2-rank local worker group (spawned processes, pipes);
with ``--ray`` also a 2-rank Ray group.

From a sharded trainer: the weights row-sharded over a 2-rank sender group (FSDP2's layout, DTensors over
gloo) to a 2-rank receiver group, four ways in one run: each tensor gathered by its own collective
(``DTensor.full_tensor``, relayrl before 2026-11-27) and the full state sent to the driver, which packs and
pushes it; the same with the gather in flat buckets (``gather_full_state``); and the sender's rank 0 packing
straight into the relay's shared memory, only handles passing the driver (``WeightRelay.push_from_group``),
after gathering the whole model (relayrl before 2026-11-28) or streaming it, each bucket packed before the
next is gathered (``stream_full_state`` into ``pack_into_shared(values=...)``: what ``cluster.devices=N``
runs now; rank 0 holds one bucket, not the model). The first refit of each kind is a
warm-up (not timed); the median of ``--repeats`` refits is reported.
Figures are printed, not asserted. Run:
``.venv/bin/python benchmarks/weight_relay.py [--repeats 3] [--scale 1.0] [--ray] [--sharded-only]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import numpy as np
import torch

from relayrl.cluster import ClusterConfig, ResourcePool, Worker, WorkerGroup
from relayrl.weights import WeightReceiverMixin, WeightRelay


def qwen2_like_shapes(scale: float = 1.0, layers: int = 24) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Qwen2-architecture decoder with a tied output head."""
    head_dim = 64
    q_heads = max(1, round(9 * scale))
    h, kv = q_heads * head_dim, max(1, q_heads // 3) * head_dim
    f, vocab = int(1536 * scale) // 8 * 8, int(32000 * scale) // 64 * 64
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
        ]
    return shapes + [("model.norm.weight", (h,))]


class Sink:
    """A receiver holding preallocated tensors, copying pushed weights in place (as a generation engine does)."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        self.tensors = {n: torch.zeros(s) for n, s in shapes}
        self.weight_version = 0

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self.tensors.items()}

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int) -> None:
        for name, t in named_tensors:
            self.tensors[name].copy_(t)
        self.weight_version = version

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.tensors.values()))


class SinkWorker(WeightReceiverMixin, Worker):
    def __init__(self, shapes) -> None:
        self.engine = Sink(shapes)

    def receive_one(self, name: str, array: np.ndarray, version: int) -> None:
        with warnings.catch_warnings():  # Ray hands back read-only arrays; they are only read
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(array)
        self.engine.update_weights([(name, t)], version)

    def checksum(self) -> float:
        return self.engine.checksum()


class ShardedSource(Worker):
    """A sender rank holding ``shapes`` as row-sharded DTensors over its group (FSDP2's layout)."""

    def __init__(self, shapes) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (self.world_size,))
        g = torch.Generator().manual_seed(0)
        self.named = [(n, distribute_tensor(torch.randn(s, generator=g), mesh, [Shard(0)])) for n, s in shapes]

    def bump(self) -> None:
        with torch.no_grad():
            for _, t in self.named:
                t.to_local().add_(1.0)

    def full_state(self, per_tensor: bool):
        from relayrl.weights import gather_full_state

        full = [(n, t.full_tensor()) for n, t in self.named] if per_tensor else gather_full_state(self.named)
        return full if self.rank == 0 else None

    def pack_weights_into(self, handles, key, bucket_bytes):
        from relayrl.weights.shm import pack_into_shared

        full = self.full_state(False)
        return None if full is None else pack_into_shared(full, handles, key, bucket_bytes, self.__dict__.setdefault("_shm", {}))

    def pack_streamed_into(self, handles, key, bucket_bytes):
        from relayrl.weights import stream_full_state
        from relayrl.weights.shm import pack_into_shared

        res = pack_into_shared(self.named, handles, key, bucket_bytes, self.__dict__.setdefault("_shm", {}),
                               values=stream_full_state(self.named), write=self.rank == 0)
        return res if self.rank == 0 else None

    def checksum(self) -> float:
        return float(sum(t.full_tensor().double().sum() for _, t in self.named))


def bench_sharded(shapes, repeats: int, bucket_mb: float) -> dict[str, float]:
    """Median refit seconds from a 2-rank sharded sender to 2 receivers, by the four ways (module docstring),
    the ways interleaved refit by refit so that each sees the same machine load."""
    ways = ("per-tensor gather, via driver", "bucketed gather, via driver", "rank 0 to shared memory",
            "rank 0 streams to shared memory")
    times: dict[str, list[float]] = {w: [] for w in ways}
    with WorkerGroup(ShardedSource, ResourcePool("relay-bench-src", devices=2), name="sharded-src", distributed=True,
                     init_kwargs={"shapes": shapes}) as src, \
            WorkerGroup(SinkWorker, ResourcePool("relay-bench-dst", devices=2), name="sharded-dst", distributed=False,
                        init_kwargs={"shapes": shapes}) as dst:
        relays = {w: WeightRelay(bucket_mb=bucket_mb) for w in ways}
        version = 0
        for rep in range(repeats + 1):  # the first round is a warm-up
            for w in ways:
                src.all(ShardedSource.bump)
                version += 1
                t0 = time.perf_counter()
                if w in ways[2:]:
                    method = ShardedSource.pack_weights_into if w == ways[2] else ShardedSource.pack_streamed_into
                    relays[w].push_from_group(src, method, dst, version=version)
                else:
                    full = src.all(ShardedSource.full_state, w == ways[0])[0]  # every rank gathers; rank 0 holds
                    relays[w].push_to_group(full, dst, version=version)
                if rep:
                    times[w].append(time.perf_counter() - t0)
                want = src.all(ShardedSource.checksum)[0]  # every rank gathers; the same sum on each
                assert all(abs(c - want) < 1e-6 * abs(want) + 1e-3 for c in dst.all(SinkWorker.checksum)), w
        for r in relays.values():
            r.close()
    return {w: statistics.median(t) for w, t in times.items()}


def bump(named: list[tuple[str, torch.Tensor]]) -> None:
    for _, t in named:
        t.add_(1.0)


def time_refits(refit, named, repeats: int) -> float:
    bump(named)
    refit(0)  # warm-up: buffers, layout
    times = []
    for v in range(1, repeats + 1):
        bump(named)
        t0 = time.perf_counter()
        refit(v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_in_process(named, shapes, repeats: int, bucket_mb: float) -> tuple[float, float]:
    sink = Sink(shapes)

    def per_tensor(v: int) -> None:
        for name, t in named:
            sink.update_weights([(name, t)], v)

    relay = WeightRelay(bucket_mb=bucket_mb)
    a = time_refits(per_tensor, named, repeats)
    sink = Sink(shapes)
    b = time_refits(lambda v: relay.push(named, [sink], version=10 + v), named, repeats)
    assert abs(sink.checksum() - sum(float(t.double().sum()) for _, t in named)) < 1e-3 * sink.checksum() + 1
    return a, b


def bench_group(named, shapes, repeats: int, bucket_mb: float, backend: str,
                transport: str = "auto") -> tuple[float, float]:
    cfg = ClusterConfig(backend=backend, num_cpus=2 if backend == "ray" else None)
    pool = ResourcePool(f"relay-bench-{backend}", devices=2)
    with WorkerGroup(SinkWorker, pool, name=f"sinks-{backend}", backend=cfg, distributed=False,
                     init_kwargs={"shapes": shapes}) as group:
        def per_tensor(v: int) -> None:
            for name, t in named:
                group.all(SinkWorker.receive_one, name, t.numpy(), v)

        relay = WeightRelay(bucket_mb=bucket_mb, transport=transport)
        a = time_refits(per_tensor, named, repeats)
        b = time_refits(lambda v: relay.push_to_group(named, group, version=10 + v), named, repeats)
        want = sum(float(t.double().sum()) for _, t in named)
        assert all(abs(c - want) < 1e-3 * abs(want) + 1 for c in group.all(SinkWorker.checksum))
        relay.close()
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="width multiplier of the synthetic model")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--ray", action="store_true", help="also time a 2-rank Ray group")
    ap.add_argument("--sharded-only", action="store_true", help="only the sharded sender's rows")
    args = ap.parse_args()
    torch.set_num_threads(1)  # 2 intra-op threads on 2 shared cores made every copy ~20x slower here
    shapes = qwen2_like_shapes(args.scale)
    g = torch.Generator().manual_seed(0)
    named = [(n, torch.randn(s, generator=g)) for n, s in shapes]
    params = sum(t.numel() for _, t in named)
    print(f"weights: {len(named)} tensors, {params / 1e6:.1f}M fp32 parameters ({params * 4 / 2**20:.0f} MiB), "
          f"buckets of {args.bucket_mb:g} MiB; median of {args.repeats} refits after one warm-up")
    if args.sharded_only:
        return print_sharded(bench_sharded(shapes, args.repeats, args.bucket_mb))
    rows = [("in-process", *bench_in_process(named, shapes, args.repeats, args.bucket_mb))]
    rows.append(("local group x2", *bench_group(named, shapes, args.repeats, args.bucket_mb, "local")))
    rows.append(("  (pickle)", *bench_group(named, shapes, args.repeats, args.bucket_mb, "local", "pickle")))
    if args.ray:
        rows.append(("ray group x2", *bench_group(named, shapes, args.repeats, args.bucket_mb, "ray")))
    print(f"{'target':<16}{'per-tensor s':>14}{'packed s':>11}{'speedup':>9}   (load average {os.getloadavg()[0]:.1f})")
    for name, a, b in rows:
        print(f"{name:<16}{a:>14.3f}{b:>11.3f}{a / b:>9.2f}")
    sharded = bench_sharded(shapes, args.repeats, args.bucket_mb)
    print_sharded(sharded)
    s, p = rows[0][1] / rows[0][2], rows[1][1] / rows[1][2]
    d = next(iter(sharded.values())) / list(sharded.values())[-1]
    print(f"weight_relay: packed/per-tensor speedup {s:.2f} (in-process), {p:.2f} (worker group); "
          f"sharded sender: streamed to shared memory from rank 0 {d:.2f}x the per-tensor gather via the driver")


def print_sharded(sharded: dict[str, float]) -> None:
    print("from a 2-rank sharded sender to 2 ranks:")
    first = next(iter(sharded.values()))
    for w, t in sharded.items():
        print(f"  {w:<32}{t:>8.3f} s{first / t:>7.2f}x")
    whole, streamed = sharded["rank 0 to shared memory"], sharded["rank 0 streams to shared memory"]
    print(f"weight_relay: streamed / whole-model gather into shared memory: {streamed / whole:.2f}x the time")


if __name__ == "__main__":
    main()
