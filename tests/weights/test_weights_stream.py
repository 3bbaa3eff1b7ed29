"""The streaming relay: the sender gathers (and LoRA-merges) the actor's weights a bucket at a time and packs or
loads each before the next, so it never holds the whole gathered model; the rollout still receives the exact
bits of the full weights (built here from each rank's own shards, without the gather code under test)."""
import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.models.lora import LoraConfig
from relayrl.weights import WeightRelay, WeightStream, pack_stream, stream_full_state
from relayrl.weights.layout import build_layout
from relayrl.weights.packing import allocate_buffers, pack
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.relay import relay_weights
from relayrl.workflows.trainer_workers import PolicyWorker
from stream_workers import LiveBytes, MeteredPolicyWorker, ProbeRolloutWorker

LORA = LoraConfig(enabled=True, r=4, alpha=8.0)
GATHER_BYTES = 8 << 10  # local shard bytes per all-gather: the tiny model (1.1 MB) is many buckets


def _batch(tok, rows=6):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.tensor(tok(f"{i}+{2 * i}=")["input_ids"]) for i in range(rows // 3) for _ in range(3)]
    responses = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 8, (rows,), generator=g)]
    adv = [torch.randn(len(r), generator=g) for r in responses]
    return SequenceBatch(prompts, responses, {"advantages": adv}, groups=[i // 3 for i in range(rows)])


def _kw(tiny_dir, lora=None, **over):
    return dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=48, optim=OptimConfig(lr=1e-2)),
                total_steps=4, threads=1, seed=0, lora=lora, **over)


def _rollout_weights(rollout: WorkerGroup) -> list[dict[str, torch.Tensor]]:
    return rollout.all(ProbeRolloutWorker.weights)


def _full_from_shards(shards: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's rows of each weight, concatenated (torch.chunk's split: rank order is row order); a tensor
    no rank shards, rank 0's."""
    return {n: torch.cat([s[n][0] for s in shards]) if sharded else t for n, (t, sharded) in shards[0].items()}


def _merged_from_shards(shards: list[dict], adapters: list[dict]) -> dict[str, torch.Tensor]:
    """The merge as each rank computes it on its rows, ``W_rows + (B_rows @ A * scale).to(W.dtype)`` with the full
    ``A``, rows concatenated: the bits the relay delivered before it streamed."""
    out = _full_from_shards(shards)
    for prefix in adapters[0]:
        a = torch.cat([ad[prefix][0] for ad in adapters])
        rows = []
        for s, ad in zip(shards, adapters):
            w, b, scale = s[f"{prefix}.weight"][0], ad[prefix][1], ad[prefix][2]
            rows.append(w + (b @ a.to(b.dtype) * scale).to(w.dtype))
        out[f"{prefix}.weight"] = torch.cat(rows)
    return out


def _assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(want) <= set(got)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n


