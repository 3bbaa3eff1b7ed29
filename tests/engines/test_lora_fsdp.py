"""LoRA under FSDP2 data parallelism (2-rank gloo group on CPU): the sharded adapted model trains, merges,
runs its adapters-off reference and checkpoints as one rank does on the whole batch."""

import copy

import pytest
import torch

from relayrl.cluster import ResourcePool, WorkerGroup
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.models.lora import LoraConfig
from relayrl.workflows.losses import PolicyLoss
from relayrl.workflows.trainer_workers import PolicyWorker, ReferenceWorker

LORA = LoraConfig(enabled=True, r=4, alpha=8.0)
LOSS = PolicyLoss(agg="token-mean", kl_coef=0.0)


def _batch(tok, rows=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.tensor(tok(f"{i}+{2 * i}=")["input_ids"]) for i in range(rows // 3) for _ in range(3)]
    responses = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 12, (rows,), generator=g)]
    adv = [torch.randn(len(r), generator=g) for r in responses]
    return SequenceBatch(prompts, responses, {"advantages": adv}, groups=[i // 3 for i in range(rows)])


def _kw(tiny_dir, **over):
    return {**dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=48, optim=OptimConfig(lr=1e-2)),
                   total_steps=4, threads=1, seed=0, lora=LORA), **over}


def _group(kw, name="dp"):
    return WorkerGroup(PolicyWorker, ResourcePool(name, devices=2), "actor", backend="local", init_kwargs=kw)


