"""WeightRelay in process: tiny Qwen2 trainer -> NativeGenerationEngine, caching, packing for later, errors."""
import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerError, WorkerGroup
from relayrl.weights import (
    BucketPayload,
    LayoutMismatchError,
    StaleVersionError,
    WeightReceiverMixin,
    WeightRelay,
    build_layout,
    gather_full_state,
    pack,
    receive_buckets,
    to_wire,
)
from weights_workers import RolloutWorker, tiny_engine, tiny_model


def params(module):
    return {n: p.detach() for n, p in module.named_parameters()}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.fixture
def trainer():
    return tiny_model(seed=0)


def named(model):
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_push_makes_engines_equal_to_the_trainer(trainer):
    engines = [tiny_engine(seed=1), tiny_engine(seed=2)]
    assert not torch.equal(engines[0].model.model.embed_tokens.weight, trainer.model.embed_tokens.weight)
    relay = WeightRelay(bucket_mb=0.01)
    m = relay.push(named(trainer), engines, version=1)
    for e in engines:
        assert_same(params(e.model), params(trainer))
        assert e.weight_version == 1
    assert m["relay/bytes"] == sum(p.numel() * 4 for p in trainer.parameters())
    assert m["relay/buckets"] > 1 and m["relay/receivers"] == 2 and m["relay/tensors"] == len(named(trainer))
    assert 0 <= m["relay/pack_s"] <= m["relay/time_s"]
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(engines[0].model(ids).logits, trainer(ids).logits)


def test_second_push_reuses_layout_and_buffers(trainer):
    engine = tiny_engine(seed=1)
    relay = WeightRelay()
    relay.push(named(trainer), [engine], version=1)
    layout = relay.layout_for(named(trainer))
    ptrs = [b.data_ptr() for b in relay.buffers(layout, "cpu")]
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1.0)
    relay.push(named(trainer), [engine], version=2)
    assert relay.layout_for(named(trainer)) is layout
    assert [b.data_ptr() for b in relay.buffers(layout, "cpu")] == ptrs
    assert_same(params(engine.model), params(trainer))