@pytest.mark.multiproc
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_split_pools_receive_exact_weights_and_the_sender_holds_one_bucket(tiny_dir, tiny_tokenizer, lora):
    """A 2-rank FSDP2 actor relays to a 2-rank rollout through shared memory (and packed, off-policy, and over
    the driver's pipes): every rollout rank gets the bits of the full (merged) weights. Actor rank 0's gathered
    tensors alive at once stay within one all-gather (world x its local bytes, a tensor larger than that alone)
    plus the tensor being packed: a fraction of the model, which the relay used to hold whole."""
    actor = WorkerGroup(MeteredPolicyWorker, ResourcePool("stream-actor", devices=2), "actor", backend="local",
                        init_kwargs=_kw(tiny_dir, lora, gather_bytes=GATHER_BYTES))
    rollout = WorkerGroup(ProbeRolloutWorker, ResourcePool("stream-rollout", devices=2), "rollout", backend="local",
                          init_kwargs=dict(model_path=str(tiny_dir), threads=1))
    try:
        actor.split(PolicyWorker.update, _batch(tiny_tokenizer), PolicyLoss(agg="token-mean", kl_coef=0.0), seed=0)
        shards = actor.all(MeteredPolicyWorker.shards)
        want = (_full_from_shards(shards) if lora is None else
                _merged_from_shards(shards, actor.all(MeteredPolicyWorker.adapters)))
        assert not torch.equal(_rollout_weights(rollout)[0]["model.layers.0.mlp.up_proj.weight"],
                               want["model.layers.0.mlp.up_proj.weight"])  # (the update moved the weights)
        relay = WeightRelay(bucket_mb=0.1)
        m = relay_weights(actor, rollout, version=1, relay=relay)
        assert m["relay/bytes"] == sum(t.numel() * t.element_size() for t in want.values())
        for got in _rollout_weights(rollout):
            _assert_bits(got, want)

        packed = relay.pack_from_group(actor, PolicyWorker.pack_weights_into, version=2)
        relay.apply_to_group(packed, rollout)
        assert rollout.all(ProbeRolloutWorker.version) == [2, 2]
        for got in _rollout_weights(rollout):
            _assert_bits(got, want)
        # (the shared-memory relay and the packed one: each streams; the pipes' below keep rank 0's host copy)
        gathered, merged = actor.all(MeteredPolicyWorker.peaks)[0]
        world, model = 2, sum(t.numel() * t.element_size() for t in want.values())
        largest = max(t.numel() * t.element_size() for t in want.values())
        bound = world * (GATHER_BYTES + largest // world + 1) + largest
        assert 0 < gathered <= bound and 4 * bound < model, (gathered, bound, model)
        if lora is not None:  # merged rows: one bucket of this rank's rows (plus the layer being merged)
            assert 0 < merged <= GATHER_BYTES + 2 * (largest // world + 1), merged

        assert relay_weights(actor, rollout, version=3, relay=WeightRelay(transport="pickle"))["relay/bytes"] > 0
        for got in _rollout_weights(rollout):
            _assert_bits(got, want)
        relay.close()
    finally:
        actor.shutdown()
        rollout.shutdown()


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_colocated_rollout_receives_exact_weights_merged_a_layer_at_a_time(tiny_dir, tiny_tokenizer, lora,
                                                                           monkeypatch):
    """An actor and a rollout both in the driver: the engine loads the actor's weights as they come. LoRA: each
    layer is merged when its turn comes and dropped once loaded (at most two merged layers alive at once, not
    all of them), and the rollout holds exactly ``merged_weights``' bits; full fine-tuning: the parameters'."""
    from relayrl.models import lora as lora_lib

    live, merge = LiveBytes(), lora_lib.iter_merged_weights

    def metered(model):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for name, t in merge(model):
            if t.untyped_storage().data_ptr() not in params:  # a merged layer, not a live parameter
                live.add([t])
            yield name, t

    monkeypatch.setattr(lora_lib, "iter_merged_weights", metered)
    actor = WorkerGroup(PolicyWorker, ResourcePool("co-actor", devices=1), "actor", backend="local",
                        init_kwargs=_kw(tiny_dir, lora))
    rollout = WorkerGroup(ProbeRolloutWorker, ResourcePool("co-rollout", devices=1), "rollout", backend="local",
                          init_kwargs=dict(model_path=str(tiny_dir), threads=1))
    assert actor.in_driver and rollout.in_driver
    actor.one(PolicyWorker.update, _batch(tiny_tokenizer), PolicyLoss(agg="token-mean", kl_coef=0.0), seed=0)
    relay_weights(actor, rollout, version=1)
    peak = live.peak  # (before `merged_weights` below keeps every merged layer, through the same generator)
    worker = actor._ranks.worker  # (in the driver: the actor itself)
    want = dict(lora_lib.merged_weights(worker.engine.model) if lora is not None else
                [(n, t.detach()) for n, t in worker.engine.named_weights()])
    _assert_bits(_rollout_weights(rollout)[0], want)
    if lora is not None:
        adapted = {lora_lib.base_name(n) for n, _ in worker.engine.model.named_parameters() if ".base_layer." in n}
        sizes = sorted((want[n].numel() * want[n].element_size() for n in adapted), reverse=True)
        assert 0 < peak <= sizes[0] + sizes[1] < sum(sizes) / 4, (peak, sizes[:2], sum(sizes))


def test_pack_stream_equals_pack_and_names_what_is_wrong():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g).to(torch.bfloat16)),
             ("c", torch.randn(2, 2, generator=g))]
    layout = build_layout(named, bucket_mb=40 / 2**20)  # a few buckets
    want = pack(named, layout)
    got = pack_stream(reversed(named), layout, out=allocate_buffers(layout))  # any order
    assert len(got) == len(layout.buckets) > 1 and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="ended without \\['c'\\]"):
        pack_stream(iter(named[:2]), layout, out=allocate_buffers(layout))
    with pytest.raises(ValueError, match="'a' came twice"):
        pack_stream(iter([named[0], named[0]]), layout, out=allocate_buffers(layout))
    with pytest.raises(ValueError, match="'z' is not in layout"):
        pack_stream(iter([("z", torch.zeros(1))]), layout, out=allocate_buffers(layout))
    with pytest.raises(ValueError, match="weight 'a': layout \\(3, 4\\)"):
        pack_stream(iter([("a", torch.zeros(4, 3))]), layout, out=allocate_buffers(layout))


def test_relay_packs_a_weight_stream_without_reading_its_held_tensors():
    """`WeightStream.held` gives the layout (names, shapes, dtypes); the relay packs `values` as they come, read
    once: the receiver gets the values, not the held tensors."""
    from weights_workers import tiny_engine

    engine = tiny_engine(1)
    held = [(n, p.detach()) for n, p in engine.model.named_parameters()]
    values = [(n, torch.full_like(t, 0.5)) for n, t in held]
    read = []

    def stream():
        for n, t in values:
            read.append(n)
            yield n, t

    m = WeightRelay(bucket_mb=0.01).push(WeightStream(held, stream()), [engine], version=1)
    assert read == [n for n, _ in held] and m["relay/tensors"] == len(held)
    assert all(torch.all(p == 0.5) for p in engine.model.parameters())
    out = list(stream_full_state(iter(values)))  # plain tensors pass as they are (no copy)
    assert [n for n, _ in out] == [n for n, _ in values]
    assert all(a.data_ptr() == b.data_ptr() for (_, a), (_, b) in zip(out, values))