def _assert_metrics_match(m1: dict, m2: list[dict]) -> None:
    assert m2[0] == pytest.approx(m2[1])  # every rank reports the global figures
    assert set(m2[0]) == set(m1)
    for k, v in m1.items():  # (ref_)forward_tokens count padding, which depends on how rows were packed
        if not k.endswith("forward_tokens"):
            assert m2[0][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


@pytest.mark.multiproc
def test_two_rank_lora_trains_merges_and_checkpoints_as_one_rank(tiny_dir, tiny_tokenizer):
    """Two updates on 2 ranks give one rank's metrics (loss, grad norm), adapters, log-probs and merged
    weights; the checkpoint holds the adapters and their Adam state only, and resumes on 1 rank exactly as the
    1-rank run continues. Tolerances: float32 sums reduced in another order (gloo's reduce-scatter, per-rank
    micro-batches), amplified by Adam's first steps (m / sqrt(v) turns a 1e-7 gradient difference into up to
    1e-4 of a 1e-2 step), as test_data_parallel.py allows for full fine-tuning."""
    batch = _batch(tiny_tokenizer)
    g = torch.Generator().manual_seed(2)
    batch.response_ids[0] = torch.randint(5, 200, (40,), generator=g)  # rank 0 gets more micro-batches
    batch.fields["advantages"][0] = torch.randn(40, generator=g)
    kw = _kw(tiny_dir)
    one = PolicyWorker(**kw)
    dp = _group(kw)
    try:
        _assert_metrics_match(one.update(batch, LOSS, seed=0), dp.split("update", batch, LOSS, seed=0))
        state2 = dp.all_rank0("state")  # after one step, saved on 2 ranks
        assert dp.all("state")[1] is None
        _assert_metrics_match(one.update(batch, LOSS, seed=1), dp.split("update", batch, LOSS, seed=1))
        adapters1 = one.state()["model"]
        final2 = dp.all_rank0("state")
        assert set(final2["model"]) == set(adapters1) == set(one.param_shapes())
        assert all(".lora_A." in n or ".lora_B." in n for n in adapters1)
        for n, t in adapters1.items():
            torch.testing.assert_close(final2["model"][n], t, atol=2e-4, rtol=1e-3, msg=n)
        assert any(float(t.abs().max()) > 1e-3 for n, t in adapters1.items() if ".lora_B." in n)  # B moved
        m1, merged2 = dict(one.named_weights()), dict(dp.all_rank0("named_weights"))
        assert dp.all("named_weights")[1] is None
        assert list(merged2) == list(m1)  # the base model's names, in its order
        for n, t in m1.items():
            torch.testing.assert_close(merged2[n], t, atol=2e-4, rtol=1e-3, msg=n)
        lp1, lp2 = one.logprobs(batch), dp.split("logprobs", batch)
        for a, b in zip(lp1, lp2, strict=True):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
        dp.all("save_pretrained", str(tiny_dir.parent / "lora-dp-saved"))
    finally:
        dp.shutdown()

    # the 2-rank checkpoint of step 1 resumes on one rank: the same second step as the 1-rank run took
    assert len(state2["optimizer"]["state"]) == len(state2["model"])  # Adam moments of the adapters only
    resumed = PolicyWorker(**kw)
    resumed.load_state(copy.deepcopy(state2))
    resumed.update(batch, LOSS, seed=1)
    for n, t in resumed.state()["model"].items():
        torch.testing.assert_close(t, adapters1[n], atol=2e-4, rtol=1e-3, msg=n)

    # the export: the merged model loads as a plain model, the adapter alone in peft's format
    from peft import PeftModel

    from relayrl.models.load import load_model

    saved = tiny_dir.parent / "lora-dp-saved"
    plain = dict(load_model(saved).named_parameters())
    for n, t in merged2.items():
        torch.testing.assert_close(plain[n], t, atol=1e-6, rtol=1e-5, msg=n)
    adapted = PeftModel.from_pretrained(load_model(tiny_dir), str(saved / "adapter"))
    ids = torch.tensor([[3, 17, 42, 9, 5]])
    torch.testing.assert_close(adapted.eval()(ids).logits, load_model(saved).eval()(ids).logits, atol=1e-5,
                               rtol=1e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize("dp_sync", ["pass", "step"])
def test_one_rank_lora_checkpoint_resumes_on_two_ranks(tiny_dir, tiny_tokenizer, dp_sync):
    """A 1-rank checkpoint loads on 2 ranks (each keeps its shard of the adapters and their Adam moments) and
    the next update is the 1-rank one; with engine.dp_sync=step too (gradients reduce-scattered once per
    optimizer step: the frozen base has none to reduce)."""
    batch = _batch(tiny_tokenizer, seed=4)
    kw = _kw(tiny_dir)
    one = PolicyWorker(**kw)
    one.update(batch, LOSS, seed=0)
    state = copy.deepcopy(one.state())
    m1 = one.update(batch, LOSS, seed=1)
    dp = _group({**kw, "engine": kw["engine"].model_copy(update={"dp_sync": dp_sync, "token_budget": 24})})
    try:
        dp.all("load_state", state)
        _assert_metrics_match(m1, dp.split("update", batch, LOSS, seed=1))
        got = dp.all_rank0("state")
    finally:
        dp.shutdown()
    for n, t in one.state()["model"].items():
        torch.testing.assert_close(got["model"][n], t, atol=2e-4, rtol=1e-3, msg=n)
    assert got["scheduler"]["last_epoch"] == 2


@pytest.mark.multiproc
def test_two_rank_lora_tri_model_reference_is_the_base(tiny_dir, tiny_tokenizer):
    """Tri-model under FSDP2: the reference is the sharded actor with its adapters off, which gives the base
    model's log-probs after the adapters trained away from it; the update's KL sees it as one rank does."""
    batch = _batch(tiny_tokenizer, rows=9, seed=3)
    kw = _kw(tiny_dir, tri_model=True)
    base = ReferenceWorker(str(tiny_dir), kw["engine"], threads=1).logprobs(batch)
    one = PolicyWorker(**kw)
    dp = _group(kw, "tri")
    loss = PolicyLoss(agg="seq-mean-token-mean", kl_coef=0.1, kl_kind="k3")
    try:
        for step in range(2):  # B = 0 at first: the second update has a reference unlike the policy
            _assert_metrics_match(one.update(batch, loss, seed=step), dp.split("update", batch, loss, seed=step))
        pairs = dp.split("logprobs", batch, with_reference=True)
    finally:
        dp.shutdown()
    policy, reference = [], []
    for lp, ref in pairs:  # each rank's (policy, reference) pair, in rank order
        policy += lp
        reference += ref
    for r, b in zip(reference, base, strict=True):
        torch.testing.assert_close(r, b, atol=1e-5, rtol=1e-5)
    assert max(float((p - r).abs().max()) for p, r in zip(policy, reference)) > 1e-3
    for a, b in zip(one.logprobs(batch), policy, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


@pytest.mark.multiproc
def test_lora_under_sequence_parallel_matches_one_rank(tiny_dir, tiny_tokenizer):
    """engine.sequence_parallel=2 (dp=1) with LoRA and the adapters-off reference: Ulysses only reroutes
    attention, and the adapters sit on position-wise linears, so the split sequence gives one rank's update,
    reference log-probs, adapters and merged weights."""
    batch = _batch(tiny_tokenizer, rows=9, seed=5)
    kw = _kw(tiny_dir, tri_model=True)
    sp_kw = {**kw, "engine": kw["engine"].model_copy(update={"sequence_parallel": 2})}
    loss = PolicyLoss(agg="seq-mean-token-mean", kl_coef=0.1, kl_kind="k3")
    one = PolicyWorker(**kw)
    sp = _group(sp_kw, "sp")
    try:
        for step in range(2):
            m1, m2 = one.update(batch, loss, seed=step), sp.split("update", batch, loss, seed=step)
            assert m2[0] == pytest.approx(m2[1])
            for k, v in m1.items():  # (each packed row padded to a multiple of 2: more forward tokens)
                if not k.endswith("forward_tokens"):
                    assert m2[0][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        pairs = sp.split("logprobs", batch, with_reference=True)
        merged2 = dict(sp.all_rank0("named_weights"))
    finally:
        sp.shutdown()
    lp1, ref1 = one.logprobs(batch, with_reference=True)
    lp2, ref2 = [t for pair in pairs for t in pair[0]], [t for pair in pairs for t in pair[1]]  # rank order
    for a, b in [*zip(lp1, lp2, strict=True), *zip(ref1, ref2, strict=True)]:
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    for n, t in one.named_weights():
        torch.testing.assert_close(merged2[n], t, atol=2e-4, rtol=1e-3, msg=n)


@pytest.mark.multiproc
def test_two_rank_lora_on_a_bf16_base_and_a_critic(tiny_dir, tiny_tokenizer):
    """A bf16 base (frozen) and float32 adapters share each FSDP2 unit (FSDP2 asks one dtype of the trainable
    parameters of a unit only, and gathers mixed dtypes as bytes): the update is one rank's to bf16 rounding of
    the base's passes (both run them in bf16), the checkpointed adapters stay float32. A critic's value head
    (fully trained, in the root unit) trains beside its adapters as on one rank."""
    from relayrl.workflows.losses import ValueLoss
    from relayrl.workflows.trainer_workers import CriticWorker

    batch = _batch(tiny_tokenizer, seed=6)
    batch.fields["values"] = [torch.zeros(len(r)) for r in batch.response_ids]
    batch.fields["returns"] = batch.fields["advantages"]
    # Adam's first step on an adapter is lr * g / (|g| + eps): with a tiny eps, sign(g) x lr, so bf16 rounding
    # flips a whole step on an element whose gradient is near 0; eps=1e-3 keeps the step proportional to g
    bf16 = _kw(tiny_dir, dtype="bfloat16", compute_dtype="bfloat16",
               engine=TrainEngineConfig(token_budget=48, optim=OptimConfig(lr=1e-2, eps=1e-3)))
    one = PolicyWorker(**bf16)
    critic = CriticWorker(**_kw(tiny_dir))
    dp, cg = _group(bf16), WorkerGroup(CriticWorker, ResourcePool("critic", devices=2), "critic", backend="local",
                                       init_kwargs=_kw(tiny_dir))
    try:
        for step in range(2):
            m1, m2 = one.update(batch, LOSS, seed=step), dp.split("update", batch, LOSS, seed=step)[0]
            assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=2e-2)
            c1 = critic.update(batch, ValueLoss(clip=None), seed=step)
            _assert_metrics_match(c1, cg.split("update", batch, ValueLoss(clip=None), seed=step))
        adapters = dp.all_rank0("state")["model"]
        heads = cg.all_rank0("state")["model"]
    finally:
        dp.shutdown()
        cg.shutdown()
    assert adapters and all(t.dtype == torch.float32 for t in adapters.values())
    for n, t in one.state()["model"].items():
        torch.testing.assert_close(adapters[n], t, atol=2e-3, rtol=2e-2, msg=lambda m, n=n: f"{n}: {m}")
    own = critic.state()["model"]
    assert {"lm_head.weight", "lm_head.bias"} <= set(heads) == set(own)
    for n, t in own.items():
        torch.testing.assert_close(heads[n], t, atol=2e-4, rtol=1e-3, msg=n)


@pytest.mark.multiproc
def test_two_rank_adapters_on_expert_tensors_train_and_merge_as_one_rank(tiny_tokenizer, tmp_path):
    """model.lora.target_parameters under FSDP2: a tiny Qwen3-MoE's fused expert tensors are split by experts
    over the two ranks, their adapters by rows; two updates give one rank's metrics and adapters, and the merged
    expert tensors (each rank's experts merged from the gathered adapter, then gathered) are one rank's merge."""
    from tests.engines.moe_workers import moe_dir

    lora = LoraConfig(enabled=True, r=4, alpha=8.0, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    kw = {**_kw(moe_dir(tiny_tokenizer, tmp_path / "moe")), "lora": lora}
    batch = _batch(tiny_tokenizer)
    one = PolicyWorker(**kw)
    dp = _group(kw, "experts")
    try:
        for step in range(2):
            _assert_metrics_match(one.update(batch, LOSS, seed=step), dp.split("update", batch, LOSS, seed=step))
        adapters2 = dp.all_rank0("state")["model"]
        merged2 = dict(dp.all_rank0("named_weights"))
        assert dp.all("named_weights")[1] is None
    finally:
        dp.shutdown()
    adapters1, merged1 = one.state()["model"], dict(one.named_weights())
    assert set(adapters2) == set(adapters1) and any("experts.lora_B" in n for n in adapters1)
    for n, t in adapters1.items():
        torch.testing.assert_close(adapters2[n], t, atol=2e-4, rtol=1e-3, msg=n)
    assert list(merged2) == list(merged1)
    expert = "model.layers.0.mlp.experts.gate_up_proj"
    assert merged1[expert].shape[0] == 4 and (merged1[expert] - dict(PolicyWorker(**kw).named_weights())[expert]
                                             ).abs().max() > 1e-4  # (the experts' adapters moved them)
    for n, t in merged1.items():
        torch.testing.assert_close(merged2[n], t, atol=2e-4, rtol=1e-3, msg=n)
