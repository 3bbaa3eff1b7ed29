"""WeightRelay between two threads, as the off-policy trainer uses it: one packs while the other applies,
neither waits for the other's packing, and the host slots stay apart. In-process stand-ins for the worker
groups (a sender that packs into the relay's shared memory as an actor's rank 0 does, and a receiving group
that records what it was sent)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from relayrl.weights import WeightRelay, pack
from relayrl.weights.shm import open_shared, pack_into_shared, shm_available
from relayrl.workflows.ahead import RolloutAhead
from weights_workers import tiny_model

pytestmark = pytest.mark.skipif(not shm_available(1 << 20), reason="needs /dev/shm")


class Sender:
    """An actor group's rank 0, in process: packs its weights into the relay's host slot; a pack can be
    held inside the pack (``hold``) until ``go`` is set."""

    backend, in_driver, world_size = "local", False, 2

    def __init__(self):
        self.model, self.cache = tiny_model(seed=0), {}
        self.hold, self.inside, self.go = False, threading.Event(), threading.Event()

    def all_rank0(self, method, handles, key, bucket_bytes):
        assert getattr(method, "__name__", method) == "pack_weights_into"  # PolicyWorker.pack_weights_into or its name
        if handles is not None and self.hold:
            self.inside.set()
            assert self.go.wait(10), "the test never let the pack finish"
        named = [(n, p.detach()) for n, p in self.model.named_parameters()]
        return pack_into_shared(named, handles, key, bucket_bytes, self.cache)

    def all(self, *a, **k):
        raise AssertionError("the pack is a collective rank 0 answers: all_rank0")

    def one(self, *a, **k):
        raise AssertionError("not used")


class Receivers:
    """A rollout group of two local ranks: records each payload's version and bytes."""

    backend, in_driver, world_size = "local", False, 2

    def __init__(self):
        self.got, self.cache = [], {}

    def all(self, method, payload):
        data = b"".join(open_shared(h, self.cache).tobytes() for h in payload.buffers)
        self.got.append((payload.version, [h.path for h in payload.buffers], data))
        return [{"status": "ok"}] * 2

    def one(self, method, payload, rank):
        return {"status": "ok"}


def _bytes_of(relay, model) -> bytes:
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    layout = relay.layout_for(named)
    out = [torch.empty(b.numel, dtype=b.dtype) for b in layout.buckets]
    return b"".join(np.asarray(t.view(torch.uint8)).tobytes() for t in pack(named, layout, out=out))


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    return t, box


def test_an_apply_runs_while_a_stage_is_packing_and_the_slots_stay_apart():
    sender, group = Sender(), Receivers()
    relay = WeightRelay(bucket_mb=0.02)
    try:
        v1 = relay.pack_from_group(sender, "pack_weights_into", version=1)
        one = _bytes_of(relay, sender.model)
        with torch.no_grad():
            for p in sender.model.parameters():
                p.add_(1.0)  # the trainer's next version
        sender.hold = True
        packer, packed = _in_thread(lambda: relay.pack_from_group(sender, "pack_weights_into", version=2))
        assert sender.inside.wait(10)
        applier, _ = _in_thread(lambda: relay.apply_to_group(v1, group))
        applier.join(10)
        assert not applier.is_alive(), "the apply waited for the other thread's pack"
        assert [g[0] for g in group.got] == [1] and group.got[0][2] == one
        sender.go.set()
        packer.join(10)
        v2 = packed["out"]
        assert not set(h.path for h in relay._live[v2.ticket].handles) & set(group.got[0][1])  # its own slot
        relay.apply_to_group(v2, group)
        assert group.got[1][0] == 2 and group.got[1][2] == _bytes_of(relay, sender.model) != one
        assert len(relay._free_shm) == 2 and not relay._live  # both slots serve the next packs
    finally:
        sender.go.set()
        relay.close()


def test_a_failed_pack_gives_its_slot_back():
    class Failing(Sender):
        def all_rank0(self, method, handles, key, bucket_bytes):
            if handles is not None:
                raise RuntimeError("rank 0 died")
            return super().all_rank0(method, handles, key, bucket_bytes)

    relay = WeightRelay(bucket_mb=0.02)
    try:
        with pytest.raises(RuntimeError, match="rank 0 died"):
            relay.pack_from_group(Failing(), "pack_weights_into", version=1)
        assert len(relay._free_shm) == 1 and not relay._live  # reserved, then given back for the next pack
        packed = relay.pack_from_group(Sender(), "pack_weights_into", version=1)
        assert not relay._free_shm and list(relay._live) == [packed.ticket]
    finally:
        relay.close()


def test_the_rollout_thread_applies_while_the_trainer_packs():
    """RolloutAhead: the trainer's pack of version 2, held inside its pack, does not hold up the rollout
    thread's apply of version 1 (it did while one lock covered both)."""
    sender, group = Sender(), Receivers()
    ahead = RolloutAhead(1, range(1, 1), open_flow=None, produce=None, batch_start=None,
                         relay=WeightRelay(bucket_mb=0.02), rollout=group, partial=True)
    try:
        ahead.pack_weights(1, sender)
        sender.hold = True
        packer, _ = _in_thread(lambda: ahead.pack_weights(2, sender))
        assert sender.inside.wait(10)
        with ahead.engine:
            applier, _ = _in_thread(ahead.apply_packed)
            applier.join(10)
        assert not applier.is_alive(), "the rollout's apply waited for the trainer's pack"
        assert ahead.rollout_version == 1 and [g[0] for g in group.got] == [1]
        sender.go.set()
        packer.join(10)
        assert ahead.trained == 2
        ahead.apply_packed()
        assert ahead.rollout_version == 2 and [g[0] for g in group.got] == [1, 2]
    finally:
        sender.go.set()
        ahead.stop()
        ahead.relay.close()