def test_generation_follows_the_relayed_weights(trainer):
    from relayrl.engines.generation.base import SamplingParams

    engine, reference = tiny_engine(seed=1), tiny_engine(seed=0)  # seed 0 == the trainer's init
    WeightRelay().push(named(trainer), [engine], version=3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    got, want = engine.generate([[2, 3, 4]], sp), reference.generate([[2, 3, 4]], sp)
    assert torch.equal(got[0].token_ids, want[0].token_ids)


def test_shape_mismatch_names_the_tensor_and_both_shapes_and_copies_nothing(trainer):
    engine = tiny_engine(seed=1, intermediate_size=48)
    before = {n: t.clone() for n, t in params(engine.model).items()}
    with pytest.raises(LayoutMismatchError, match=r"'model.layers.0.mlp.gate_proj.weight': layout shape \(64, 32\) "
                                                   r"!= receivers\[0\] shape \(48, 32\)"):
        WeightRelay().push(named(trainer), [engine], version=1)
    assert_same(params(engine.model), before)
    assert engine.weight_version == 0


def test_missing_name_is_reported(trainer):
    engine = tiny_engine(seed=1)
    extra = named(trainer) + [("model.extra.weight", torch.zeros(2, 3))]
    with pytest.raises(LayoutMismatchError, match=r"'model.extra.weight': layout shape \(2, 3\), receivers\[0\] has no"):
        WeightRelay().push(extra, [engine], version=1)


def test_lower_version_is_refused(trainer):
    engine = tiny_engine(seed=1)
    relay = WeightRelay()
    relay.push(named(trainer), [engine], version=5)
    relay.push(named(trainer), [engine], version=5)  # same version again is fine
    with pytest.raises(StaleVersionError, match="holds weight version 5; refusing to go back to version 4"):
        relay.push(named(trainer), [engine], version=4)
    assert engine.weight_version == 5


def test_stage_then_apply_loads_the_staged_version_only(trainer):
    engine = tiny_engine(seed=1)
    relay = WeightRelay()
    packed = relay.pack(named(trainer), version=1)
    snapshot = {n: t.clone() for n, t in params(trainer).items()}
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(2.0)  # the trainer moves on while the packed copy waits
    assert all(b.device.type == "cpu" for b in packed.buffers) and packed.nbytes == relay.layout_for(named(trainer)).nbytes
    m = relay.apply(packed, [engine])
    assert_same(params(engine.model), snapshot)
    assert engine.weight_version == 1 and m["relay/receivers"] == 1
    with pytest.raises(RuntimeError, match="already applied and released"):
        relay.apply(packed, [engine])
    again = relay.pack(named(trainer), version=2)
    assert [b.data_ptr() for b in again.buffers] == [b.data_ptr() for b in packed.buffers]  # slot reused
    pending = relay.pack(named(trainer), version=3)
    assert pending.buffers[0].data_ptr() != again.buffers[0].data_ptr()  # an unapplied version keeps its slot
    relay.apply(again, [engine])
    assert_same(params(engine.model), params(trainer))


def test_receive_buckets_asks_for_an_unknown_layout_once(trainer):
    engine = tiny_engine(seed=1)
    nw = named(trainer)
    layout = build_layout(nw)
    wire = [to_wire(b) for b in pack(nw, layout)]
    cache: dict = {}
    assert receive_buckets(engine, wire, layout.key, 1, cache) == {"status": "need_layout", "key": layout.key}
    assert engine.weight_version == 0
    assert receive_buckets(engine, wire, layout, 1, cache)["status"] == "ok"
    assert receive_buckets(engine, wire, layout.key, 2, cache)["status"] == "ok"
    assert engine.weight_version == 2
    assert_same(params(engine.model), params(trainer))
    with pytest.raises(StaleVersionError):
        receive_buckets(engine, wire, layout.key, 1, cache)


def test_group_push_sends_the_layout_once_and_again_to_a_rank_that_lost_it(trainer):
    pool = ResourcePool("relay-inproc", devices=1)
    with WorkerGroup(RolloutWorker, pool, name="rollout", distributed=False) as group:
        relay = WeightRelay(bucket_mb=0.01)
        m1 = relay.push_to_group(named(trainer), group, version=1)
        m2 = relay.push_to_group(named(trainer), group, version=2)
        assert (m1["relay/layout_sent"], m2["relay/layout_sent"]) == (1.0, 0.0)
        assert group.one("flags") == [True, False]
        group.one("forget_layouts")
        m3 = relay.push_to_group(named(trainer), group, version=3)
        assert m3["relay/layout_sent"] == 1.0 and group.one("flags") == [True, False, False, True]
        assert_same(group.one("weights"), params(trainer)) and group.one("version") == 3
        with pytest.raises(StaleVersionError):
            relay.push_to_group(named(trainer), group, version=2)
        packed = relay.pack(named(trainer), version=4)
        relay.apply_to_group(packed, group)
        assert group.one("version") == 4


def test_group_rank_rejects_a_mismatched_layout():
    pool = ResourcePool("relay-inproc-bad", devices=1)
    with WorkerGroup(RolloutWorker, pool, name="rollout-bad", distributed=False) as group:
        other = tiny_model(seed=0, hidden_size=16)
        with pytest.raises(WorkerError, match=r"layout shape \(64, 16\) != receiver shape \(64, 32\)"):
            WeightRelay().push_to_group(named(other), group, version=1)


def test_gather_full_state_is_a_no_op_for_plain_tensors(trainer):
    nw = named(trainer)
    out = gather_full_state(iter(nw))
    assert [n for n, _ in out] == [n for n, _ in nw]
    assert all(a.data_ptr() == b.data_ptr() for (_, a), (_, b) in zip(out, nw))
    with pytest.raises(TypeError, match="weight 'x': expected a torch.Tensor"):
        gather_full_state([("x", 1.0)])


def test_bad_arguments_are_rejected_by_name(trainer):
    with pytest.raises(ValueError, match="bucket_mb=-1"):
        WeightRelay(bucket_mb=-1)
    with pytest.raises(TypeError, match=r"receivers\[0\] \(object\) has no update_weights"):
        WeightRelay().push(named(trainer), [object()], version=1)
    with pytest.raises(TypeError, match="must be a BucketPayload"):
        WeightReceiverMixin.receive_weights(object(), {"key": "x"})
    assert BucketPayload("k", 1, ()).layout is None


def test_bucket_files_of_dead_senders_are_swept(tmp_path):
    """A sender killed outright leaves its /dev/shm files; the next sender removes them: at once when the sender
    was of this pid namespace, after an hour untouched when it was of another namespace (its pid may be alive
    there) or its name has none. A live process's files and other names stay."""
    import os
    import subprocess
    import sys

    from relayrl.weights.shm import _pid_namespace, sweep_stale

    ns = _pid_namespace()
    assert ns.isdigit() and ns != "0"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old, fresh = [f"relayrl-{dead.pid}-1-abc-0123-0", f"relayrl-{dead.pid}-abc-0123-0"], []
    fresh += [f"relayrl-{dead.pid}-{ns}-abc-0123-0", f"relayrl-{dead.pid}-{ns}-abc-0123-1"]  # ours, dead: swept
    kept = [f"relayrl-{os.getpid()}-{ns}-abc-0123-0", f"relayrl-{os.getpid()}-abc-0123-0", "relayrl-x-1",
            "other-1-2", f"relayrl-{dead.pid}-1-abc-4567-0", f"relayrl-{dead.pid}-abc-4567-0"]  # last two: fresh
    for n in old + fresh + kept:
        (tmp_path / n).write_bytes(b"x")
        if n in old or n in kept[:4]:
            os.utime(tmp_path / n, (1e9, 1e9))
    assert sorted(sweep_stale(str(tmp_path))) == sorted(str(tmp_path / n) for n in old + fresh)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


@pytest.mark.multiproc  # (a sender process of its own, 2 s)
def test_buckets_of_a_killed_sender_are_gone_when_the_next_sender_starts():
    """A sender SIGKILLed while it holds buckets (no finalizer runs) leaves its files; the next ``ShmBuckets``
    of this machine removes them before it writes its own."""
    import os
    import signal
    import subprocess
    import sys

    from relayrl.weights.layout import build_layout
    from relayrl.weights.shm import ShmBuckets

    code = ("import sys, time, torch\n"
            "from relayrl.weights.layout import build_layout\n"
            "from relayrl.weights.shm import ShmBuckets\n"
            "b = ShmBuckets(build_layout([('w', torch.zeros(64))]))\n"
            "print(b.paths[0], flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        path = proc.stdout.readline().strip()
        assert os.path.exists(path), path
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.exists(path)  # nothing ran in the killed process
    mine = ShmBuckets(build_layout([("v", torch.ones(8))]))
    try:
        assert not os.path.exists(path)
        assert all(os.path.exists(p) for p in mine.paths)
    finally:
        mine.close()
