"""Ulysses sequence parallelism (engine.sequence_parallel): two SP ranks compute what one rank computes.

Tolerances: float32 throughout. Sequence parallelism changes no formula, only where each token's
activations are computed and the order of a few sums (attention over heads split across ranks, the
gradient of a weight summed over two ranks' tokens by FSDP2's reduce-scatter instead of in one matrix
product), so the log-probs and the loss agree to float32 rounding (~1e-6 relative); the weights after an
Adam step agree to 2e-4 as in test_data_parallel.py (Adam divides by sqrt(v), which amplifies rounding in
near-zero gradients)."""

import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.trainer_workers import CriticWorker, PolicyWorker


def _batch(tok, rows=12, long_row=0):
    """Groups of 3 rows sharing a prompt, responses of 2..11 tokens; ``long_row`` makes row 0 that long."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.tensor(tok(f"{i}+{2 * i}=")["input_ids"]) for i in range(rows // 3) for _ in range(3)]
    responses = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 12, (rows,), generator=g)]
    if long_row:
        responses[0] = torch.randint(5, 200, (long_row,), generator=g)
    adv = [torch.randn(len(r), generator=g) for r in responses]
    return SequenceBatch(prompts, responses, {"advantages": adv}, groups=[i // 3 for i in range(rows)])


def test_shard_keeps_its_columns_and_the_tokens_they_predict(tiny_tokenizer):
    """A packed row of two units cut in two: each rank's ids and global positions are its half of the
    columns; a response token goes to the rank holding the position that predicts it (a response that
    straddles the cut is predicted from both halves); the index lists cover every token once."""
    from relayrl.engines.training.ulysses import SequenceParallel, Shard
    from relayrl.models.packing import PackUnit, build_packed_batch

    prompts = [torch.tensor([1, 2, 3, 4]), torch.tensor([4, 5])]
    responses = [torch.tensor([6, 7, 8, 9, 13, 14]), torch.tensor([10, 11, 12])]
    pb = build_packed_batch(prompts, responses, [[PackUnit((0,), 4, (6,)), PackUnit((1,), 2, (3,))]])
    pb = pb.pad_to(2)
    assert pb.input_ids.shape == (1, 16)  # 10 + 5 tokens, one of padding
    halves = [Shard.of(pb, SequenceParallel(2, r, None)) for r in range(2)]
    for r, cut in enumerate(halves):
        assert torch.equal(cut.input_ids, pb.input_ids[:, 8 * r:8 * r + 8])
        assert torch.equal(cut.position_ids, pb.position_ids[:, 8 * r:8 * r + 8])
        assert torch.equal(cut.rows, pb.token_pack[cut.index[r]])
        assert torch.equal(cut.cols + 8 * r, pb.token_src[cut.index[r]])
        assert torch.equal(cut.targets, pb.targets[cut.index[r]])
    # response 0 (columns 4..9) is predicted from columns 3..8: its last token from rank 1's first column;
    # response 1 (columns 12..14) from columns 11..13, rank 1's 3..5
    assert halves[0].targets.tolist() == [6, 7, 8, 9, 13]
    assert halves[1].targets.tolist() == [14, 10, 11, 12]
    assert halves[1].cols.tolist() == [0, 3, 4, 5]
    assert sorted(torch.cat(halves[0].index).tolist()) == list(range(9))
    assert pb.position_ids[0, 8:11].tolist() == [8, 9, 0]  # global positions: rotary sees where a token is
    with pytest.raises(ValueError, match="not a multiple of engine.sequence_parallel=2"):
        Shard.of(build_packed_batch(prompts, responses, [[PackUnit((1,), 2, (3,))]]),  # 5 tokens
                 SequenceParallel(2, 0, None))


def _group(cls, kw, devices=2):
    return WorkerGroup(cls, ResourcePool("sp", devices=devices), "actor", backend="local", init_kwargs=kw)


@pytest.mark.multiproc
@pytest.mark.parametrize("packing, agg", [("shared_prompt", "token-mean"), ("sequences", "token-mean"),
                                          ("shared_prompt", "prompt-mean-token-mean")])
def test_two_sp_ranks_match_one_rank(tiny_dir, tiny_tokenizer, packing, agg):
    """sp=2, dp=1: log-probs before and after two updates, the update's metrics (loss, grad norm) and the
    weights equal one rank's. Packed rows hold several units, so unit (and response) boundaries fall on both
    sides of the shard boundary; a small token budget gives several micro-batches; the packed lengths are odd
    (padded to a multiple of 2). Prompt-level aggregation counts the SP group's prompt groups once, as the
    mini-batches count its rows."""
    batch = _batch(tiny_tokenizer, long_row=40)
    engine = dict(token_budget=96, packing=packing, optim=OptimConfig(lr=1e-2))
    kw = dict(model_path=str(tiny_dir), total_steps=4, threads=1, seed=0)
    loss = PolicyLoss(agg=agg, kl_coef=0.0)
    one = PolicyWorker(**kw, engine=TrainEngineConfig(**engine))
    sp = _group(PolicyWorker, {**kw, "engine": TrainEngineConfig(**engine, sequence_parallel=2)})
    try:
        for a, b in zip(one.logprobs(batch), sp.split(PolicyWorker.logprobs, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        for step in range(2):  # the second update in two mini-batches, cut from the group's rows counted once
            m1 = one.update(batch, loss, seed=step, mini_batches=step + 1)
            m2 = sp.split(PolicyWorker.update, batch, loss, seed=step, mini_batches=step + 1)
            assert m2[0] == pytest.approx(m2[1])  # both SP ranks report the group's figures
            assert set(m2[0]) == set(m1)
            for k, v in m1.items():
                if k == "actor/forward_tokens":  # each packed row padded to a multiple of 2: at most 1 more each
                    assert v <= m2[0][k] < 1.1 * v
                else:
                    assert m2[0][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        w1 = dict(one.named_weights())
        w2 = dict(sp.all_rank0(PolicyWorker.named_weights))
        for n, t in w1.items():
            torch.testing.assert_close(w2[n], t, atol=2e-4, rtol=1e-3, msg=n)
        for a, b in zip(one.logprobs(batch), sp.split(PolicyWorker.logprobs, batch)):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    finally:
        sp.shutdown()


def _gqa_model(tiny_dir, where, kv_heads):
    """The tiny model's shape with 4 query heads and ``kv_heads`` key/value heads (random weights)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(tiny_dir)
    assert conf.num_attention_heads == 4
    conf.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(conf).save_pretrained(where)
    for f in tiny_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, where / f.name)
    return where


@pytest.mark.multiproc
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_splits_or_repeats_kv_heads(tiny_dir, tiny_tokenizer, tmp_path, kv_heads):
    """1 key/value head cannot be split over 2 ranks: it is repeated to the query heads first; 2 are split
    (each rank's 2 query heads share its one). Either way one update equals one rank's."""
    path = _gqa_model(tiny_dir, tmp_path / f"kv{kv_heads}", kv_heads)
    batch = _batch(tiny_tokenizer, rows=9)
    kw = dict(model_path=str(path), total_steps=2, threads=1, seed=0)
    one = PolicyWorker(**kw, engine=TrainEngineConfig(optim=OptimConfig(lr=1e-2)))
    sp = _group(PolicyWorker, {**kw, "engine": TrainEngineConfig(sequence_parallel=2, optim=OptimConfig(lr=1e-2))})
    try:
        for a, b in zip(one.logprobs(batch), sp.split(PolicyWorker.logprobs, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        m1 = one.update(batch, PolicyLoss(), seed=0)
        m2 = sp.split(PolicyWorker.update, batch, PolicyLoss(), seed=0)[0]
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4)
        w2 = dict(sp.all_rank0(PolicyWorker.named_weights))
        for n, t in one.named_weights():
            torch.testing.assert_close(w2[n], t, atol=2e-4, rtol=1e-3, msg=n)
    finally:
        sp.shutdown()


@pytest.mark.multiproc
def test_critic_values_and_tri_model_reference_match_one_rank(tiny_dir, tiny_tokenizer):
    """The per-token outputs the trainer returns come back in row order: a critic's values (and its update),
    and a tri-model actor's policy and reference log-probs from one pass."""
    from relayrl.workflows.losses import ValueLoss

    batch = _batch(tiny_tokenizer, rows=9)
    batch.fields["returns"] = [torch.randn(len(r), generator=torch.Generator().manual_seed(i))
                               for i, r in enumerate(batch.response_ids)]
    batch.fields["values"] = [torch.zeros(len(r)) for r in batch.response_ids]
    kw = dict(model_path=str(tiny_dir), total_steps=2, threads=1, seed=0)
    engine, sp_engine = TrainEngineConfig(token_budget=40), TrainEngineConfig(token_budget=40, sequence_parallel=2)
    one = CriticWorker(**kw, engine=engine)
    critic = _group(CriticWorker, {**kw, "engine": sp_engine})
    try:
        for a, b in zip(one.values(batch), critic.split(CriticWorker.values, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        m1 = one.update(batch, ValueLoss(), seed=0)
        m2 = critic.split(CriticWorker.update, batch, ValueLoss(), seed=0)[0]
        for k in ("critic/grad_norm", "critic/vf_loss"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-4), k
    finally:
        critic.shutdown()
    one = PolicyWorker(**kw, engine=engine, tri_model=True)
    actor = _group(PolicyWorker, {**kw, "engine": sp_engine, "tri_model": True})
    try:
        want = one.logprobs(batch, with_reference=True)
        got = actor.split(PolicyWorker.logprobs, batch, with_reference=True)
        pol = [t for pair in got for t in pair[0]]
        ref = [t for pair in got for t in pair[1]]
        for a, b in zip(want[0] + want[1], pol + ref):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    finally:
        actor.shutdown()


@pytest.mark.multiproc
def test_streamed_update_with_step_sync_matches_one_rank(tiny_dir, tiny_tokenizer):
    """Periodic asynchrony's accumulate / optim_step with dp_sync=step (the gradients reduced by a one-token
    pass at the end, whose single response token lives on one SP rank only) equals one rank's update; the SP
    ranks also recompute their layers in the backward pass (gradient checkpointing: the all-to-alls run again)."""
    batch = _batch(tiny_tokenizer)
    kw = dict(model_path=str(tiny_dir), total_steps=2, threads=1, seed=0)
    engine = dict(token_budget=48, dp_sync="step", optim=OptimConfig(lr=1e-2))
    loss = PolicyLoss(agg="token-mean")
    one = PolicyWorker(**kw, engine=TrainEngineConfig(**engine))
    sp = _group(PolicyWorker, {**kw, "engine": TrainEngineConfig(**engine, sequence_parallel=2,
                                                                 gradient_checkpointing=True)})
    try:
        m1 = one.update(batch, loss, seed=0)
        first, second = batch.select(range(6)), batch.select(range(6, 12))
        sp.split(PolicyWorker.accumulate, first, loss, fresh=True)
        sp.split(PolicyWorker.accumulate, second, loss)
        m2 = sp.all(PolicyWorker.optim_step)
        assert m2[0] == pytest.approx(m2[1])
        assert m2[0]["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4)
        assert m2[0]["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-4, abs=1e-7)
        w2 = dict(sp.all_rank0(PolicyWorker.named_weights))
        for n, t in one.named_weights():
            torch.testing.assert_close(w2[n], t, atol=2e-4, rtol=1e-3, msg=n)
    finally:
        sp.shutdown()


def _lift_cpu_flex_guard() -> None:
    """Let FlexAttention run backward on CPU in this process: torch's unfused reference implementation (dense
    scores, torch's own autograd formulas) runs it once the "no CPU backward" guard sees detached inputs (as
    test_flex_attention.py's ``cpu_flex_backward`` does for one test)."""
    import torch.nn.attention.flex_attention as fa

    guard = fa._validate_device
    fa._validate_device = lambda q, k, v: guard(q.detach(), k.detach(), v.detach())


class CPUFlexPolicyWorker(PolicyWorker):
    """A policy worker whose rank process runs FlexAttention's backward on CPU (:func:`_lift_cpu_flex_guard`)."""

    def __init__(self, *args, **kwargs) -> None:
        _lift_cpu_flex_guard()
        super().__init__(*args, **kwargs)


@pytest.mark.multiproc
def test_flex_attention_under_sequence_parallelism_matches_one_rank(tiny_dir, tiny_tokenizer, monkeypatch):
    """model.attn_implementation=flex_attention with sp=2: each SP rank runs FlexAttention over every token for its
    half of the heads under the pack's whole BlockMask (no dense [L, L] mask), and the log-probs, one update's
    figures and the weights after it equal one rank's flex run. (CPU: torch's reference implementation of
    FlexAttention, the guard against its CPU backward lifted in both processes.)"""
    import torch.nn.attention.flex_attention as fa

    if not hasattr(fa, "_validate_device"):
        pytest.skip("this torch build has no CPU guard to lift (torch.nn.attention.flex_attention._validate_device)")
    guard = fa._validate_device
    monkeypatch.setattr(fa, "_validate_device", lambda q, k, v: guard(q.detach(), k.detach(), v.detach()))
    batch = _batch(tiny_tokenizer, long_row=40)
    kw = dict(model_path=str(tiny_dir), total_steps=2, threads=1, seed=0, attn_implementation="flex_attention")
    engine = dict(token_budget=200, optim=OptimConfig(lr=1e-2))
    one = PolicyWorker(**kw, engine=TrainEngineConfig(**engine))
    assert one.engine.flex
    sp = _group(CPUFlexPolicyWorker, {**kw, "engine": TrainEngineConfig(**engine, sequence_parallel=2)})
    try:
        for a, b in zip(one.logprobs(batch), sp.split(PolicyWorker.logprobs, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        m1 = one.update(batch, PolicyLoss(), seed=0)
        m2 = sp.split(PolicyWorker.update, batch, PolicyLoss(), seed=0)[0]
        for k in ("actor/grad_norm", "actor/pg_loss", "actor/entropy"):
            if k in m1:
                assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-7), k
        w2 = dict(sp.all_rank0(PolicyWorker.named_weights))
        for n, t in one.named_weights():
            torch.testing.assert_close(w2[n], t, atol=2e-4, rtol=1e-3, msg=n)
    finally:
        sp.shutdown()


def test_refusals_name_the_key_before_work_starts(tiny_dir):
    """What the engine cannot split is refused when it is built, on one process: no collective has run."""
    from relayrl.models.load import load_model

    def refused(words, **kw):
        with pytest.raises(ValueError) as info:
            PolicyWorker(model_path=str(tiny_dir), total_steps=1, threads=1, **kw)
        for w in words:
            assert w in str(info.value), (w, str(info.value))

    refused(["engine.sequence_parallel=2", "trainer group's 1 ranks", "cluster.devices"],
            engine=TrainEngineConfig(sequence_parallel=2))
    refused(["engine.sequence_parallel=8", "4 query heads", "divisor of 4"], engine=TrainEngineConfig(sequence_parallel=8))
    refused(["attn_implementation='eager'", "model.attn_implementation=sdpa"],
            engine=TrainEngineConfig(sequence_parallel=2), attn_implementation="eager")
    with pytest.raises(ValueError, match="engine.packing=none lays rows out padded"):
        TrainEngineConfig(sequence_parallel=2, packing="none")
    assert load_model(tiny_dir).config.num_attention_heads == 4


def test_a_model_that_cannot_be_packed_is_refused_under_sequence_parallelism():
    """Qwen3.5's linear-attention layers cannot be packed, and Ulysses splits packed rows: refused at start with
    the reason, before any collective."""
    from relayrl.engines.training.torch_engine import TorchTrainingEngine

    from tests.models.architectures import build

    with pytest.raises(ValueError, match="engine.sequence_parallel=2 splits packed rows, and this model cannot be "
                                         "packed: its linear-attention layers .* set engine.sequence_parallel=1"):
        TorchTrainingEngine(build("qwen3_5_text"), TrainEngineConfig(sequence_parallel=2), total_steps=1,
                            trainable=False)



@pytest.mark.multiproc
def test_two_sp_ranks_replay_and_record_moe_routing_as_one_rank(tiny_tokenizer, tmp_path):
    """Routing replay under sequence parallelism: each rank replays its columns' routes, and a recording pass joins
    the group's columns, so the log-probs with moved routes and the recorded routes are one rank's."""
    from tests.engines.moe_workers import RoutesWorker, moe_dir, with_routes

    path = moe_dir(tiny_tokenizer, tmp_path / "moe")
    batch = _batch(tiny_tokenizer, rows=9)
    kw = dict(model_path=str(path), total_steps=2, threads=1, seed=0, routing_replay=True)
    one = RoutesWorker(**kw, engine=TrainEngineConfig(token_budget=64))
    sp = _group(RoutesWorker, {**kw, "engine": TrainEngineConfig(token_budget=64, sequence_parallel=2)})
    try:
        own = one.routes(batch)
        lengths = [len(p) + len(q) for p, q in zip(batch.prompt_ids, batch.response_ids)]
        assert [r.shape for r in own] == [(n, 2, 2) for n in lengths]
        for a, b in zip(own, sp.split(RoutesWorker.routes, batch)):
            assert torch.equal(a, b)
        moved = with_routes(batch, [(r + 1) % 4 for r in own])
        free = one.logprobs(with_routes(batch, own))
        replayed = one.logprobs(moved)
        for a, b in zip(replayed, sp.split(PolicyWorker.logprobs, moved)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert max(float((a - c).abs().max()) for a, c in zip(replayed, free)) > 1e-2  # (the routes mattered)
    finally:
        sp.shutdown()
